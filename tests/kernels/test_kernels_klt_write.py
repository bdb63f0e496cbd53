"""Compress-on-write of transform-coded (klt) keys (``kernels.compress_write``) against the reference write path
(``ops.write(..., backend="reference")``: ``KeyTransformCoder.quantize`` + ``write_slots``).

Transforms are calibrated-like (``tests.helpers.klt_cases.uneven_transform``: random orthogonal A, B = A^T, a random
mean, bits 8, 7, ..., 0, random sorted levels), RoPE partial or whole with an attention scaling != 1, positions up to
~131k (large angles), vLLM padding slots, both input forms ([N, H, D] and rows [R, T, H, D] read in place).

Tolerance: value fields are the reference's (value codes up to ties, as ``test_kernels_compress`` allows). A key's
code may differ only in coefficients one level apart whose float64 coefficient lies within 1e-7 (relative to the L1
norm of the key's centered pre-RoPE channels) of a decision threshold — the kernel's fp32 RoPE (angle reduced in
float64) and fp32-accurate products round in another order than the reference's float64 RoPE and fp32 einsum — in at
most 0.1 % of the (token, head) codes or 2 codes. Measured (interpreter, 8192 tokens x 2 heads, D = 128/64/80/96,
whole and half RoPE): 99.963-100 % of the codes equal, every flip one level and at most 4e-9 from its threshold; a
PyTorch emulation of the GPU's tf32x3 products (``WriteTuning.klt_precision``): 99.963-100 %, at most 4e-9.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import triton
import triton.language as tl

from jetson_tq import ops
from jetson_tq.codec.kv import KVCodec
from jetson_tq.errors import ShapeError
from jetson_tq.format import KVFormat, PagedLayout
from jetson_tq.kernels._common import INTERPRET, constexpr_bundle, klt_constants, page_spec
from jetson_tq.kernels._tiles import klt_keys, klt_levels, klt_operands, rope_cos_sin
from jetson_tq.kernels.compress_write_plan import compress_write
from jetson_tq.paged import read_slots
from jetson_tq.validate import FAULT_NONE, StoreLimits, store_fault_code
from tests.helpers.kernel_cases import DEVICE, GPU, fresh_seed, vllm_block_table, vllm_slot_mapping
from tests.helpers.klt_cases import STRUCTURES, tie_distance, uneven_transform
from tests.kernels.test_kernels_compress import _expect_ties_only, _value_tie_distance, poisoned_tokens

pytestmark = pytest.mark.kernel

TIE = 1e-7  # relative tie distance within which a coefficient may round to the other level
SCALE = 1.3  # RoPE attention scaling of every case
MAX_POS = 131_072


def _klt_format(value_mode: str = "group") -> KVFormat:
    return KVFormat(key_mode="klt", key_code_bytes=52, value_mode=value_mode, value_bits=3)


def _codec(
    d: int, rotary_dim: int, gen: torch.Generator, raw_dtype=torch.float16, value_mode="group", kind: str = "any"
):
    fmt = _klt_format(value_mode)
    t = uneven_transform(2, d, fmt.key_code_bits(d), rotary_dim, SCALE, gen, **STRUCTURES[kind])
    return fmt, PagedLayout(fmt, d, 16), KVCodec(fmt, d, raw_dtype=raw_dtype, key_transform=t)


# (head dim, rotary dim, input dtype, input form, value mode, transform structure: klt_cases.STRUCTURES)
CASES = [
    (128, 128, torch.float16, "flat", "group", "any"),
    (128, 64, torch.bfloat16, "rows", "group", "any"),
    (64, 64, torch.float32, "flat", "group", "any"),
    (80, 40, torch.float16, "rows", "group", "any"),
    (96, 96, torch.bfloat16, "flat", "fp16", "any"),
    (96, 48, torch.float16, "flat", "group", "any"),
    (128, 128, torch.float16, "flat", "group", "bytes"),
    (80, 40, torch.bfloat16, "rows", "group", "bytes"),
]


@pytest.mark.parametrize(
    "d,rotary_dim,dtype,form,value_mode,kind",
    CASES,
    ids=[f"D{c[0]}-rot{c[1]}-{str(c[2])[6:]}-{c[3]}-{c[5]}" for c in CASES],
)
def test_klt_write_matches_reference(d, rotary_dim, dtype, form, value_mode, kind):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    fmt, layout, codec = _codec(d, rotary_dim, gen, value_mode=value_mode, kind=kind)
    hkv, bs = 2, 16
    if form == "flat":  # vLLM: shuffled blocks, -1 padding; positions from a random start per sequence
        lens = [3000, 1000, 7] if GPU else [30, 9]
        table = vllm_block_table(lens, bs, pad_blocks=1, gen=gen)
        slots, who = vllm_slot_mapping(table, lens, bs)
        start = torch.randint(0, MAX_POS - max(lens), (len(lens),), generator=gen)
        positions = torch.where(who[:, 0] >= 0, start[who[:, 0].clamp_min(0)] + who[:, 1], 0)
        n, nblocks = slots.shape[0], int(table.max()) + 2
        k = (torch.randn(n, hkv, d, generator=gen) * 2).to(dtype)
        v = torch.randn(n, hkv, d, generator=gen).to(dtype)
    else:  # rows [R, T, H, D]: strided views of [R, H, T, D] (a cache append), positions [R, T]
        r, t = (8, 500) if GPU else (3, 11)
        nblocks = (r * t) // bs + 3
        slots = torch.randperm(nblocks * bs, generator=gen)[: r * t]
        slots[::7] = -1
        positions = torch.randint(0, MAX_POS - t, (r, 1), generator=gen) + torch.arange(t)
        k = (torch.randn(r, hkv, t, d, generator=gen) * 2).to(dtype).permute(0, 2, 1, 3)
        v = torch.randn(r, hkv, t, d, generator=gen).to(dtype).permute(0, 2, 1, 3)
    poison = torch.randint(0, 256, (nblocks, hkv, layout.page_bytes), dtype=torch.uint8, generator=gen)
    ref_pages = poison.clone()
    ops.write(k, v, slots, ref_pages, layout, codec, backend="reference", positions=positions)
    pages = poison.clone().to(DEVICE)
    dev = [x.to(DEVICE) for x in (k, v, slots, positions)]
    ops.write(dev[0], dev[1], dev[2], pages, layout, codec, backend="triton", positions=dev[3])
    msg = f"seed={seed} D={d} rot={rotary_dim} {dtype} {form}"
    flat, vals = k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)
    _expect_reference(codec, layout, flat, vals, positions.reshape(-1), slots, pages.cpu(), ref_pages, poison, msg)


def _expect_reference(codec, layout, k, vals, positions, slots, pages, ref_pages, poison, msg):
    """Pages as the reference writes them: key codes and value codes up to ties, every other field bitwise, nothing
    written outside the slots; decoded keys close."""
    keep = slots >= 0
    written = slots[keep]
    got = read_slots(pages, layout, written, codec.raw_dtype)
    want = read_slots(ref_pages, layout, written, codec.raw_dtype)
    order = torch.nonzero(keep).squeeze(1)
    for f in layout.fmt.fields(layout.head_dim):
        if f.name == "val_codes":  # values: ties only, as ``test_kernels_compress`` allows
            tie = _value_tie_distance(codec, vals[order])
            _expect_ties_only(got[f.name], want[f.name], tie, 1e-3, layout.fmt.value_bits, layout.head_dim, msg)
        elif f.name != "key_code":
            assert torch.equal(got[f.name], want[f.name]), f"{msg}: {f.name} differs"
    coder = codec.key_coder
    cg, cw = coder._unpack(got["key_code"]), coder._unpack(want["key_code"])
    diff = cg != cw
    codes = int(diff.any(-1).sum())
    assert codes <= max(2, 1e-3 * diff[..., 0].numel()), f"{msg}: {codes} of {diff[..., 0].numel()} codes differ"
    if codes:
        assert bool(((cg - cw).abs()[diff] == 1).all()), f"{msg}: a coefficient differs by more than one level"
        rows = diff.flatten(1).any(1)  # the tokens with a differing code (the distances are [N, H, D, 255] wide)
        worst = tie_distance(coder, k[keep][rows], positions[keep][rows])[diff[rows]].max().item()
        assert worst <= TIE, f"{msg}: a coefficient differs {worst:.2e} from its threshold (> {TIE:g})"
    pos = positions[keep][:, None]
    kg = codec.decode_keys({"key_code": got["key_code"]}, pos, 1)
    kw = codec.decode_keys({"key_code": want["key_code"]}, pos, 1)
    assert (kg - kw).norm() <= 1e-2 * kw.norm(), f"{msg}: decoded keys differ"
    nblocks, hkv, bs = pages.shape[0], pages.shape[1], layout.block_size
    untouched = torch.ones(nblocks * bs, dtype=torch.bool)
    untouched[written] = False
    region = untouched.view(nblocks, 1, bs).expand(nblocks, hkv, bs)
    offs = layout.offsets()
    for f in layout.fmt.fields(layout.head_dim):

        def reg(p: torch.Tensor, f=f) -> torch.Tensor:
            return p[:, :, offs[f.name] : offs[f.name] + bs * f.nbytes].reshape(nblocks, hkv, bs, f.nbytes)

        assert torch.equal(reg(pages)[region], reg(poison)[region]), f"{msg}: wrote outside its slots ({f.name})"


def test_klt_rows_store_what_flat_tokens_store():
    """Rows [R, T, H, D] read in place (positions [R, T]) store exactly what the same tokens flattened store."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    _, layout, codec = _codec(80, 40, gen)
    r, t, hkv, d = 3, 9, 2, 80
    k = torch.randn(r, hkv, t, d, generator=gen).half().permute(0, 2, 1, 3)
    v = torch.randn(r, hkv, t, d, generator=gen).half().permute(0, 2, 1, 3)
    slots = torch.randperm(4 * 16, generator=gen)[: r * t].to(DEVICE)
    positions = (torch.randint(0, MAX_POS, (r, 1), generator=gen) + torch.arange(t)).to(DEVICE)
    out = []
    for kk, vv in ((k, v), (k.reshape(r * t, hkv, d), v.reshape(r * t, hkv, d))):
        pages = torch.zeros(4, hkv, layout.page_bytes, dtype=torch.uint8, device=DEVICE)
        compress_write(kk.to(DEVICE), vv.to(DEVICE), slots, pages, layout, codec, positions=positions)
        out.append(pages.cpu())
    assert torch.equal(out[0], out[1]), f"seed={seed}: rows and flat pages differ"


