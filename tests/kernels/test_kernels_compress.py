"""Compress-on-write (``kernels.compress_write``) against the reference write path (``KVCodec.encode`` +
``write_slots``), through vLLM-style slot mappings (shuffled blocks, -1 padding).

Tolerance: every value scale and zero equals the reference's. A key index or value code may differ
only by one level, only where the reference's input lies within rounding of that decision boundary
(rotated unit-key coordinate within 1e-5 of a codebook boundary: a Hadamard rotation is one tensor-core
product of k with the exact +-1 matrix sqrt(D) Pi compared against the boundaries times sqrt(D) ||k||, where
the key norm may differ by an ulp; a dense one
uses hi+lo fp16 tensor-core products, ~22 bits, in another order; value position (v - zero) / scale (the kernel
multiplies by 1 / scale) within 1e-3 of a half-integer; mse values (``+vmse``): rotated unit-value coordinate within
1e-5 of a boundary of the values' codebook, rotated by hi+lo split products for both rotation kinds), and in at most
0.1 % of the entries: at the GPU sizes (~10^6 coordinates)
a handful of such ties occur (seen on the H200), at CPU sizes none. The key norm,
residual norm and value norm may differ by one fp16 ulp (fp32 sums in another order). QJL sign bits may differ
only where the sketch ``S r`` of a coordinate is within rounding of 0: the kernel forms it as
``S u - (S Pi^T) c`` with hi+lo split fp16 tensor-core products (~22 bits), bound 0.02 % of the
bits (measured 0 in these sizes); with ``exact_signs=False`` (single fp16 products) the bound is
0.5 % (measured ~0.05 %). Bytes of slots that were not written (-1 padding, other tokens) stay untouched.
"""

from __future__ import annotations

import math

import pytest
import torch

from jetson_tq.codec.kv import KVCodec
from jetson_tq.codec.mse import TurboQuantMSE
from jetson_tq.codec.packing import unpack_bits
from jetson_tq.format import PagedLayout
from jetson_tq.kernels.compress_write_plan import WriteTuning, compress_write
from jetson_tq.paged import read_slots, write_slots
from tests.helpers.kernel_cases import DEVICE, GPU, fmt_for, fresh_seed, vllm_block_table, vllm_slot_mapping

pytestmark = pytest.mark.kernel

SMALL = [
    ("blog_k3v2", 128, [30, 9]),
    ("blog_k3v2", 64, [17]),
    ("blog_k3v2", 80, [12, 3]),
    ("blog_k3v2", 96, [20]),
    ("blog_k3v2", 256, [9]),
    ("blog_k3v2", 50, [14]),
    ("blog_k3v2", 100, [11]),
    ("k4v4", 128, [25]),
    ("mse_k3v2", 64, [19]),
    ("mse_k4v3", 128, [13]),
    ("mse_k4v3u", 64, [15]),
    ("mse_k3v3w256", 128, [11]),
    ("fp16", 128, [10, 5]),
    ("mse_k4v3+vmse3", 128, [13, 4]),  # mse values: Hadamard value rotation, 3-bit codes (2+1 runs)
    ("mse_k4v3+vmse3", 64, [15]),
    ("mse_k4v3+vmse3", 80, [12]),  # dense value rotation
    ("blog_k3v2+vmse2", 96, [11]),  # prod keys, one 2-bit value run
    ("fp16+vmse4", 64, [9]),  # raw keys
]
LARGE = [
    ("blog_k3v2", 128, [4096, 1000, 7]),
    ("blog_k3v2", 64, [3000]),
    ("blog_k3v2", 80, [999]),
    ("blog_k3v2", 96, [1500, 2]),
    ("blog_k3v2", 256, [700]),
    ("blog_k3v2", 50, [555]),
    ("blog_k3v2", 100, [777]),
    ("k4v4", 128, [2048]),
    ("mse_k3v2", 128, [1024]),
    ("mse_k4v3", 128, [1500]),
    ("mse_k3v3w256", 128, [1300]),
    ("mse_k4v3", 64, [2000]),
    ("mse_k4v3u", 128, [1500]),
    ("fp16", 128, [300]),
    ("mse_k4v3+vmse3", 128, [2000, 31]),
    ("mse_k4v3+vmse3", 64, [1500]),
    ("mse_k4v3+vmse3", 96, [1300]),
    ("blog_k3v2+vmse2", 80, [1000]),
    ("fp16+vmse4", 128, [700]),
]


