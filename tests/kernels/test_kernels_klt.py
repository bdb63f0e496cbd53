"""klt keys in the kernels (``_tiles.klt_*``, ``rope_cos_sin``): RoPE angles exact at any position, keys decoded
through partial rotary and RoPE attention scaling, checked against the codec (``KeyTransformCoder.dequantize``) and
the reference attention. The format-wide decode / prefill cases are in test_kernels_decode.py / _prefill.py."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from jetson_tq.attention.reference import paged_attention_decode, paged_attention_prefill
from jetson_tq.kernels._common import codec_constants
from jetson_tq.kernels._tiles import rope_cos_sin
from jetson_tq.kernels.hybrid_decode_plan import DecodeTuning, hybrid_decode
from jetson_tq.kernels.prefill_plan import chunked_prefill, dequantize_segment
from tests.helpers.kernel_cases import DEVICE, build_paged_kv, fmt_for, fresh_seed, rel_err
from tests.helpers.klt_cases import STRUCTURES, uneven_transform

pytestmark = pytest.mark.kernel


@triton.jit
def _rope_kernel(pos_ptr, turns_ptr, cos_ptr, sin_ptr, N: tl.constexpr, R: tl.constexpr):
    n = tl.arange(0, N)
    r = tl.arange(0, R)
    cos, sin = rope_cos_sin(tl.load(pos_ptr + n)[:, None], tl.load(turns_ptr + r)[None, :])
    tl.store(cos_ptr + n[:, None] * R + r[None, :], cos)
    tl.store(sin_ptr + n[:, None] * R + r[None, :], sin)


def test_rope_angles_stay_exact_at_large_positions():
    """cos / sin of p theta at positions up to 2^20 within 2e-6 of float64 (an fp32 angle would be off by ~0.03)."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    pos = torch.tensor([0, 1, 17, 4095, 65535, 131071, 500000, (1 << 20) - 1] * 2, dtype=torch.int32)
    cos = torch.empty(16, 64, device=DEVICE)
    sin = torch.empty_like(cos)
    _rope_kernel[(1,)](pos.to(DEVICE), (inv_freq / (2 * math.pi)).to(DEVICE), cos, sin, N=16, R=64)
    angle = pos.double()[:, None] * inv_freq
    assert (cos.cpu().double() - angle.cos()).abs().max() < 2e-6
    assert (sin.cpu().double() - angle.sin()).abs().max() < 2e-6


# (head dim, rotary dim, attention scaling)
ROTARY = [(80, 40, 1.3), (128, 32, 1.0), (64, 64, 0.7)]
#: each case's code widths (``klt_cases.STRUCTURES``)
CASES = [(*r, "any") for r in ROTARY] + [
    (80, 40, 1.3, "bytes"),
    (64, 64, 0.7, "bytes"),
    (128, 32, 1.0, "cubic"),
    (80, 40, 1.3, "bytes-cubic"),
    (80, 40, 1.3, "diagonal"),
    (80, 40, 1.3, "diagonal-bytes-cubic"),
    (64, 64, 0.7, "diagonal-bytes-cubic"),
]
CASE_IDS = [f"D{c[0]}-rot{c[1]}-{c[3]}" for c in CASES]


def _transform(kind: str, d: int, rotary: int, scaling: float, gen: torch.Generator):
    """A two-head transform of ``STRUCTURES[kind]`` for klt52_g3 at head dim ``d``, and its format."""
    fmt = fmt_for("klt52_g3", d)
    return fmt, uneven_transform(2, d, fmt.key_code_bits(d), rotary, scaling, gen, **STRUCTURES[kind])