def test_klt_write_needs_positions():
    gen = torch.Generator().manual_seed(0)
    _, layout, codec = _codec(64, 64, gen)
    k = torch.randn(5, 2, 64).half().to(DEVICE)
    slots = torch.arange(5, device=DEVICE)
    pages = torch.zeros(2, 2, layout.page_bytes, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ShapeError, match="positions"):
        compress_write(k, k, slots, pages, layout, codec)
    with pytest.raises(ShapeError, match="positions"):
        ops.write(k, k, slots, pages, layout, codec, backend="triton")
    with pytest.raises(ShapeError, match="positions"):
        compress_write(k, k, slots, pages, layout, codec, positions=torch.arange(4, device=DEVICE))
    assert not bool(pages.any()), "a refused write stored something"


# ------------------------------------------------------------------------------ store checks
# (head dim, input dtype, cache dtype, poison, refused): klt keys are checked element by element (no norm is stored);
# ``validate.store_fault_code`` (PyTorch) is the reference for the code.
CHECK_CASES = [
    (128, torch.float16, torch.float16, [("k", math.nan)], True),
    (64, torch.float32, torch.float16, [("k", 7e4)], True),  # an fp16 cache's recent buffer: |k| <= 65504
    (64, torch.float32, torch.float16, [("k", 7e4), ("k", -math.inf)], True),  # non-finite ranks first
    (80, torch.bfloat16, torch.bfloat16, [("k", math.inf), ("v", math.nan)], True),
    (96, torch.bfloat16, torch.bfloat16, [("k", 1e30)], False),  # finite in a bf16 cache: stored (codes saturate)
    (64, torch.float16, torch.float16, [], False),
]