def _ulp16(x: torch.Tensor) -> torch.Tensor:
    return torch.finfo(torch.float16).eps * x.float().abs().clamp_min(2.0**-14)


CASES = [(*c, dt) for c in (LARGE if GPU else SMALL) for dt in (torch.float16, torch.bfloat16)] + [
    (*c, torch.float32) for c in (LARGE if GPU else SMALL) if c[:2] in (("mse_k4v3", 128), ("blog_k3v2", 64))
]


@pytest.mark.parametrize("name,d,lens,dtype", CASES, ids=[f"{c[0]}-D{c[1]}-{str(c[3])[6:]}" for c in CASES])
def test_compress_write_matches_reference(name, d, lens, dtype):
    """Every format and head dim, fp16 and bf16 input; fp32 input (two formats) splits the unit vector hi + lo."""
    _check(name, d, lens, dtype, exact_signs=True)


@pytest.mark.parametrize("d", [64, 128])
def test_compress_write_fast_signs(d):
    _check("blog_k3v2", d, [300 if GPU else 20], torch.float16, exact_signs=False)


def _check(name, d, lens, dtype, exact_signs):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    fmt = fmt_for(name, d)
    hkv, bs = 2, 16
    layout = PagedLayout(fmt, d, bs)
    codec = KVCodec(fmt, d, raw_dtype=dtype)
    table = vllm_block_table(lens, bs, pad_blocks=1, gen=gen)
    slots, _ = vllm_slot_mapping(table, lens, bs)
    n = slots.shape[0]
    k = (torch.randn(n, hkv, d, generator=gen) * 3).to(dtype)
    v = torch.randn(n, hkv, d, generator=gen).to(dtype)
    v[0, 0, : min(d, 8)] = 0.25  # a constant group start: scale 0 must not divide by zero
    nblocks = int(table.max()) + 2
    poison = torch.randint(0, 256, (nblocks, hkv, layout.page_bytes), dtype=torch.uint8, generator=gen)
    ref_pages = poison.clone()
    write_slots(ref_pages, layout, slots, codec.encode(k, v))
    pages = poison.clone().to(DEVICE)
    compress_write(
        k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE), pages, layout, codec, tuning=WriteTuning(exact_signs=exact_signs)
    )
    pages = pages.cpu()
    written = slots[slots >= 0]
    got, want = (
        read_slots(pages, layout, written, codec.raw_dtype),
        read_slots(ref_pages, layout, written, codec.raw_dtype),
    )
    msg = f"seed={seed} {name} D={d} {dtype}"
    order = torch.nonzero(slots >= 0).squeeze(1)  # rows of k/v that were written, in slot order of `written`
    for f in fmt.fields(d):
        g, w = got[f.name], want[f.name]
        if f.name == "key_idx":
            mse = codec.keys.mse if hasattr(codec.keys, "mse") else codec.keys
            _expect_ties_only(g, w, _mse_tie_distance(mse, k[order]), 1e-5, fmt.key_mse_bits, d, f"{msg}: key_idx")
        elif f.name == "val_idx":
            tie = _mse_tie_distance(codec.values, v[order])
            _expect_ties_only(g, w, tie, 1e-5, fmt.value_bits, d, f"{msg}: val_idx")
        elif f.name == "val_codes":
            _expect_ties_only(g, w, _value_tie_distance(codec, v[order]), 1e-3, fmt.value_bits, d, f"{msg}: val_codes")
        elif f.name == "key_signs":
            bits = unpack_bits(g, 1, d) != unpack_bits(w, 1, d)
            if "key_idx" in got:  # a key whose index flipped at a tie (checked above) has another residual: its
                # sketch signs follow that residual, so only the keys with equal indices must agree
                bits = bits & (got["key_idx"] == want["key_idx"]).all(-1, keepdim=True)
            flips = bits.float().mean().item()
            # at CPU sizes (~2k bits) one flip is 0.05 %: allow two flipped bits whatever the size
            assert flips <= (2e-4 if exact_signs else 5e-3) or int(bits.sum()) <= 2, (
                f"{msg}: {flips:.3%} of sign bits differ"
            )
        elif f.name in ("key_norm", "key_rnorm", "val_norm"):
            assert bool(((g.float() - w.float()).abs() <= _ulp16(w) + 1e-30).all()), f"{msg}: {f.name} off by > 1 ulp"
        else:
            assert torch.equal(g, w), f"{msg}: {f.name} differs in {(g != w).float().mean().item():.3%} of entries"
    # every byte outside the written slots' rows is untouched
    untouched = torch.ones(nblocks * bs, dtype=torch.bool)
    untouched[written] = False
    region_mask = untouched.view(nblocks, 1, bs).expand(nblocks, hkv, bs)
    offs = layout.offsets()
    for f in fmt.fields(d):

        def reg(p: torch.Tensor, f=f) -> torch.Tensor:
            return p[:, :, offs[f.name] : offs[f.name] + bs * f.nbytes].reshape(nblocks, hkv, bs, f.nbytes)

        assert torch.equal(reg(pages)[region_mask], reg(poison)[region_mask]), (
            f"{msg}: wrote outside its slots ({f.name})"
        )


