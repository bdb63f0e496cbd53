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

from ._common import KEY_MSE, KEY_PROD, KEY_RAW, VAL_GROUP, VAL_RAW

# mode numbers as compile-time constants a @triton.jit function may read
K_RAW = tl.constexpr(KEY_RAW)
K_MSE = tl.constexpr(KEY_MSE)
K_PROD = tl.constexpr(KEY_PROD)
V_RAW = tl.constexpr(VAL_RAW)
V_GROUP = tl.constexpr(VAL_GROUP)


@triton.jit
def plane_bits(run_ptrs, mask, J0: tl.constexpr, CH: tl.constexpr, W: tl.constexpr):
    """Bits of chunk-start ``J0 = c * WMIN`` from a ``W``-bit run; ``run_ptrs`` are the chunk's byte pointers."""
    x = tl.load(run_ptrs + (J0 % W) * CH, mask=mask, other=0)
    return (x >> ((J0 // W) * W)) & ((1 << W) - 1)


@triton.jit
def chunk_codes(ptrs, mask, C: tl.constexpr, CH: tl.constexpr, WMIN: tl.constexpr,
                W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr):
    """Codes (uint8) of chunk ``C`` of a field stored as up to three planar runs (widths W0, W1, W2)."""
    code = plane_bits(ptrs, mask, C * WMIN, CH, W0)
    if W1 > 0:
        code = code | (plane_bits(ptrs + CH * W0, mask, C * WMIN, CH, W1) << W0)
    if W2 > 0:
        code = code | (plane_bits(ptrs + CH * (W0 + W1), mask, C * WMIN, CH, W2) << (W0 + W1))
    return code


@triton.jit
def centroid(code, cb_ptr, c0, c1, c2, c3, KB: tl.constexpr):
    """Codebook value of ``code`` (fp32): selects for 1-2 bit codebooks, a cached gather otherwise."""
    if KB == 1:
        val = tl.where(code != 0, c1, c0)
    elif KB == 2:
        val = tl.where(code >= 2, tl.where(code == 3, c3, c2), tl.where(code == 1, c1, c0))
    else:
        val = tl.load(cb_ptr + code.to(tl.int32))
    return val


@triton.jit
def centroid_poly(code, a0, a1, a2, a3, a4, a5, KB: tl.constexpr):
    """Codebook value of a 3/4-bit ``code`` (fp32) as an odd polynomial in v = code - (2^KB - 1)/2:
    an exponent-trick conversion and Horner on the CUDA cores instead of a gather from memory."""
    HALF: tl.constexpr = ((1 << KB) - 1) / 2
    # float bits 0x4B000000 | code are 2^23 + code exactly (2^23 + half itself is not representable)
    v = ((code.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0) - HALF
    t = v * v
    p = ((((a5 * t + a4) * t + a3) * t + a2) * t + a1) * t + a0
    return v * p


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
def fold_run(tile, ptrs, mask, w, zero_rt, J0: tl.constexpr, CH: tl.constexpr, RUN_OFF: tl.constexpr,
             LOW: tl.constexpr, W: tl.constexpr, W_LEFT: tl.constexpr, INTERP: tl.constexpr):
    """tile + (code bits of one planar run) . w, the bits read as a subnormal plane and rescaled to code units * 2^-24.

    ``W_LEFT``: the plane is the left operand (decode, [coords, tokens]) or the right one (prefill).
    """
    SHIFT: tl.constexpr = (J0 // W) * W
    x = tl.load(ptrs + RUN_OFF + (J0 % W) * CH, mask=mask, other=0)
    plane = subnormal16(x & (((1 << W) - 1) << SHIFT))
    if W_LEFT:
        part = mma(plane, w, tl.zeros([plane.shape[0], w.shape[1]], tl.float32) + zero_rt, INTERP)
    else:
        part = mma(w, plane, tl.zeros([w.shape[0], plane.shape[1]], tl.float32) + zero_rt, INTERP)
    return tile + part * ((1 << LOW) / (1 << SHIFT))