@pytest.mark.parametrize(
    "d,dtype,cache_dtype,poison,refused",
    CHECK_CASES,
    ids=[f"D{c[0]}-{str(c[1])[6:]}-{str(c[2])[6:]}-{len(c[3])}" for c in CHECK_CASES],
)
def test_klt_store_checks_record_the_reference_fault(d, dtype, cache_dtype, poison, refused):
    """The kernel's fault code equals ``validate.store_fault_code``'s, checking stores nothing else, and a closed
    record is left alone."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    fmt, layout, codec = _codec(d, d // 2, gen)
    n, hkv = 24, 2
    k, v, slots = poisoned_tokens(n, hkv, d, dtype, poison, gen)
    positions = torch.randint(0, MAX_POS, (n,), generator=gen).to(DEVICE)
    limits = StoreLimits.of(fmt, cache_dtype, codec.raw_dtype)
    want = store_fault_code(k, v, slots, fmt, limits)
    assert (want != FAULT_NONE) == refused, f"seed={seed}: reference code {want:#x}"
    args = [x.to(DEVICE) for x in (k, v, slots)]
    checked = torch.zeros(4, hkv, layout.page_bytes, dtype=torch.uint8, device=DEVICE)
    fault = torch.tensor([FAULT_NONE, 0], dtype=torch.int64, device=DEVICE)
    compress_write(*args, checked, layout, codec, fault=fault, limits=limits, positions=positions)
    assert int(fault[0]) == want, f"seed={seed}: kernel {int(fault[0]):#x}, reference {want:#x}"
    plain = torch.zeros_like(checked)
    compress_write(*args, plain, layout, codec, positions=positions)
    codes = slice(
        layout.offsets()["key_code"], layout.offsets()["key_code"] + layout.block_size * codec.key_coder.code_bytes
    )
    assert torch.equal(plain[..., codes], checked[..., codes]), f"seed={seed}: the store checks changed key codes"
    if not refused:  # (a refused token's value fields may differ: the checked minimum and maximum carry NaN)
        assert torch.equal(plain, checked), f"seed={seed}: the store checks changed what is stored"
    closed = torch.tensor([FAULT_NONE, 1], dtype=torch.int64, device=DEVICE)
    compress_write(*args, plain, layout, codec, fault=closed, limits=limits, positions=positions)
    assert int(closed[0]) == FAULT_NONE, f"seed={seed}: a closed record was written"


# ------------------------------------------------------------------------------ the read side's view of the codes
@triton.jit
def _read_back_kernel(
    code_ptr,  # uint8 [N, HKV, KCB]: codes
    pos_ptr,  # int64 [N]
    z_ptr,  # fp32 [HKV, N, DP]: levels out
    k_ptr,  # fp32 [HKV, N, DP]: post-RoPE keys out (channels in order)
    meta_ptr,
    lv_ptr,
    dec_ptr,
    mean_ptr,
    turns_ptr,
    scale,
    n,
    HKV: tl.constexpr,
    PAGE: tl.constexpr,
    KLT: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERP: tl.constexpr,
):
    """The codes read back through ``_tiles``' klt read helpers (what the attention kernels decode)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.program_id(1)
    nmask = i < n
    cops, dops = klt_operands(h, meta_ptr, lv_ptr, dec_ptr, mean_ptr, PAGE, KLT)
    z = klt_levels(code_ptr + (i.to(tl.int64) * HKV + h) * PAGE.KCB, nmask, cops, PAGE, KLT, INTERP)  # [DP, BLOCK]
    j = tl.arange(0, PAGE.DP)
    out = ((h * n + i) * PAGE.DP)[None, :]
    tl.store(z_ptr + out + j[:, None], z, mask=nmask[None, :])
    ia = tl.arange(0, KLT.RHP)
    ir = tl.arange(0, KLT.RRP)
    pos = tl.load(pos_ptr + i, mask=nmask, other=0)
    cos, sin = rope_cos_sin(pos[None, :], tl.load(turns_ptr + ia)[:, None])
    ka, kb, kr = klt_keys(z, cos * scale, sin * scale, dops, KLT, INTERP)
    rows = k_ptr + out
    tl.store(rows + ia[:, None], ka, mask=nmask[None, :] & (ia < KLT.RH)[:, None])
    tl.store(rows + KLT.RH + ia[:, None], kb, mask=nmask[None, :] & (ia < KLT.RH)[:, None])
    if KLT.RR > 0:
        tl.store(rows + 2 * KLT.RH + ir[:, None], kr, mask=nmask[None, :] & (ir < KLT.RR)[:, None])