def _mse_tie_distance(mse: TurboQuantMSE, x: torch.Tensor) -> torch.Tensor:
    """|rotated unit-vector coordinate - nearest decision boundary| of a TurboQuant_mse quantizer (keys or values) as
    the reference computes it, [..., D]."""
    xf = x.float()
    y = mse.rotation.apply(xf / xf.norm(dim=-1, keepdim=True).clamp_min(1e-30))
    return (y.unsqueeze(-1) - mse.boundaries.float()).abs().amin(-1)


def _value_tie_distance(codec: KVCodec, v: torch.Tensor) -> torch.Tensor:
    """|(v - zero) / scale - nearest half-integer| with the reference's fp16 scale and zero, [..., D]."""
    q = codec.values
    g = v.float().reshape(*v.shape[:-1], q.dim // q.group, q.group)
    zero = g.amin(-1).to(torch.float16).float()
    scale = ((g.amax(-1) - zero) / q.levels).to(torch.float16).float()
    pos = (g - zero.unsqueeze(-1)) / torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    return ((pos - pos.floor()) - 0.5).abs().reshape(v.shape)


def _expect_ties_only(
    got: torch.Tensor, want: torch.Tensor, tie_distance: torch.Tensor, tie: float, bits: int, d: int, msg: str
) -> None:
    """Packed codes equal, except off-by-one-level decisions at inputs within ``tie`` of a boundary (<= 0.1 %, or four
    entries: at CPU sizes, ~1,400 codes, two ties are 0.14 %; each must still be a tie)."""
    if torch.equal(got, want):
        return
    gu, wu = unpack_bits(got, bits, d).int(), unpack_bits(want, bits, d).int()
    diff = gu != wu
    frac = diff.float().mean().item()
    assert frac <= 1e-3 or int(diff.sum()) <= 4, f"{msg}: {frac:.3%} of entries differ"
    assert bool(((gu - wu).abs()[diff] == 1).all()), f"{msg}: a code differs by more than one level"
    worst = tie_distance[diff].max().item()
    assert worst <= tie, f"{msg}: a code differs where the input is {worst:.2e} from a decision boundary (> {tie:g})"


def test_compress_write_empty_and_all_padding():
    fmt = fmt_for("blog_k3v2", 64)
    layout = PagedLayout(fmt, 64, 16)
    codec = KVCodec(fmt, 64)
    pages = torch.randint(0, 256, (3, 2, layout.page_bytes), dtype=torch.uint8).to(DEVICE)
    before = pages.clone()
    k = torch.randn(4, 2, 64).half().to(DEVICE)
    compress_write(k[:0], k[:0], torch.empty(0, dtype=torch.int64, device=DEVICE), pages, layout, codec)
    compress_write(k, k, torch.full((4,), -1, dtype=torch.int64, device=DEVICE), pages, layout, codec)
    assert torch.equal(pages, before)


# ------------------------------------------------------------------------------ store checks inside the kernel
# (format, head dim, cache dtype = input dtype, poison): what ``validate.check_kv_storable`` refuses, written into the
# fault record by the kernel; ``validate.store_fault_code`` (PyTorch) is the reference for the code.
CHECK_CASES = [
    ("mse_k4v3", 128, torch.float16, [("k", math.nan)]),  # default preset: a NaN key (norm path)
    ("mse_k4v3", 128, torch.float16, [("v", -math.inf), ("v", math.nan)]),  # value groups carry NaN and -inf
    ("mse_k4v3", 64, torch.float32, [("k", 7e4)]),  # fp32 into an fp16 cache: |k| per element, key norm too
    ("blog_k3v2", 64, torch.float16, [("k", 3e4), ("v", math.inf)]),  # prod: norm bound 32752 (fp16 k of norm > it)
    ("blog_k3v2", 80, torch.bfloat16, [("v", 2e5)]),  # bf16 cache: group minimum / scale past fp16
    ("fp16", 64, torch.float32, [("k", math.inf), ("v", 1e5)]),  # raw fields: per element
    ("k4v4", 128, torch.float16, []),  # clean input: no fault
    ("mse_k4v3+vmse3", 128, torch.float16, [("v", math.nan)]),  # mse values: the value norm carries NaN
    ("mse_k4v3+vmse3", 64, torch.bfloat16, [("v", 9e3)]),  # bf16 cache: value norm past fp16, no element bound
]


def _store_case(name, d, dtype, poison, seed, n=24, hkv=2):
    from jetson_tq.validate import StoreLimits

    gen = torch.Generator().manual_seed(seed)
    fmt = fmt_for(name, d)
    layout, codec = (
        PagedLayout(fmt, d, 16),
        KVCodec(fmt, d, raw_dtype=dtype if dtype != torch.float32 else torch.float16),
    )
    k, v, slots = poisoned_tokens(n, hkv, d, dtype, poison, gen)
    limits = StoreLimits.of(fmt, dtype, codec.raw_dtype)
    return fmt, layout, codec, k, v, slots, limits


def poisoned_tokens(n: int, hkv: int, d: int, dtype: torch.dtype, poison, gen: torch.Generator):
    """(k, v [n, hkv, d], slots [n]) of random tokens with ``poison`` — (``"k"`` | ``"v"``, value) pairs — placed at
    random (token >= 1, head, coordinate; a finite value fills a whole token with random signs), slot 0 padding."""
    k = (torch.randn(n, hkv, d, generator=gen) * 2).to(dtype)
    v = torch.randn(n, hkv, d, generator=gen).to(dtype)
    for which, value in poison:
        t, h, j = (int(torch.randint(lo, m, (1,), generator=gen)) for lo, m in ((1, n), (0, hkv), (0, d)))
        x = k if which == "k" else v
        if math.isfinite(value):
            x[t, h, :] = value * torch.sign(torch.randn(d, generator=gen)).to(dtype)
        else:
            x[t, h, j] = value
    slots = torch.randperm(4 * 16, generator=gen)[:n]
    slots[0] = -1  # a padding slot (vLLM): skipped, not checked
    return k, v, slots


@pytest.mark.parametrize(
    "name,d,dtype,poison", CHECK_CASES, ids=[f"{c[0]}-D{c[1]}-{str(c[2])[6:]}-{len(c[3])}" for c in CHECK_CASES]
)
def test_store_checks_record_the_reference_fault(name, d, dtype, poison):
    """The kernel's fault code equals ``validate.store_fault_code`` (the first failing check in
    ``check_kv_storable``'s order, then the first element by slot, head, coordinate), it names a fault whenever the
    eager check refuses the same tokens, and a closed record is left alone."""
    from jetson_tq.validate import FAULT_NONE, check_kv_storable, store_fault_code

    seed = fresh_seed()
    fmt, layout, codec, k, v, slots, limits = _store_case(name, d, dtype, poison, seed)
    pages = torch.zeros(4, 2, layout.page_bytes, dtype=torch.uint8, device=DEVICE)
    fault = torch.tensor([FAULT_NONE, 0], dtype=torch.int64, device=DEVICE)
    compress_write(k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE), pages, layout, codec, fault=fault, limits=limits)
    want = store_fault_code(k, v, slots, fmt, limits)
    assert int(fault[0]) == want, f"seed={seed} {name}: kernel {int(fault[0]):#x}, reference {want:#x}"
    keep = slots >= 0
    try:
        check_kv_storable(k[keep].transpose(0, 1), v[keep].transpose(0, 1), fmt, dtype, codec.raw_dtype, [0], [0])
        refused = False
    except ValueError:
        refused = True
    assert refused == (want != FAULT_NONE), f"seed={seed} {name}: eager refused={refused}, code {want:#x}"
    assert bool(poison) == refused, f"seed={seed} {name}: poison {poison} refused={refused}"
    closed = torch.tensor([FAULT_NONE, 1], dtype=torch.int64, device=DEVICE)
    compress_write(k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE), pages, layout, codec, fault=closed, limits=limits)
    assert int(closed[0]) == FAULT_NONE, f"seed={seed}: a closed record was written"