def test_code_widths_select_their_kernel_paths():
    """Byte-aligned code widths (``STRUCTURES["bytes"]``) reach the kernels as ``KltSpec.ONE_BYTE``, levels
    a cubic of the code as ``CUBIC`` and diagonal decode matrices (no transform) as ``DIAGONAL``; others do not."""
    from jetson_tq.codec.kv import KVCodec
    from jetson_tq.kernels._common import klt_constants

    gen = torch.Generator().manual_seed(fresh_seed())
    for kind, one_byte, cubic, diagonal in [
        ("any", False, False, False),
        ("bytes", True, False, False),
        ("cubic", False, True, False),
        ("bytes-cubic", True, True, False),
        ("diagonal", False, False, True),
        ("diagonal-bytes-cubic", True, True, True),
    ]:
        fmt, kt = _transform(kind, 80, 40, 1.3, gen)
        spec = klt_constants(KVCodec(fmt, 80, key_transform=kt), torch.device("cpu"))["spec"]
        assert (spec.ONE_BYTE, spec.CUBIC, spec.DIAGONAL) == (one_byte, cubic, diagonal), kind


@pytest.mark.parametrize("d,rotary,scaling,kind", CASES, ids=CASE_IDS)
def test_dequantized_keys_equal_the_codec(d, rotary, scaling, kind):
    """The workspace keys of the dequant kernel are the codec's post-RoPE keys (fp16 rounding apart)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    fmt, kt = _transform(kind, d, rotary, scaling, gen)
    n = 40
    kv = build_paged_kv(fmt, 2, d, [n], [0], torch.float16, gen, key_transform=kt)
    dp = max(16, 1 << (d - 1).bit_length())
    wk = torch.zeros(2, 64, dp, dtype=torch.float16, device=DEVICE)
    wv = torch.zeros_like(wk)
    cb = codec_constants(kv.codec, kv.pages.device)["codebook"]
    dequantize_segment(kv, cb, wk, wv, 0, 64, 1, 1, False, 16, False)  # sliding window of 1: every token compressed
    codes = kv.gather_compressed(n)["key_code"][0]  # [H, n, bytes]
    ref = kv.codec.key_coder.dequantize(codes.cpu(), torch.arange(n)[None, :], 0)
    got = wk[:, :n, :d].float().cpu()
    assert rel_err(got, ref) < 1e-3, f"seed={seed}"
    assert bool((wk[:, :n, d:] == 0).all()), "padding columns must be zero"


@pytest.mark.parametrize("d,rotary,scaling,kind", CASES, ids=CASE_IDS)
def test_partial_rotary_attention_matches_reference(d, rotary, scaling, kind):
    """Decode (both code-byte reads) and prefill over klt keys with partial rotary and RoPE scaling equal the
    reference attention."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    fmt, kt = _transform(kind, d, rotary, scaling, gen)
    fmt = fmt.with_(recent_tokens=4)
    comp, rec, t = [70, 9], [4, 4], 3
    kv = build_paged_kv(fmt, 2, d, comp, rec, torch.float16, gen, key_transform=kt, recent_cap=4)
    q = (torch.randn(2, 8, d, generator=gen) * 3).half().to(DEVICE)
    want = paged_attention_decode(q, kv)
    for select in (True, False):  # code bytes picked by the int8 product, or loaded one by one
        err = rel_err(hybrid_decode(q, kv, tuning=DecodeTuning(klt_select=select)), want)
        assert err < 2e-3, f"decode seed={seed} select={select}: {err:.2e}"
    hold = [c + r + t for c, r in zip(comp, rec)]
    kv = build_paged_kv(fmt, 2, d, comp, rec, torch.float16, gen, key_transform=kt, recent_cap=4, pages_hold=hold)
    qp = (torch.randn(2, 8, t, d, generator=gen) * 3).half().to(DEVICE)
    k = (torch.randn(2, 2, t, d, generator=gen) * 2).half().to(DEVICE)
    v = torch.randn(2, 2, t, d, generator=gen).half().to(DEVICE)
    err = rel_err(chunked_prefill(qp, k, v, kv), paged_attention_prefill(qp, k, v, kv))
    assert err < 2e-3, f"prefill seed={seed}: {err:.2e}"


