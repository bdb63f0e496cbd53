"""Triton device helpers shared by the attention kernels: read and expand tiles of planar packed fields.

A planar run of ``w``-bit sub-fields holds coordinate ``j`` in byte ``j % (CH*w)`` at bits
``(j // (CH*w)) * w`` (``format.py``). A *chunk* is the coordinate range [c*CW, (c+1)*CW) with
CW = CH * (smallest sub-field width): inside every run it is one contiguous byte range and one
shift, so a tile of codes is a load, a shift and a mask — no byte shuffles.

``subnormal16`` turns masked bits into fp16 with no conversion instruction at all: a 16-bit
pattern whose exponent bits are zero is the fp16 subnormal ``bits * 2**-24``. Tensor cores multiply
fp16 subnormals exactly (products and sums land in fp32, far from its own subnormal range), so a
kernel masks a plane in place, feeds it to ``tl.dot`` and scales the fp32 result by 2**24 once.
"""

import triton
import triton.language as tl

from ._common import KEY_KLT, KEY_MSE, KEY_PROD, KEY_RAW, VAL_GROUP, VAL_MSE, VAL_RAW

# mode numbers as compile-time constants a @triton.jit function may read
K_RAW = tl.constexpr(KEY_RAW)
K_MSE = tl.constexpr(KEY_MSE)
K_PROD = tl.constexpr(KEY_PROD)
K_KLT = tl.constexpr(KEY_KLT)
V_RAW = tl.constexpr(VAL_RAW)
V_GROUP = tl.constexpr(VAL_GROUP)
V_MSE = tl.constexpr(VAL_MSE)