@pytest.mark.parametrize(
    "d,rotary_dim,kind",
    [(128, 128, "any"), (80, 80, "any"), (96, 48, "any"), (96, 48, "bytes"), (96, 48, "bytes-cubic")],
)
def test_klt_codes_read_back_by_the_read_helpers(d, rotary_dim, kind):
    """The stream the write kernel packs is the one ``_tiles.klt_levels`` unpacks, its bytes picked by the int8
    product or loaded one by one: every coefficient's level equals the reference decoder's (cubic levels: up to fp32
    rounding, their constant in the mean), whole or partial RoPE; ``klt_keys`` turns them into the reference's
    decoded keys (fp16 decode product)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    _, layout, codec = _codec(d, rotary_dim, gen, kind=kind)
    n, hkv = 40, 2
    k = (torch.randn(n, hkv, d, generator=gen) * 2).half()
    positions = torch.randint(0, MAX_POS, (n,), generator=gen)
    slots = torch.arange(n)
    pages = torch.zeros(n // 16 + 1, hkv, layout.page_bytes, dtype=torch.uint8, device=DEVICE)
    compress_write(k.to(DEVICE), k.to(DEVICE), slots.to(DEVICE), pages, layout, codec, positions=positions.to(DEVICE))
    codes = read_slots(pages.cpu(), layout, slots, codec.raw_dtype)["key_code"]  # [N, H, KCB]
    coder = codec.key_coder
    want_z = coder.t.levels.expand(n, -1, -1, -1).gather(-1, coder._unpack(codes).unsqueeze(-1))[..., 0]
    want_k = codec.decode_keys({"key_code": codes}, positions[:, None], 1)
    spec, page = page_spec(layout, codec)
    klt = klt_constants(codec, DEVICE)
    meta, levels, dec, mean, turns, scale = klt["read"]
    cubic = coder.t.cubic_levels()
    assert klt["spec"].CUBIC == (kind == "bytes-cubic") == (cubic is not None)
    if cubic is not None:
        want_z = want_z - cubic[..., 0].float()
    for select in (True, False):
        z = torch.zeros(hkv, n, spec.DP, device=DEVICE)
        kk = torch.zeros(hkv, n, spec.DP, device=DEVICE)
        _read_back_kernel[(triton.cdiv(n, 16), hkv)](
            codes.contiguous().to(DEVICE),
            positions.to(DEVICE),
            z,
            kk,
            meta,
            levels,
            dec,
            mean,
            turns,
            scale,
            n,
            HKV=hkv,
            PAGE=page,
            KLT=constexpr_bundle(dataclasses.replace(klt["spec"], SELECT=select)),
            BLOCK=16,
            INTERP=INTERPRET,
        )
        z, kk = z[..., :d].transpose(0, 1).cpu(), kk[..., :d].transpose(0, 1).cpu()
        what = f"seed={seed} D={d} select={select}"
        if cubic is None:
            assert torch.equal(z, want_z), f"{what}: levels differ from the reference decoder's"
        else:
            torch.testing.assert_close(z, want_z, rtol=1e-5, atol=1e-5, msg=f"{what}: cubic levels differ")
        err = (kk - want_k).abs().max().item()
        assert err <= 2e-2 * want_k.abs().max().item(), f"{what}: keys off by {err:.3g}"


def test_klt_cache_appends_through_the_kernels(monkeypatch):
    """A klt ``CompressedKVCache`` whose appends go through the kernels (rows [B, T, H, D] with positions [B, T],
    single tokens, a batch of one) stores the pages the reference path stores (up to ties: <= 0.1 % of the bytes)."""
    from jetson_tq.cache.compressed import CompressedKVCache

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    fmt = KVFormat(key_mode="klt", key_code_bytes=52, value_mode="group", value_bits=3, recent_tokens=16)
    t = uneven_transform(2, 64, fmt.key_code_bits(64), 32, SCALE, gen)
    chunks = [
        (torch.randn(3, 2, n, 64, generator=gen).half(), torch.randn(3, 2, n, 64, generator=gen).half())
        for n in (5, 1, 40, 3)
    ]
    pages = {}
    try:
        for backend in ("reference", "triton"):
            monkeypatch.setenv(ops.ENV_VAR, backend)
            ops.configured.cache_clear()
            cache = CompressedKVCache(fmt, 2, 64, batch_size=3, device=DEVICE, key_transform=t)
            for k, v in chunks:
                cache.append(k.to(DEVICE), v.to(DEVICE))
            cache.append(chunks[1][0][1].to(DEVICE), chunks[1][1][1].to(DEVICE), seq=1)  # one sequence
            pages[backend] = cache.pages.cpu()
    finally:
        ops.configured.cache_clear()  # re-read once the environment is restored
    differ = (pages["reference"] != pages["triton"]).float().mean().item()
    assert differ <= 1e-3, f"seed={seed}: {differ:.3%} of the page bytes differ from the reference path's"