@pytest.mark.parametrize("kind", [pytest.param("any", marks=pytest.mark.slow), "bytes-cubic", "diagonal-bytes-cubic"])
def test_calibrated_sink_in_decode_and_prefill_matches_reference(kind):
    """With a calibrated sink (``KltSpec.SINK``) decode reads compressed position 0 from it (split 0, any split
    count), the prefill workspace holds it at row 0, and both equal the reference, which reads it through the codec;
    a sequence whose position 0 is still exact (nothing compressed) does not read it. The sink moves the output."""
    from dataclasses import replace

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    d, rotary, scaling = 80, 40, 1.3
    fmt, kt = _transform(kind, d, rotary, scaling, gen)
    fmt = fmt.with_(recent_tokens=4)
    comp, rec, t = [70, 0], [4, 3], 3
    kv = build_paged_kv(fmt, 2, d, comp, rec, torch.float16, gen, key_transform=kt, recent_cap=4, sink=True)
    assert kv.codec.has_sink
    plain = replace(kv, codec=type(kv.codec)(fmt, d, raw_dtype=torch.float16, key_transform=replace(kt)))
    for _ in range(16):  # a query for which the sink matters well above the kernels' error bound (some barely look)
        q = (torch.randn(2, 8, d, generator=gen) * 3).half().to(DEVICE)
        want = paged_attention_decode(q, kv)
        moved = rel_err(paged_attention_decode(q, plain)[0], want[0])
        if moved > 1e-2:
            break
    assert moved > 1e-2, f"seed={seed}: the sink should move sequence 0's output, moved {moved:.2e}"
    for splits in (1, 3):
        got = hybrid_decode(q, kv, tuning=DecodeTuning(num_splits=splits))
        err = rel_err(got, want)
        assert err < 2e-3, f"decode seed={seed} splits={splits}: {err:.2e}"
    assert rel_err(paged_attention_decode(q, plain)[1], want[1]) < 1e-6  # nothing compressed: no sink read
    hold = [c + r + t for c, r in zip(comp, rec)]
    kv = build_paged_kv(
        fmt, 2, d, comp, rec, torch.float16, gen, key_transform=kt, recent_cap=4, pages_hold=hold, sink=True
    )
    qp = (torch.randn(2, 8, t, d, generator=gen) * 3).half().to(DEVICE)
    k = (torch.randn(2, 2, t, d, generator=gen) * 2).half().to(DEVICE)
    v = torch.randn(2, 2, t, d, generator=gen).half().to(DEVICE)
    err = rel_err(chunked_prefill(qp, k, v, kv), paged_attention_prefill(qp, k, v, kv))
    assert err < 2e-3, f"prefill seed={seed}: {err:.2e}"


def test_half_code_cubic_reproduces_the_levels():
    """The decode's cubic in y = x m - k (x = 1024 + c, ``_common.half_code_cubic``) gives every used level of every
    code width: in float64 as exactly as the fp32 levels are stored, and within a few fp16 roundings when evaluated
    in fp16 as the kernel does (the coefficients stay normal fp16 numbers at 8 bits)."""
    from jetson_tq.kernels._common import half_code_cubic

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    _, kt = _transform("cubic", 128, 32, 1.0, gen)
    cubic, bits = kt.cubic_levels(), kt.bits.long()
    assert cubic is not None
    coef, ymap = half_code_cubic(cubic, bits)
    for w in range(0, 9):
        sel = bits == w
        if not bool(sel.any()):
            continue
        x = 1024 + torch.arange(1 << w, dtype=torch.float64)
        lv = kt.levels.double()[sel][:, : 1 << w]
        a, s, r, t = (c[:, None] for c in coef[sel].unbind(-1))
        m, k = (c[:, None] for c in ymap[sel].unbind(-1))
        y = x * m - k
        assert bool((y.abs() <= 1).all()), f"w={w}"
        assert (a + y * (s + y * (r + y * t)) - lv).abs().max() < 1e-6, f"w={w} seed={seed}"  # fp32 levels
        y16 = (x.half() * m.half() - k.half()).double()
        assert bool((y16 == y).all()), f"w={w}: y must be exact in fp16"
        s16, r16, t16 = s.half(), r.half(), t.half()
        z16 = (y.half() * (s16 + y.half() * (r16 + y.half() * t16))).double() + a
        ulp = 2.0**-10 * lv.abs().amax().clamp_min(2.0**-14)
        assert (z16 - lv).abs().max() < 4 * ulp, f"w={w} seed={seed}: {(z16 - lv).abs().max():.2e}"