@pytest.mark.parametrize(
    "name,d,dtype",
    [
        ("mse_k4v3", 128, torch.float16),
        ("blog_k3v2", 64, torch.float32),
        ("fp16", 64, torch.bfloat16),
        ("mse_k4v3+vmse3", 80, torch.float16),
    ],
)
def test_store_checks_leave_the_pages_as_without_them(name, d, dtype):
    """Checking changes nothing that is stored: the same bytes with and without the fault record."""
    from jetson_tq.validate import FAULT_NONE

    seed = fresh_seed()
    _, layout, codec, k, v, slots, limits = _store_case(name, d, dtype, [], seed)
    plain = torch.zeros(4, 2, layout.page_bytes, dtype=torch.uint8, device=DEVICE)
    checked = plain.clone()
    compress_write(k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE), plain, layout, codec)
    fault = torch.tensor([FAULT_NONE, 0], dtype=torch.int64, device=DEVICE)
    compress_write(k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE), checked, layout, codec, fault=fault, limits=limits)
    assert torch.equal(plain, checked), f"seed={seed} {name}"
    assert int(fault[0]) == FAULT_NONE, f"seed={seed} {name}: clean input recorded a fault"


@pytest.mark.parametrize("name,d", [("mse_k4v3", 128), ("blog_k3v2", 64)])
def test_compress_write_reads_rows_in_place(name, d):
    """k, v as rows [R, T, H, D] — strided views of [R, H, T, D], what a cache append of several sequences hands
    over — store exactly what the same tokens flattened to [R * T, H, D] store, with the store checks or without,
    and a fault in the rows names the same slot."""
    from jetson_tq.validate import FAULT_NONE, StoreLimits

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    fmt = fmt_for(name, d)
    layout, codec = PagedLayout(fmt, d, 16), KVCodec(fmt, d)
    r, t, hkv = 3, 7, 2
    k = torch.randn(r, hkv, t, d, generator=gen).half()
    v = torch.randn(r, hkv, t, d, generator=gen).half()
    v[2, 1, 4, 9] = math.nan
    slots = torch.randperm(4 * 16, generator=gen)[: r * t]
    limits = StoreLimits.of(fmt, torch.float16, torch.float16)
    out = {}
    for how in ("rows", "flat"):
        kk, vv = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        if how == "flat":
            kk, vv = kk.reshape(r * t, hkv, d), vv.reshape(r * t, hkv, d)  # copies: [R, T] do not merge
        pages = torch.zeros(4, hkv, layout.page_bytes, dtype=torch.uint8, device=DEVICE)
        fault = torch.tensor([FAULT_NONE, 0], dtype=torch.int64, device=DEVICE)
        compress_write(kk.to(DEVICE), vv.to(DEVICE), slots.to(DEVICE), pages, layout, codec, fault=fault, limits=limits)
        out[how] = (pages.cpu(), int(fault[0]))
    assert torch.equal(out["rows"][0], out["flat"][0]), f"seed={seed} {name}: rows and flat pages differ"
    assert out["rows"][1] == out["flat"][1] != FAULT_NONE, f"seed={seed} {name}: {out['rows'][1]:#x} vs flat"