@triton.jit
def plane_bits(run_ptrs, mask, J0: tl.constexpr, CH: tl.constexpr, W: tl.constexpr):
    """Bits of chunk-start ``J0 = c * WMIN`` from a ``W``-bit run; ``run_ptrs`` are the chunk's byte pointers."""
    x = tl.load(run_ptrs + (J0 % W) * CH, mask=mask, other=0)
    return (x >> ((J0 // W) * W)) & ((1 << W) - 1)


@triton.jit
def chunk_codes(
    ptrs,
    mask,
    C: tl.constexpr,
    CH: tl.constexpr,
    WMIN: tl.constexpr,
    W0: tl.constexpr,
    W1: tl.constexpr,
    W2: tl.constexpr,
):
    """Codes (uint8) of chunk ``C`` of a field stored as up to three planar runs (widths W0, W1, W2)."""
    code = plane_bits(ptrs, mask, C * WMIN, CH, W0)
    if W1 > 0:
        code = code | (plane_bits(ptrs + CH * W0, mask, C * WMIN, CH, W1) << W0)
    if W2 > 0:
        code = code | (plane_bits(ptrs + CH * (W0 + W1), mask, C * WMIN, CH, W2) << (W0 + W1))
    return code


@triton.jit
def centroid_lookup(code, cb_ptr, KB: tl.constexpr, AXIS: tl.constexpr):
    """Codebook value (fp16) of every ``KB``-bit ``code`` of a 2-D tile: the 2^KB centroids are loaded once
    into registers and gathered along ``AXIS`` (one warp shuffle per code, no memory gather; on the H200
    this beat a gather from memory and an odd-polynomial codebook). The 4-bit
    symmetric codebooks take ``nibble_centroids`` on the GPU instead (H200: 594 -> 386 us at B=8/64k); this
    stays for the CPU interpreter, 3-bit codes and asymmetric codebooks."""
    cbv = tl.load(cb_ptr + tl.arange(0, 1 << KB))
    if AXIS == 1:
        src = tl.broadcast_to(cbv[None, :], [code.shape[0], 1 << KB])
    else:
        src = tl.broadcast_to(cbv[:, None], [1 << KB, code.shape[1]])
    return tl.gather(src, code.to(tl.int32), AXIS).to(tl.float16)


@triton.jit
def nibble_centroids(x, LUT_ASM: tl.constexpr):
    """(c[low nibble], c[high nibble]) in fp16 of every byte of a uint8 tile (two 4-bit codes per byte), exact:
    ``LUT_ASM`` (``nibble_lut_asm``) holds the fp16 centroids as immediates and looks up 8 codes with 18 integer
    instructions (byte permutes, no shuffles, no memory); elementwise, so it runs in the MMA operand layout."""
    return tl.inline_asm_elementwise(LUT_ASM, "=r,=r,=r,=r,r", [x], (tl.float16, tl.float16), True, 4)


@triton.jit
def online_softmax(s, m_i, l_i, AXIS: tl.constexpr, REDUCE: tl.constexpr = True):
    """One flash-attention step on log2-domain scores ``s`` reduced over ``AXIS`` (the token axis):
    (new running max, rescale factor of the old sums, probabilities, new running sum). A row whose
    scores are all -inf keeps max -inf and gets zero probabilities. ``REDUCE=False``: the running sum ``l_i`` is
    a tile shaped like ``s`` (summed over ``AXIS`` by the caller once, after the last step)."""
    m_new = tl.maximum(m_i, tl.max(s, AXIS))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    if AXIS == 1:
        p = tl.exp2(s - m_safe[:, None])
    else:
        p = tl.exp2(s - m_safe[None, :])
    if not REDUCE:
        l_new = l_i * (alpha[:, None] if AXIS == 1 else alpha[None, :]) + p
    else:
        l_new = l_i * alpha + tl.sum(p, AXIS)
    return m_new, alpha, p, l_new


@triton.jit
def fwht_rows(x, R: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr):
    """Unnormalized Walsh-Hadamard transform of each row of an fp32 [R, D] tile (D a power of two), in
    registers: log2(D) butterfly stages pairing i and i + h in the order of ``codec.rotation.fwht``, so
    the sums round exactly as the reference's do (bit-identical results)."""
    for stage in tl.static_range(LOG2D):  # pairs (i, i + h), h = 2^stage
        y = tl.permute(tl.reshape(x, [R, D // (2 << stage), 2, 1 << stage]), [0, 1, 3, 2])
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [R, D])
    return x


@triton.jit
def unrotate_rows(y, pi_ptr, C0: tl.constexpr, CW: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """Columns [C0, C0 + CW) of Pi^T y for every row y of an fp32 [R, DP] tile (the row form y @ Pi[:, C0:C0+CW]),
    Pi an fp32 [D, D] rotation in memory whose padding rows and columns read as zero (so y's padding columns do not
    count, and the result's are zero). Three-pass TF32 tensor-core products (``tf32x3``: ~fp32 accurate, fp32's
    range); a block of columns keeps the fp32 operand at DP x CW (all of Pi at D = 256 is 256 KB)."""
    k = tl.arange(0, DP)
    i = C0 + tl.arange(0, CW)
    pi = tl.load(pi_ptr + k[:, None] * D + i[None, :], mask=(k[:, None] < D) & (i[None, :] < D), other=0.0)
    return tl.dot(y, pi, input_precision="tf32x3")


@triton.jit
def unrotate_rows16(y, hi_ptr, lo_ptr, C0: tl.constexpr, CW: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """``unrotate_rows`` for rows y whose fp16 rounding is exact enough (unit centroids, |y| < 1: 2^-12 relative)
    against Pi's fp16 (hi, lo) split (hi + lo = Pi to ~22 bits): two fp16 tensor-core products into one fp32 sum, a
    quarter of the tf32x3 form's operand registers (a dequantizer holding it ran at 254 registers)."""
    k = tl.arange(0, DP)
    i = C0 + tl.arange(0, CW)
    at = k[:, None] * D + i[None, :]
    ok = (k[:, None] < D) & (i[None, :] < D)
    y16 = y.to(tl.float16)
    acc = tl.dot(y16, tl.load(lo_ptr + at, mask=ok, other=0.0))
    return tl.dot(y16, tl.load(hi_ptr + at, mask=ok, other=0.0), acc)


@triton.jit
def column_chunk(x, C: tl.constexpr, R: tl.constexpr, NCH: tl.constexpr, CW: tl.constexpr):
    """Columns [C*CW, (C+1)*CW) of an [R, NCH*CW] tile, as an [R, CW] tile (a masked sum over the chunk axis)."""
    x3 = tl.reshape(x, [R, NCH, CW])
    sel = (tl.arange(0, NCH) == C)[None, :, None]
    return tl.sum(tl.where(sel, x3, 0), 1)


def nibble_lut_asm(codebook) -> str | None:
    """PTX for ``nibble_centroids`` (4 bytes = 8 codes in; fp16 pairs c[lo] of bytes (0,1), (2,3) -> $0, $1 and
    c[hi] -> $2, $3), or None unless the 16 centroids are odd-symmetric in fp16 (c[15-k] = -c[k], as every
    Lloyd-Max codebook of a symmetric distribution is), rounded to fp16 as ``.to(tl.float16)`` does.

    Symmetry halves the tables: code k >= 8 reads entry 7 - k & 7 = (k ^ 7) & 7 of c[0..7] and flips the sign bit.
    ``prmt`` picks 4 bytes out of 8 (a register and an immediate) by 3-bit selectors, so the low and the high
    bytes of c[0..7] are two tables; a code's bit 3 moves to its byte's top bit for the sign flip, and two more
    permutes per 4 codes interleave low and high bytes into fp16 pairs: 18 integer instructions per 8 codes."""
    import torch

    half = torch.as_tensor(codebook, dtype=torch.float32).to(torch.float16)
    if half.numel() != 16 or not bool((half == -half.flip(0)).all()):
        return None
    bits = [int(b) & 0xFFFF for b in half.view(torch.int16)]
    word = lambda t, k: sum(t[k + i] << (8 * i) for i in range(4))  # noqa: E731  bytes t[k..k+3]
    lo, hi = [b & 0xFF for b in bits], [b >> 8 for b in bits]
    la, lb, ha, hb = (f"0x{w:08X}" for w in (word(lo, 0), word(lo, 4), word(hi, 0), word(hi, 4)))
    return f"""{{
    .reg .b32 m, f, i0, i1, ms, s0, s1, lo0, hi0, lo1, hi1;
    and.b32 m, $4, 0x88888888;
    shr.b32 f, m, 3;
    sub.u32 f, m, f;
    lop3.b32 i0, $4, f, 0x77777777, 0x28;
    shr.b32 i1, i0, 16;
    prmt.b32 lo0, {la}, {lb}, i0;
    prmt.b32 hi0, {ha}, {hb}, i0;
    prmt.b32 lo1, {la}, {lb}, i1;
    prmt.b32 hi1, {ha}, {hb}, i1;
    shl.b32 ms, m, 4;
    prmt.b32 s0, ms, m, 0x5140;
    prmt.b32 s1, ms, m, 0x7362;
    lop3.b32 hi0, hi0, s0, 0x80808080, 0x78;
    lop3.b32 hi1, hi1, s1, 0x80808080, 0x78;
    prmt.b32 $0, lo0, hi0, 0x6240;
    prmt.b32 $1, lo1, hi1, 0x6240;
    prmt.b32 $2, lo0, hi0, 0x7351;
    prmt.b32 $3, lo1, hi1, 0x7351;
}}"""


TWO24 = tl.constexpr(16777216.0)


@triton.jit
def subnormal16(bits):
    """fp16 value bits * 2**-24 of masked uint8 ``bits``: a zero-extension and a bitcast, no arithmetic."""
    return bits.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def mma(a, b, acc, INTERP: tl.constexpr):
    """``tl.dot(a, b, acc)``; under the CPU interpreter operands go through fp32 first, because the
    interpreter stores bf16 as raw uint16 and its dot would multiply the bit patterns."""
    if INTERP:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def run_exponent(J0: tl.constexpr, LOW: tl.constexpr, W: tl.constexpr):
    """log2 of the factor from a plane of run bits (``W`` wide, code bits from ``LOW``) of chunk-start ``J0``, read
    in place at bit shift (J0 // W) * W, to code units."""
    return LOW - (J0 // W) * W


@triton.jit
def value_unit(C: tl.constexpr, PAGE: tl.constexpr):
    """u such that ``folded_value_tile``'s chunk ``C`` is in code units * u * 2^-24 (constant-folded): 2^(C*VB) for
    one run, else the last run's 2^-exponent (exponent in [-7, 6])."""
    if PAGE.VW1 == 0:
        u = (1 << (C * PAGE.VB)) * 1.0
    elif PAGE.VW2 > 0:
        u = 128.0 / (1 << (run_exponent(C * (PAGE.VCW // PAGE.CH), PAGE.VW0 + PAGE.VW1, PAGE.VW2) + 7))
    else:
        u = 128.0 / (1 << (run_exponent(C * (PAGE.VCW // PAGE.CH), PAGE.VW0, PAGE.VW1) + 7))
    return u


@triton.jit
def chain_run(
    tile,
    ptrs,
    mask,
    w,
    J0: tl.constexpr,
    CH: tl.constexpr,
    RUN_OFF: tl.constexpr,
    LOW: tl.constexpr,
    W: tl.constexpr,
    PREV: tl.constexpr,
    INTERP: tl.constexpr,
):
    """plane . w + tile * 2^(PREV - exponent) (plane on the left): the previous run's sum ``tile`` (in its own plane
    units, log2 factor ``PREV`` to code units) brought to this run's plane units and chained into this run's
    product, one accumulator per chunk instead of one per run."""
    SHIFT: tl.constexpr = (J0 // W) * W
    x = tl.load(ptrs + RUN_OFF + (J0 % W) * CH, mask=mask, other=0)
    plane = subnormal16(x & (((1 << W) - 1) << SHIFT))
    return mma(plane, w, tile * ((1 << (PREV + 7)) / (1 << (LOW - SHIFT + 7))), INTERP)


@triton.jit
def folded_value_tile(x_one, ptrs, mask, w, zero_rt, C: tl.constexpr, PAGE: tl.constexpr, INTERP: tl.constexpr):
    """(value codes of chunk ``C``)^T . w on the tensor cores ([coords, tokens] planes on the left), codes read as fp16
    subnormal planes, in a fresh accumulator (added to the running sum in fp32 by the caller: the folded sums cancel,
    and the tensor cores' truncating accumulation over thousands of tokens biased them, 1.6e-2 at 64k on the H200),
    in code units * u * 2^-24 (``value_unit``).

    One run (``VW1 == 0``, codes in the already loaded bytes ``x_one``): one plane. Several runs (3, 5, 6, 7 bits):
    one plane per run from ``ptrs``, the products chained in the chunk's one accumulator, the partial sum rescaled
    between runs (H200: 381 -> 345 us at B=8/64k against one fresh accumulator and FFMA set per run).
    """
    CH: tl.constexpr = PAGE.CH
    VW0: tl.constexpr = PAGE.VW0
    VW1: tl.constexpr = PAGE.VW1
    if VW1 == 0:
        plane = subnormal16(x_one & (((1 << PAGE.VB) - 1) << (C * PAGE.VB)))
        tile = mma(plane, w, tl.zeros([plane.shape[0], w.shape[1]], tl.float32) + zero_rt, INTERP)
    else:  # a plain zero start: the chained product is never ``x + dot(a, b, 0)``, which Triton would fold
        J0: tl.constexpr = C * (PAGE.VCW // CH)
        x = tl.load(ptrs + (J0 % VW0) * CH, mask=mask, other=0)
        tile = mma(
            subnormal16(x & (((1 << VW0) - 1) << ((J0 // VW0) * VW0))),
            w,
            tl.zeros([ptrs.shape[0], w.shape[1]], tl.float32),
            INTERP,
        )
        tile = chain_run(tile, ptrs, mask, w, J0, CH, CH * VW0, VW0, VW1, -((J0 // VW0) * VW0), INTERP)
        if PAGE.VW2 > 0:
            tile = chain_run(
                tile, ptrs, mask, w, J0, CH, CH * (VW0 + VW1), VW0 + VW1, PAGE.VW2, VW0 - (J0 // VW1) * VW1, INTERP
            )
    return tile


@triton.jit
def load_norms(region, off, mask, NORM_F32: tl.constexpr):
    """Per-token norms (fp32) at token offsets ``off`` of a page's norm region (byte pointers), stored as fp32 or
    fp16."""
    if NORM_F32:
        x = tl.load((region + off * 4).to(tl.pointer_type(tl.float32)), mask=mask, other=0.0)
    else:
        x = tl.load((region + off * 2).to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def run_bits(ptrs, mask, j, CH: tl.constexpr, W: tl.constexpr):
    """``W``-bit sub-field of coordinates ``j`` (int32, broadcast against ``ptrs``) from one planar run whose bytes
    start at ``ptrs``: byte j % (CH*W), bits (j // (CH*W)) * W (``format.py``), as int32."""
    x = tl.load(ptrs + j % (CH * W), mask=mask, other=0).to(tl.int32)
    return (x >> ((j // (CH * W)) * W)) & ((1 << W) - 1)


@triton.jit
def field_tile(ptrs, mask, j, CH: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr):
    """Codes (int32) of coordinates ``j`` of a field stored as up to three planar runs (widths W0, W1, W2), in
    one tile over every coordinate at once (prefill: a whole [tokens, D] tile, dequantized once per program)."""
    code = run_bits(ptrs, mask, j, CH, W0)
    if W1 > 0:
        code = code | (run_bits(ptrs + CH * W0, mask, j, CH, W1) << W0)
    if W2 > 0:
        code = code | (run_bits(ptrs + CH * (W0 + W1), mask, j, CH, W2) << (W0 + W1))
    return code


# ---------------------------------------------------------------------------------------------- klt keys
@triton.jit
def rope_cos_sin(pos, turns):
    """cos, sin of RoPE's angle at integer positions ``pos`` for frequencies ``turns`` (fp64, turns per position;
    broadcast together): the angle is reduced to [0, 2 pi) in float64 first, so it stays exact to fp32 at any
    position (an fp32 angle loses ~4e-3 rad at 128k tokens)."""
    a = pos.to(tl.float64) * turns
    r = (a - a.to(tl.int64).to(tl.float64)).to(tl.float32) * 6.283185307179586
    return tl.cos(r), tl.sin(r)


@triton.jit
def klt_code_operands(h64, meta_ptr, lv_ptr, j, valid, PAGE: tl.constexpr, KLT: tl.constexpr, HALF_CODE: tl.constexpr):
    """The code-reading bundle (``klt_operands``) of one KV head's coefficients ``j`` [R] (``valid``: real ones; the
    others read as 0-bit codes): first code bit and width [R], the one-hot byte pickers [R, KCBP], and the levels'
    cubic coefficients [R] (``KLT.CUBIC``) or level-table rows and their mask [R]."""
    kb = tl.arange(0, KLT.KCBP)
    bo = tl.load(meta_ptr + h64 * (2 * PAGE.DP) + j, mask=valid, other=0)
    w = tl.load(meta_ptr + h64 * (2 * PAGE.DP) + PAGE.DP + j, mask=valid, other=0)
    first = (bo >> 3)[:, None]
    sel = ((kb[None, :] == first) & (w > 0)[:, None]).to(tl.int8)
    sel_hi = ((kb[None, :] == first + 1) & ((bo & 7) + w > 8)[:, None]).to(tl.int8)
    if not KLT.CUBIC:
        levels = (lv_ptr + (h64 * PAGE.D + j) * 256, valid & (j < PAGE.D))
    elif HALF_CODE:
        poly = lv_ptr + h64 * (5 * PAGE.DP) + j
        levels = (
            tl.load(poly, mask=valid, other=0.0).to(tl.float16)[:, None],
            tl.load(poly + PAGE.DP, mask=valid, other=0.0).to(tl.float16)[:, None],
            tl.load(poly + 2 * PAGE.DP, mask=valid, other=0.0).to(tl.float16)[:, None],
            tl.load(poly + 3 * PAGE.DP, mask=valid, other=0.0).to(tl.float16)[:, None],
            tl.load(poly + 4 * PAGE.DP, mask=valid, other=0.0).to(tl.float16)[:, None],
        )
    else:
        poly = lv_ptr + h64 * (3 * PAGE.DP) + j
        levels = (
            tl.load(poly, mask=valid, other=0.0)[:, None],
            tl.load(poly + PAGE.DP, mask=valid, other=0.0)[:, None],
            tl.load(poly + 2 * PAGE.DP, mask=valid, other=0.0)[:, None],
        )
    return bo, w, sel, sel_hi, levels


@triton.jit
def klt_operands(
    h,
    meta_ptr,
    lv_ptr,
    dec_ptr,
    mean_ptr,
    PAGE: tl.constexpr,
    KLT: tl.constexpr,
    HALF_CODE: tl.constexpr = False,
    DIAG: tl.constexpr = False,
):
    """One KV head's klt read operands (``_common.klt_constants``), loaded once per program, as two bundles.

    Code reading (``klt_levels``, ``klt_code_operands``): each coefficient's first code bit and width [DP]; with
    ``KLT.SELECT`` the one-hot int8 pickers [DP, KCBP] of each coefficient's byte and of the byte after it (codes that
    straddle one; zero rows where none); with ``KLT.CUBIC`` the levels' linear, square and cube coefficients [DP]
    (from ``lv_ptr``: fp32 [H, 3, DP]; with ``HALF_CODE``, for ``klt_levels16``, fp16 of the cubic in y and the
    code's map to y from fp32 [H, 5, DP], ``_common.half_code_cubic``), else the head's level-table rows (from
    ``lv_ptr``: fp32 [H, D, 256]) and their mask.
    Decoding (``klt_keys``): the decode matrix's row blocks as A operands in fp16 — [RHP, DP] x 2 (the rotary pairs'
    first and second channels) and [RRP, DP] (unrotated channels) — and the mean's same three parts. Keys are computed
    transposed (channels x tokens): the warps of a program split these operands by rows (as B operands every warp
    held them whole: 1.7 KB of spills per thread at D=128, ``compile_sm90.py``).
    ``DIAG`` (``KLT.DIAGONAL``, decode; the levels are the channels', scaled): the code-reading bundle comes as three,
    one per part of the key (rotary first channels [RHP], second [RHP], unrotated [RRP]: ``klt_keys_diagonal``), and
    the decoding bundle is the mean's three parts alone (no decode matrix is loaded; fp16 with ``HALF_CODE``)."""
    ia = tl.arange(0, KLT.RHP)
    ir = tl.arange(0, KLT.RRP)
    h64 = h.to(tl.int64)
    mrow = mean_ptr + h64 * PAGE.DP
    ma = tl.load(mrow + ia, mask=ia < KLT.RH, other=0.0)
    mb = tl.load(mrow + KLT.RH + ia, mask=ia < KLT.RH, other=0.0)
    mr = tl.load(mrow + 2 * KLT.RH + ir, mask=ir < KLT.RR, other=0.0)
    if DIAG:
        ca = klt_code_operands(h64, meta_ptr, lv_ptr, ia, ia < KLT.RH, PAGE, KLT, HALF_CODE)
        cb = klt_code_operands(h64, meta_ptr, lv_ptr, KLT.RH + ia, ia < KLT.RH, PAGE, KLT, HALF_CODE)
        cr = klt_code_operands(h64, meta_ptr, lv_ptr, 2 * KLT.RH + ir, ir < KLT.RR, PAGE, KLT, HALF_CODE)
        if HALF_CODE:  # ``klt_keys_diagonal`` adds the mean in fp16
            return (ca, cb, cr), (ma.to(tl.float16), mb.to(tl.float16), mr.to(tl.float16))
        else:
            return (ca, cb, cr), (ma, mb, mr)
    else:
        j = tl.arange(0, PAGE.DP)
        cops = klt_code_operands(h64, meta_ptr, lv_ptr, j, j < PAGE.DP, PAGE, KLT, HALF_CODE)
        dec = dec_ptr + h64 * (PAGE.DP * PAGE.DP) + j[None, :] * PAGE.DP
        da = tl.load(dec + ia[:, None], mask=(ia < KLT.RH)[:, None], other=0.0)
        db = tl.load(dec + KLT.RH + ia[:, None], mask=(ia < KLT.RH)[:, None], other=0.0)
        dr = tl.load(dec + 2 * KLT.RH + ir[:, None], mask=(ir < KLT.RR)[:, None], other=0.0)
        return cops, (da, db, dr, ma, mb, mr)


@triton.jit
def pick_bytes(sel, codes, INTERP: tl.constexpr):
    """int32 [DP, N] = one-hot int8 pickers sel [DP, KCBP] x int8 code bytes [KCBP, N]: each row's byte,
    sign-extended (exact: one product per sum; fp32 under the CPU interpreter)."""
    if INTERP:
        out = tl.dot(sel.to(tl.float32), codes.to(tl.float32)).to(tl.int32)
    else:
        out = tl.dot(sel, codes, out_dtype=tl.int32)
    return out


@triton.jit
def klt_code_bytes(rows, nmask, PAGE: tl.constexpr, KLT: tl.constexpr):
    """With ``KLT.SELECT``: the code bytes int8 [KCBP, N] of the keys whose codes start at byte pointers ``rows``
    [N], loaded once for a tile (``klt_codes_of``); else ``rows`` (codes are then loaded a byte at a time)."""
    if KLT.SELECT:
        kb = tl.arange(0, KLT.KCBP)
        tile = tl.load(rows[None, :] + kb[:, None], mask=nmask[None, :] & (kb < PAGE.KCB)[:, None], other=0)
        tile = tile.to(tl.int8, bitcast=True)
    else:
        tile = rows
    return tile


@triton.jit
def klt_codes_of(tile, rows, nmask, cops, KLT: tl.constexpr, INTERP: tl.constexpr):
    """``klt_codes`` from a tile's code bytes already loaded (``klt_code_bytes``), for the coefficients of ``cops``
    (a ``klt_code_operands`` bundle)."""
    bo, w, sel, sel_hi, levels = cops
    sh = bo & 7
    if KLT.SELECT:
        lo = pick_bytes(sel, tile, INTERP)  # sign-extended: bits sh .. sh + w - 1 <= 7 are the byte's own
        if not KLT.ONE_BYTE:
            lo = (lo & 255) | ((pick_bytes(sel_hi, tile, INTERP) & 255) << 8)
    else:
        byte = bo >> 3
        lo = tl.load(rows[None, :] + byte[:, None], mask=nmask[None, :] & (w > 0)[:, None], other=0).to(tl.int32)
        if not KLT.ONE_BYTE:
            hi = tl.load(rows[None, :] + byte[:, None] + 1, mask=nmask[None, :] & (sh + w > 8)[:, None], other=0)
            lo = lo | (hi.to(tl.int32) << 8)
    return (lo >> sh[:, None]) & ((1 << w) - 1)[:, None]


@triton.jit
def klt_codes(rows, nmask, cops, PAGE: tl.constexpr, KLT: tl.constexpr, INTERP: tl.constexpr):
    """Codes int32 [DP, N] (transposed) of the keys whose codes start at byte pointers ``rows`` [N], through
    ``klt_operands``' code-reading bundle ``cops``: each coefficient's ``w``-bit code read from its bit offset ``bo``
    — with ``KLT.SELECT`` picked from the tile's code bytes by ``pick_bytes``, else loaded a byte at a time; one byte
    with ``KLT.ONE_BYTE`` (every code inside a byte), else two."""
    return klt_codes_of(klt_code_bytes(rows, nmask, PAGE, KLT), rows, nmask, cops, KLT, INTERP)


@triton.jit
def klt_levels_of(code, nmask, cops, KLT: tl.constexpr):
    """Levels z [R, N] fp32 of codes [R, N] (``klt_codes``): looked up in the head's level table, or with
    ``KLT.CUBIC`` computed as a cubic of the centered code (``_common.klt_constants`` folds the constant into the
    mean)."""
    bo, w, sel, sel_hi, levels = cops
    if KLT.CUBIC:  # levels a cubic of the centered code u: s u + r u^2 + t u^3 (the constant is in the mean)
        s, r, t = levels
        u = (2 * code - ((1 << w) - 1)[:, None]).to(tl.float32)
        z = u * (s + u * (r + u * t))
    else:
        ptrs, ok = levels
        z = tl.load(ptrs[:, None] + code, mask=nmask[None, :] & ok[:, None], other=0.0)
    return z


@triton.jit
def klt_levels(rows, nmask, cops, PAGE: tl.constexpr, KLT: tl.constexpr, INTERP: tl.constexpr):
    """Coefficient levels z [DP, N] fp32 (transposed) of the keys whose codes start at byte pointers ``rows`` [N]
    (``klt_codes``, ``klt_levels_of``)."""
    return klt_levels_of(klt_codes(rows, nmask, cops, PAGE, KLT, INTERP), nmask, cops, KLT)


@triton.jit
def klt_levels16_of(code, cops):
    """``klt_levels16`` of codes [R, N] already read (``klt_codes``)."""
    s, r, t, m, k = cops[4]
    y = (code.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) * m - k
    return y * (s + y * (r + y * t))


@triton.jit
def klt_levels16(rows, nmask, cops, PAGE: tl.constexpr, KLT: tl.constexpr, INTERP: tl.constexpr):
    """``klt_levels`` of cubic levels (``KLT.CUBIC``) in fp16, from ``klt_operands(..., HALF_CODE=True)``: the code c
    becomes the fp16 x = 1024 + c by its bit pattern 0x6400 | c (no conversion instruction), y = (c - 2^(w-1)) /
    2^(w-1) = x m - k by one exact FMA, and the levels' cubic in y (``_common.half_code_cubic``: its constant in the
    decode mean) by three fp16 FMAs, two codes per instruction (HFMA2): the tile feeds the decode product in fp16.
    (Codes left in place in their byte, the shift folded into m and k, compiled to as many instructions on sm_90.)"""
    return klt_levels16_of(klt_codes(rows, nmask, cops, PAGE, KLT, INTERP), cops)


@triton.jit
def klt_keys(zt, cos, sin, dops, KLT: tl.constexpr, INTERP: tl.constexpr):
    """Post-RoPE keys (transposed) of coefficient levels zt [DP, N] as three fp32 parts: rotary first channels
    [RHP, N], second channels [RHP, N] and unrotated channels [RRP, N]: R (m + B z) through ``klt_operands``' decoding
    bundle ``dops``, with cos, sin [RHP, N] of the rotation's angles (``rope_cos_sin``; RoPE's attention scaling is
    the caller's: in cos and sin, or in the query)."""
    da, db, dr, ma, mb, mr = dops
    z16 = zt.to(tl.float16)
    n: tl.constexpr = zt.shape[1]
    ka = mma(da, z16, tl.zeros([KLT.RHP, n], tl.float32), INTERP) + ma[:, None]
    kb = mma(db, z16, tl.zeros([KLT.RHP, n], tl.float32), INTERP) + mb[:, None]
    kr = tl.zeros([KLT.RRP, n], tl.float32)
    if KLT.RR > 0:
        kr = mma(dr, z16, kr, INTERP) + mr[:, None]
    return ka * cos - kb * sin, kb * cos + ka * sin, kr


@triton.jit
def klt_keys_diagonal(rows, nmask, cos, sin, cops, dops, PAGE: tl.constexpr, KLT: tl.constexpr, INTERP: tl.constexpr):
    """``klt_keys`` of diagonal decode matrices (``KLT.DIAGONAL``), from the codes at byte pointers ``rows`` [N]:
    each part's levels (``klt_operands(..., DIAG=True)``: scaled) plus the mean are that part's pre-RoPE channels
    (no decode product), then turned as ``klt_keys`` does. The tile's code bytes are loaded once for the three parts.
    With ``KLT.CUBIC`` everything stays in fp16, two elements an instruction: the levels (``klt_levels16_of``), the
    mean (fp16 in ``dops``) and the turn (``cos``, ``sin`` fp16: ``decode_klt._klt_read_operands``); the keys are
    fp16, as the score product takes them. Else fp32 as ``klt_keys``."""
    ca, cb, cr = cops
    ma, mb, mr = dops
    tile = klt_code_bytes(rows, nmask, PAGE, KLT)
    n: tl.constexpr = rows.shape[0]
    if KLT.CUBIC:
        ka = klt_levels16_of(klt_codes_of(tile, rows, nmask, ca, KLT, INTERP), ca) + ma[:, None]
        kb = klt_levels16_of(klt_codes_of(tile, rows, nmask, cb, KLT, INTERP), cb) + mb[:, None]
        kr = tl.zeros([KLT.RRP, n], tl.float16)
        if KLT.RR > 0:
            kr = klt_levels16_of(klt_codes_of(tile, rows, nmask, cr, KLT, INTERP), cr) + mr[:, None]
    else:
        ka = klt_levels_of(klt_codes_of(tile, rows, nmask, ca, KLT, INTERP), nmask, ca, KLT) + ma[:, None]
        kb = klt_levels_of(klt_codes_of(tile, rows, nmask, cb, KLT, INTERP), nmask, cb, KLT) + mb[:, None]
        kr = tl.zeros([KLT.RRP, n], tl.float32)
        if KLT.RR > 0:
            kr = klt_levels_of(klt_codes_of(tile, rows, nmask, cr, KLT, INTERP), nmask, cr, KLT) + mr[:, None]
    return ka * cos - kb * sin, kb * cos + ka * sin, kr
