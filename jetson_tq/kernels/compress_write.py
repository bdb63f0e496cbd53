"""Compress-on-write: new K/V tokens -> packed TurboQuant fields, stored straight into their pages.

One launch does everything ``KVCodec.encode`` + ``paged.write_slots`` do: per token and KV
head it normalizes the key, rotates it (tensor cores: one exact product with the +-1 matrix of a Hadamard
rotation, else fp16 hi+lo split products, ~fp32 accurate), picks
the codebook indices, takes the QJL signs of the residual's sketch ``S r = S u - (S Pi^T) c`` (the
combined matrices, so the residual is never formed), packs
indices and signs in the planar layout, quantizes the value per group (min/max, fp16 scale and
zero, one reciprocal per group, round-half-even) or, for TurboQuant_mse values, by the key path's steps with the
values' own rotation and codebook (norm, dense hi+lo rotation, bucketize, planar packing), and writes every
field at ``slot = block * block_size + offset`` (vLLM's ``slot_mapping``; slots < 0 are skipped). Each program
handles BLOCK_T tokens of one KV head.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ..codec.kv import KVCodec
from ..errors import ArgTypeError, DTypeError, ShapeError, expect_same_device
from ..format import PagedLayout
from ..validate import (
    FAULT_CLASS_BOUND,
    FAULT_COORD_SHIFT,
    FAULT_HEAD_SHIFT,
    FAULT_MAX_COORDS,
    FAULT_MAX_HEADS,
    FAULT_NONE,
    FAULT_RANK_SHIFT,
    FAULT_SLOT_SHIFT,
    FP32_MAX,
    RANK_GROUP_MIN,
    RANK_GROUP_SCALE,
    RANK_K_ABS,
    RANK_K_FINITE,
    RANK_KEY_NORM,
    RANK_V_ABS,
    RANK_V_FINITE,
    RANK_VALUE_NORM,
    StoreLimits,
)
from ._common import (
    INTERPRET,
    KEY_KLT,
    KEY_RAW,
    PageSpec,
    codec_constants,
    constexpr_bundle,
    cuda_or_interpreter,
    klt_constants,
    next_pow2,
    page_spec,
)
from ._launch import FastLauncher, resident_programs
from ._tiles import K_KLT, K_MSE, K_PROD, K_RAW, V_MSE, V_RAW, mma, rope_cos_sin

TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny, the reference norm clamp
ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: x + it (0 <= x < 2^22) holds round-half-even(x) in its low bits
# the store fault code (``validate``): constants a @triton.jit function may read
F_NONE = tl.constexpr(FAULT_NONE)
F_BOUND = tl.constexpr(FAULT_CLASS_BOUND)
F_RANK = tl.constexpr(FAULT_RANK_SHIFT)
F_SLOT = tl.constexpr(FAULT_SLOT_SHIFT)
F_HEAD = tl.constexpr(FAULT_HEAD_SHIFT)
F_COORD = tl.constexpr(FAULT_COORD_SHIFT)
NO_COORD = tl.constexpr(1 << 20)  # a coordinate past any head dim: "none" in per-token minimums
CHECK_COLS = tl.constexpr(16)  # columns per step of the fault code's second look at the tiles
R_K_FINITE = tl.constexpr(RANK_K_FINITE)
R_V_FINITE = tl.constexpr(RANK_V_FINITE)
R_K_ABS = tl.constexpr(RANK_K_ABS)
R_V_ABS = tl.constexpr(RANK_V_ABS)
R_KEY_NORM = tl.constexpr(RANK_KEY_NORM)
R_VALUE_NORM = tl.constexpr(RANK_VALUE_NORM)
R_GROUP_MIN = tl.constexpr(RANK_GROUP_MIN)
R_GROUP_SCALE = tl.constexpr(RANK_GROUP_SCALE)


@triton.jit
def _bucketize(y, bnd_ptr, KB: tl.constexpr):
    """Number of codebook boundaries strictly below y (torch.bucketize, right=False)."""
    idx = tl.zeros(y.shape, tl.int32)
    if KB <= 3:
        for i in tl.static_range((1 << KB) - 1):
            idx += (y > tl.load(bnd_ptr + i)).to(tl.int32)
    else:
        for bit in tl.static_range(KB):
            cand = idx + (1 << (KB - 1 - bit))
            idx = tl.where(y > tl.load(bnd_ptr + cand - 1), cand, idx)
    return idx


@triton.jit
def _dot3(a_hi, a_lo, m_hi_ptr, m_lo_ptr, rows, d, mask, D: tl.constexpr, acc, INTERP: tl.constexpr):
    """acc + a @ M[rows, :]^T with a and M split into fp16 hi + lo parts (three tensor-core dots,
    ~22-bit accurate: quantization decisions match the fp32 reference)."""
    off = rows[None, :] * D + d[:, None]
    m_hi = tl.load(m_hi_ptr + off, mask=mask, other=0.0)
    m_lo = tl.load(m_lo_ptr + off, mask=mask, other=0.0)
    acc = mma(a_hi, m_hi, acc, INTERP)
    acc = mma(a_hi, m_lo, acc, INTERP)
    return mma(a_lo, m_hi, acc, INTERP)


@triton.jit
def _search_symmetric(acc, rs, bnd_ptr, KB: tl.constexpr):
    """torch.bucketize(acc / rs, bounds) for a codebook symmetric about 0 (bounds[m] = 0, bounds[m + j] =
    -bounds[m - j]): count the 2^(KB-1) - 1 positive bounds times rs (per row) below |acc| and mirror by the sign.
    Differs from the division only where acc / rs is within rounding of a bound (ties, which the tests allow).
    The count is a float sum of 1.0/0.0 compares (FSET.BF + FADD per bound on sm_90; integer counts compiled to
    predicate moves, 3 instructions per bound); at 4 bits the middle bound first picks the half whose 3 bounds are
    counted (11 instructions instead of 13; a full binary search spilled predicates, a guess-and-check with one
    gathered bound spilled registers)."""
    HALF: tl.constexpr = (1 << (KB - 1)) - 1
    mag = tl.abs(acc)
    if KB == 4:
        up = mag > (tl.load(bnd_ptr + 11) * rs)[:, None]
        cf = tl.where(up, 4.0, 0.0)
        for j in tl.static_range(3):
            t = tl.where(up, (tl.load(bnd_ptr + 12 + j) * rs)[:, None], (tl.load(bnd_ptr + 8 + j) * rs)[:, None])
            cf += tl.where(mag > t, 1.0, 0.0)
    else:
        cf = tl.zeros(acc.shape, tl.float32)
        for j in tl.static_range(HALF):
            cf += tl.where(mag > (tl.load(bnd_ptr + HALF + 1 + j) * rs)[:, None], 1.0, 0.0)
    return cf.to(tl.int32) ^ tl.where(acc > 0, HALF + 1, HALF)  # HALF - count below 0, HALF + 1 + count above


@triton.constexpr_function
def _whole_chunk(c, gi, CW, CWP, GROUP, D):
    """Value chunk c lies inside group gi with no padding columns (no masks needed); compile-time."""
    return CW == CWP and gi * GROUP <= c * CW and (c + 1) * CW <= min((gi + 1) * GROUP, D)


@triton.constexpr_function
def _overlaps(c, gi, CW, GROUP):
    """Value chunk c has columns of group gi; compile-time."""
    return c * CW < (gi + 1) * GROUP and (c + 1) * CW > gi * GROUP


@triton.jit
def _store_run(
    codes,
    ptrs,
    mask,
    RUN_OFF: tl.constexpr,
    LOW: tl.constexpr,
    W: tl.constexpr,
    CH: tl.constexpr,
    CW: tl.constexpr,
    NCH: tl.constexpr,
):
    """Store one planar run (bits [LOW, LOW+W) of every code) at byte offset RUN_OFF of the field."""
    WMIN: tl.constexpr = CW // CH
    for k in tl.static_range(W // WMIN):  # piece k of the run = bytes [k*CW, (k+1)*CW)
        byte = tl.zeros(codes[0].shape, tl.int32)
        for c in tl.static_range(NCH):
            if (c * WMIN) % W == k * WMIN:
                byte |= ((codes[c] >> LOW) & ((1 << W) - 1)) << (((c * WMIN) // W) * W)
        tl.store(ptrs + RUN_OFF + k * CW, byte.to(tl.uint8), mask=mask)


@triton.jit
def _store_packed(
    codes,
    ptrs,
    mask,
    CH: tl.constexpr,
    CW: tl.constexpr,
    NCH: tl.constexpr,
    W0: tl.constexpr,
    W1: tl.constexpr,
    W2: tl.constexpr,
):
    """Pack per-chunk codes (a tuple of NCH [T, CWP] int32 tiles) into planar runs and store them."""
    if W0 > 0:
        _store_run(codes, ptrs, mask, 0, 0, W0, CH, CW, NCH)
    if W1 > 0:
        _store_run(codes, ptrs, mask, CH * W0, W0, W1, CH, CW, NCH)
    if W2 > 0:
        _store_run(codes, ptrs, mask, CH * (W0 + W1), W0 + W1, W2, CH, CW, NCH)


@dataclass(frozen=True)
class WriteConstexprs:
    """What one write configuration fixes at compile time besides the page (``PageSpec``): the kernel's ``CFG``."""

    HKV: int  # KV heads
    KCWP: int  # key chunk width padded to a power of two >= 16
    CHP: int  # CH (coordinates per 1-bit plane) padded likewise: the QJL sign planes
    VCWP: int  # value chunk width padded likewise
    SIGN_MMA: int  # key rotation: 1 one exact product of k with sqrt(D) Pi (Hadamard, fp16/bf16 keys), 2 the same
    # with the unit vector split hi + lo (fp32 keys), 0 dense hi + lo split products
    SPLIT_SKETCH: bool  # QJL sketch by hi + lo split products (exact signs); else single fp16 products
    SYM_SEARCH: bool  # codebook boundaries symmetric about 0: count half of them against |y|
    V_FP16: bool  # fp16 values: zero is their exact minimum (no lower clamp)
    BLOCK_T: int  # tokens per program
    INTERP: bool  # Triton's CPU interpreter (``mma`` converts operands to fp32 there)
    # ---- the store checks (``validate.check_kv_storable`` on the device; bounds: x <= bound, FP32_MAX = finite)
    CHECK: bool  # record the first store fault of the launch
    K_ABS: float = FP32_MAX  # bound on |k|
    K_ELEMS: bool = False  # |k| compared per element (raw keys, or inputs wider than the bound); else the norm
    # tells a non-finite key
    V_ABS: float = FP32_MAX  # bound on |v| (group values: from each group's minimum and maximum)
    KEY_NORM: float = FP32_MAX  # bound on ||k||
    VALUE_NORM: float = FP32_MAX  # bound on ||v|| (mse values)
    VALUE_GROUP: float = FP32_MAX  # bound on |group minimum| and group scale
    ROWS: bool = False  # the input is rows [R, T, H, D] (a cache append of several sequences), not [N, H, D]
    # ---- klt keys (``codec.klt``)
    KLT_STEPS: int = 0  # steps of the nearest-level binary search: the transform's most bits of a coefficient
    KCBP: int = 16  # code bytes padded to a power of two >= 16 (the width of the packing products)
    KLT_CW: int = 16  # coefficients per step of the encode product (a power of two >= 16, <= DP)
    KLT_DOT: str = "ieee"  # tl.dot input precision of the encode product (``WriteTuning.klt_precision``)


@triton.jit
def _compress_write_kernel(
    # ---- pointers
    k_ptr,  # [N, HKV, D] or rows [R, T, HKV, D] (ROWS): new keys (last dim contiguous)
    v_ptr,  # the same for the new values
    slot_ptr,  # int64 [N]: page slot of each token (block * BS + offset; < 0: skipped)
    pages_ptr,  # uint8 [blocks, HKV, PB]: the pages written
    pi_hi_ptr,  # fp16 [D, D]: rotation Pi, high part (dense rotation)
    pi_lo_ptr,  # fp16 [D, D]: ... and low part (hi + lo = Pi to ~22 bits)
    s_hi_ptr,  # fp16 [D, D]: QJL sketch S, high part
    s_lo_ptr,  # fp16 [D, D]: ... low part
    w_hi_ptr,  # fp16 [D, D]: W = S Pi^T, high part (the sketch of the centroids)
    w_lo_ptr,  # fp16 [D, D]: ... low part
    cb_ptr,  # fp32: key codebook
    bnd_ptr,  # fp32: its decision boundaries
    mt_ptr,  # [D, D] in k's dtype: (sqrt(D) Pi)^T, entries +-1 (SIGN_MMA > 0)
    vpi_hi_ptr,  # fp16 [D, D]: the value rotation Pi_v, high part (mse values)
    vpi_lo_ptr,  # fp16 [D, D]: ... low part
    vbnd_ptr,  # fp32: the value codebook's decision boundaries (mse values)
    fault_ptr,  # int64 [2]: the first store fault (``validate.FAULT_NONE``: none), then 1 once closed (CHECK)
    pos_ptr,  # int [N]: each token's position in its sequence (klt keys; else a placeholder)
    klt_meta_ptr,  # int32 [HKV, 2, DP]: klt keys (``_common.klt_constants``): code bit offsets and widths
    klt_enc_ptr,  # fp32 [HKV, DP, DP]: encode matrix transposed (row = channel, column = coefficient)
    klt_mid_ptr,  # fp32 [HKV, D, 255]: decision thresholds between used levels (+inf past them)
    klt_mean_ptr,  # fp32 [HKV, DP]: mean
    klt_turns_ptr,  # fp64 [RHP]: RoPE frequencies in turns per position
    # ---- sizes, strides, scalars
    sqrt_d,  # sqrt(D) as fp32 (the reference divides by it)
    n_tokens,  # N (= R * T)
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    page_bytes,  # PB
    klt_scale,  # klt keys: RoPE's attention scaling s
    # ---- rows (ROWS; last, so the flat launch's parameters keep their places)
    row_tokens,  # T
    stride_kb,
    stride_vb,
    # ---- compile time
    PAGE: tl.constexpr,  # ``PageSpec`` bundle: field offsets, widths, modes of one page
    CFG: tl.constexpr,  # ``WriteConstexprs`` bundle
    KLT: tl.constexpr,  # ``KltSpec`` bundle (klt keys' RoPE split)
):
    # One program = BLOCK_T tokens of one KV head: keys first (norm, rotation, codes, QJL signs), then values.
    pid_t, h = tl.program_id(0), tl.program_id(1)
    t = pid_t * CFG.BLOCK_T + tl.arange(0, CFG.BLOCK_T)
    slot = tl.load(slot_ptr + t, mask=t < n_tokens, other=-1).to(tl.int64)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    page = pages_ptr + ((slot // PAGE.BS) * (CFG.HKV * page_bytes) + h.to(tl.int64) * page_bytes)  # [T] byte ptrs
    off = slot % PAGE.BS
    d = tl.arange(0, PAGE.DP)
    dmask = valid[:, None] & (d[None, :] < PAGE.D)
    t64 = t.to(tl.int64)
    RAW_T: tl.constexpr = tl.bfloat16 if PAGE.RAW_BF16 else tl.float16
    koff = _token_offsets(t, t64, row_tokens, stride_kb, stride_kt, CFG.ROWS)  # [T, 1] element offsets of the tokens

    kin = tl.load(k_ptr + koff + h * stride_kh + d[None, :], mask=dmask, other=0.0)
    bad = tl.zeros([CFG.BLOCK_T], tl.int1)  # CHECK: tokens that fail a cheap sign of trouble
    if CFG.CHECK and CFG.K_ELEMS:  # raw keys / wide inputs: |k| per element, while the tile is in registers
        bad = bad | _over(kin, dmask, CFG.K_ABS)
    if PAGE.KEY_MODE == K_RAW:
        tl.store(
            (page + PAGE.OFF_KRAW + off * (2 * PAGE.D))[:, None].to(tl.pointer_type(RAW_T)) + d[None, :],
            kin.to(tl.float32).to(RAW_T),
            mask=dmask,
        )
        nrm = tl.zeros([CFG.BLOCK_T], tl.float32)  # no norm stored (nothing to bound)
    elif PAGE.KEY_MODE == K_KLT:
        _encode_klt_keys(
            k_ptr + koff + h * stride_kh,
            tl.load(pos_ptr + t, mask=t < n_tokens, other=0),
            page + PAGE.OFF_KCODE + off * PAGE.KCB,
            valid,
            h,
            klt_meta_ptr,
            klt_enc_ptr,
            klt_mid_ptr,
            klt_mean_ptr,
            klt_turns_ptr,
            klt_scale,
            PAGE,
            CFG,
            KLT,
        )
        nrm = tl.zeros([CFG.BLOCK_T], tl.float32)  # no norm stored (K_ELEMS checks the elements)
    else:
        nrm = _encode_keys(
            kin,
            page,
            off,
            valid,
            d,
            pi_hi_ptr,
            pi_lo_ptr,
            s_hi_ptr,
            s_lo_ptr,
            w_hi_ptr,
            w_lo_ptr,
            cb_ptr,
            bnd_ptr,
            mt_ptr,
            sqrt_d,
            PAGE,
            CFG,
        )
        if CFG.CHECK:  # a non-finite key has a non-finite norm
            bad = bad | ~(nrm <= CFG.KEY_NORM)
    voff = _token_offsets(t, t64, row_tokens, stride_vb, stride_vt, CFG.ROWS)
    if PAGE.VAL_MODE == V_RAW:
        v = tl.load(v_ptr + voff + h * stride_vh + d[None, :], mask=dmask, other=0.0)
        tl.store(
            (page + PAGE.OFF_VRAW + off * (2 * PAGE.D))[:, None].to(tl.pointer_type(RAW_T)) + d[None, :],
            v.to(tl.float32).to(RAW_T),
            mask=dmask,
        )
        gbad = tl.zeros([CFG.BLOCK_T], tl.int32)
        if CFG.CHECK:
            bad = bad | _over(v, dmask, CFG.V_ABS)
    elif PAGE.VAL_MODE == V_MSE:
        v = tl.load(v_ptr + voff + h * stride_vh + d[None, :], mask=dmask, other=0.0)
        vnrm = _encode_values(v, page, off, valid, d, vpi_hi_ptr, vpi_lo_ptr, vbnd_ptr, PAGE, CFG)
        gbad = tl.zeros([CFG.BLOCK_T], tl.int32)
        if CFG.CHECK:  # bit 2: the value norm past its bound (a non-finite value has a non-finite norm)
            gbad = tl.where(~(vnrm <= CFG.VALUE_NORM), 4, 0)
            bad = bad | _over(v, dmask, CFG.V_ABS) | (gbad != 0)
    else:
        gbad = _quantize_values(v_ptr, voff, h, stride_vh, valid, page, off, PAGE, CFG)
        bad = bad | (gbad != 0)
    if CFG.CHECK:
        if tl.max((valid & bad).to(tl.int32), 0) != 0:  # rare: the exact fault code, from a second load of the tiles
            _record_fault(
                k_ptr,
                v_ptr,
                fault_ptr,
                nrm,
                gbad,
                slot,
                valid,
                koff,
                voff,
                h,
                stride_kh,
                stride_vh,
                PAGE,
                CFG,
            )


@triton.jit
def _token_offsets(t, t64, row_tokens, stride_b, stride_t, ROWS: tl.constexpr):
    """Element offsets [T, 1] of tokens ``t`` of the launch: token t * stride_t of a flat [N, H, D] input, or with
    ROWS token t % row_tokens of row t // row_tokens of an [R, T, H, D] one (a cache append's rows, read in place)."""
    if ROWS:
        r = t // row_tokens
        off = r.to(tl.int64) * stride_b + (t - r * row_tokens).to(tl.int64) * stride_t
        out = off[:, None]
    else:
        out = t64[:, None] * stride_t
    return out


@triton.jit
def _over(x, mask, BOUND: tl.constexpr):
    """Per token [T] of the tile x [T, DP]: some element fails |x| <= BOUND (compared in fp32; NaN fails)."""
    return tl.max(tl.where(mask & ~(tl.abs(x.to(tl.float32)) <= BOUND), 1, 0), 1) != 0


@triton.jit
def _record_fault(
    k_ptr,
    v_ptr,
    fault_ptr,
    nrm,
    gbad,
    slot,
    valid,
    koff,
    voff,
    h,
    stride_kh,
    stride_vh,
    PAGE: tl.constexpr,
    CFG: tl.constexpr,
):
    """The store checks of ``validate.check_kv_storable`` for this program's tokens, as the smallest fault code: per
    token the first failing check (lowest rank) and, for non-finite elements, the first such coordinate; the
    launch's smallest is kept with an atomic min, unless an earlier refused write already closed the record. Works
    per token ([T] vectors) beside one reloaded tile at a time, so the rare path needs few registers."""
    base = (slot << F_SLOT) | (h.to(tl.int64) << F_HEAD) | F_BOUND  # [T]: slot and head bits, class "bound"
    # each failing check lowers the token's code (the rank is its top bits: the smallest code is the first check)
    code = tl.where((gbad & 2) != 0, (R_GROUP_SCALE << F_RANK) | base, F_NONE)
    code = tl.where((gbad & 1) != 0, (R_GROUP_MIN << F_RANK) | base, code)
    code = tl.where((gbad & 4) != 0, (R_VALUE_NORM << F_RANK) | base, code)
    if PAGE.KEY_MODE == K_MSE or PAGE.KEY_MODE == K_PROD:
        code = tl.where(~(nrm <= CFG.KEY_NORM), (R_KEY_NORM << F_RANK) | base, code)
    for c in tl.static_range(PAGE.DP // CHECK_COLS):  # column blocks of the reloaded tiles: few live registers
        col = c * CHECK_COLS + tl.arange(0, CHECK_COLS)
        cmask = valid[:, None] & (col[None, :] < PAGE.D)
        vt = tl.load(v_ptr + voff + h * stride_vh + col[None, :], mask=cmask, other=0.0)
        code = tl.where(_over(vt, cmask, CFG.V_ABS), tl.minimum(code, (R_V_ABS << F_RANK) | base), code)
        code = _first_nonfinite(vt, cmask, col, base ^ F_BOUND, R_V_FINITE, code)
        kt = tl.load(k_ptr + koff + h * stride_kh + col[None, :], mask=cmask, other=0.0)
        code = tl.where(_over(kt, cmask, CFG.K_ABS), tl.minimum(code, (R_K_ABS << F_RANK) | base), code)
        code = _first_nonfinite(kt, cmask, col, base ^ F_BOUND, R_K_FINITE, code)
    code = tl.min(tl.where(valid, code, F_NONE), 0)
    if tl.load(fault_ptr + 1) == 0:
        tl.atomic_min(fault_ptr, code)


@triton.jit
def _first_nonfinite(x, mask, d, base, RANK: tl.constexpr, code):
    """``code`` [T], lowered for each token that holds a non-finite element of x [T, DP] to that fault: its first
    such coordinate and its class (0 NaN, 1 +inf, 2 -inf). x - x == 0 holds exactly for finite x (compared in fp32,
    exact for every input dtype: Triton's interpreter keeps bf16 as raw bits, whose difference is 0 for inf too)."""
    x = x.to(tl.float32)
    first = tl.min(tl.where(mask & ~((x - x) == 0), d[None, :], NO_COORD), 1)  # [T] int32
    xv = tl.sum(tl.where(d[None, :] == first[:, None], x, 0.0), 1)  # that element (NaN/inf kept)
    cls = tl.where(xv != xv, 0, tl.where(xv > 0, 1, 2)).to(tl.int64)
    found = (RANK << F_RANK) | base | (first.to(tl.int64) << F_COORD) | cls
    return tl.where(first < NO_COORD, tl.minimum(code, found), code)


@triton.jit
def _encode_keys(
    kin,
    page,
    off,
    valid,
    d,
    pi_hi_ptr,
    pi_lo_ptr,
    s_hi_ptr,
    s_lo_ptr,
    w_hi_ptr,
    w_lo_ptr,
    cb_ptr,
    bnd_ptr,
    mt_ptr,
    sqrt_d,
    PAGE: tl.constexpr,
    CFG: tl.constexpr,
):
    """Keys kin [BLOCK_T, DP] -> norm, codebook indices (packed) and, for prod keys, the QJL signs and residual
    norm, stored at the tokens' page offsets. Returns the norms (fp32, before rounding to the stored dtype)."""
    NORM_T: tl.constexpr = tl.float32 if PAGE.NORM_F32 else tl.float16
    NB: tl.constexpr = 4 if PAGE.NORM_F32 else 2
    KFULL: tl.constexpr = PAGE.KCW == CFG.KCWP and PAGE.KCH * PAGE.KCW == PAGE.D  # no padding key chunk columns
    kc = tl.arange(0, CFG.KCWP)
    if CFG.SIGN_MMA == 1 and PAGE.KEY_MODE == K_MSE:
        # every chunk's k . M_i first: ||M k||^2 = D ||k||^2 gives the norm with no fp32 copy of k
        accs = ()
        for c in tl.static_range(PAGE.KCH):
            row = c * PAGE.KCW + kc
            m = tl.load(
                mt_ptr + d[:, None] * PAGE.D + row[None, :],
                mask=(kc[None, :] < PAGE.KCW) & (row[None, :] < PAGE.D),
                other=0.0,
            )
            accs = accs + (mma(kin, m, tl.zeros([CFG.BLOCK_T, CFG.KCWP], tl.float32), CFG.INTERP),)
        sq = tl.sum(accs[0] * accs[0], 1)
        for c in tl.static_range(1, PAGE.KCH):
            sq += tl.sum(accs[c] * accs[c], 1)
        nrm = tl.sqrt_rn(sq * (1.0 / PAGE.D))
    else:
        k = kin.to(tl.float32)
        nrm = tl.sqrt_rn(tl.sum(k * k, 1))
    if CFG.SIGN_MMA != 1 or PAGE.KEY_MODE == K_PROD:
        unit = k / tl.maximum(nrm, TINY)[:, None]
        u_hi = unit.to(tl.float16)
        u_lo = (unit - u_hi.to(tl.float32)).to(tl.float16)
        # ||r||^2 = ||unit||^2 - 2 <Pi unit, c> + ||c||^2 (Pi orthogonal): no residual tile is ever formed
        r2 = tl.sum(unit * unit, 1)
    if CFG.SIGN_MMA == 1:
        rs = nrm * sqrt_d  # (k . M_i) / rs = (Pi u)_i, M = sqrt(D) Pi = H diag(s) (entries +-1, exact in k's dtype)
    elif CFG.SIGN_MMA == 2:
        rs = tl.zeros_like(nrm) + sqrt_d  # fp32 input: the unit vector split hi + lo, each product exact
    codes = ()
    cents = ()
    cents_lo = ()
    kbyte = tl.zeros([CFG.BLOCK_T, CFG.KCWP], tl.int32)
    for c in tl.static_range(PAGE.KCH):
        row = c * PAGE.KCW + kc  # rows of Pi that give this chunk's rotated coordinates (planar chunk c)
        inside = (kc[None, :] < PAGE.KCW) & (row[None, :] < PAGE.D)
        if CFG.SIGN_MMA > 0:
            if CFG.SIGN_MMA == 1 and PAGE.KEY_MODE == K_MSE:
                acc = accs[c]
            else:
                m = tl.load(
                    mt_ptr + d[:, None] * PAGE.D + row[None, :],
                    mask=(kc[None, :] < PAGE.KCW) & (row[None, :] < PAGE.D),
                    other=0.0,
                )
            if CFG.SIGN_MMA == 1 and PAGE.KEY_MODE == K_PROD:
                acc = mma(kin, m, tl.zeros([CFG.BLOCK_T, CFG.KCWP], tl.float32), CFG.INTERP)
            elif CFG.SIGN_MMA == 2:
                acc = mma(u_lo, m, mma(u_hi, m, tl.zeros([CFG.BLOCK_T, CFG.KCWP], tl.float32), CFG.INTERP), CFG.INTERP)
            if CFG.SYM_SEARCH:
                code = _search_symmetric(acc, rs, bnd_ptr, PAGE.KB)
            else:
                code = _bucketize(acc * (1.0 / tl.maximum(rs, TINY))[:, None], bnd_ptr, PAGE.KB)
            if PAGE.KEY_MODE == K_PROD:
                y = acc * (1.0 / tl.maximum(rs, TINY))[:, None]
        else:
            y = _dot3(
                u_hi,
                u_lo,
                pi_hi_ptr,
                pi_lo_ptr,
                row,
                d,
                (kc[None, :] < PAGE.KCW) & (row[None, :] < PAGE.D) & (d[:, None] < PAGE.D),
                PAGE.D,
                tl.zeros([CFG.BLOCK_T, CFG.KCWP], tl.float32),
                CFG.INTERP,
            )
            code = _bucketize(y, bnd_ptr, PAGE.KB)
        if not KFULL:
            code = tl.where(inside, code, 0)  # padding coordinates pack as 0
        if PAGE.KW1 == 0:
            kbyte |= code << (c * PAGE.KW0)
        else:
            codes = codes + (code,)
        if PAGE.KEY_MODE == K_PROD:
            cent = tl.where(inside, tl.load(cb_ptr + code), 0.0)
            r2 += tl.sum(cent * (cent - 2.0 * y), 1)
            c_hi = cent.to(tl.float16)
            cents = cents + (c_hi,)
            if CFG.SPLIT_SKETCH:
                cents_lo = cents_lo + ((cent - c_hi.to(tl.float32)).to(tl.float16),)
    kptrs = (page + PAGE.OFF_KIDX + off * (PAGE.CH * PAGE.KB))[:, None] + kc[None, :]
    if PAGE.KB > 0:
        if PAGE.KW1 == 0:
            tl.store(kptrs, kbyte.to(tl.uint8), mask=valid[:, None] & (kc[None, :] < PAGE.KCW))
        else:
            _store_packed(
                codes,
                kptrs,
                valid[:, None] & (kc[None, :] < PAGE.KCW),
                PAGE.CH,
                PAGE.KCW,
                PAGE.KCH,
                PAGE.KW0,
                PAGE.KW1,
                PAGE.KW2,
            )
    tl.store((page + PAGE.OFF_KNORM + off * NB).to(tl.pointer_type(NORM_T)), nrm.to(NORM_T), mask=valid)
    if PAGE.KEY_MODE == K_PROD:
        _qjl_signs(u_hi, u_lo, cents, cents_lo, page, off, valid, d, s_hi_ptr, s_lo_ptr, w_hi_ptr, w_lo_ptr, PAGE, CFG)
        rn = nrm * tl.sqrt_rn(tl.maximum(r2, 0.0))
        tl.store((page + PAGE.OFF_KRNORM + off * NB).to(tl.pointer_type(NORM_T)), rn.to(NORM_T), mask=valid)
    return nrm


@triton.jit
def _encode_klt_keys(
    krow,
    pos,
    code_rows,
    valid,
    h,
    meta_ptr,
    enc_ptr,
    mid_ptr,
    mean_ptr,
    turns_ptr,
    scale,
    PAGE: tl.constexpr,
    CFG: tl.constexpr,
    KLT: tl.constexpr,
):
    """Post-RoPE keys at element pointers ``krow`` [BLOCK_T, 1] and positions ``pos`` [BLOCK_T] -> transform codes
    (``KeyTransformCoder.quantize``), stored at byte pointers ``code_rows`` [BLOCK_T]: the centered pre-RoPE key
    x = R_p^-1 k / s - m as three tiles (rotary pairs' first halves a, second halves b [BLOCK_T, RHP], channels past
    them [BLOCK_T, RRP]: neither rotated nor scaled, as transformers' partial RoPE), then z = A x KLT_CW coefficients
    at a time (fp32-accurate products with the row blocks of head h's transposed encode matrix), each coefficient's
    nearest level, its code routed into the token's stream bytes."""
    h64 = h.to(tl.int64)
    ia = tl.arange(0, KLT.RHP)
    ir = tl.arange(0, KLT.RRP)
    mrow = mean_ptr + h64 * PAGE.DP
    if KLT.RH > 0:  # a' = (a cos + b sin) / s, b' = (b cos - a sin) / s, angles reduced in fp64 (``rope_cos_sin``)
        amask = valid[:, None] & (ia < KLT.RH)[None, :]
        a = tl.load(krow + ia[None, :], mask=amask, other=0.0).to(tl.float32)
        b = tl.load(krow + KLT.RH + ia[None, :], mask=amask, other=0.0).to(tl.float32)
        cos, sin = rope_cos_sin(pos[:, None], tl.load(turns_ptr + ia)[None, :])
        s = tl.zeros_like(a) + scale
        xa = tl.math.div_rn(a * cos + b * sin, s) - tl.load(mrow + ia, mask=ia < KLT.RH, other=0.0)[None, :]
        xb = tl.math.div_rn(b * cos - a * sin, s) - tl.load(mrow + KLT.RH + ia, mask=ia < KLT.RH, other=0.0)[None, :]
    if KLT.RR > 0:
        xr = tl.load(krow + 2 * KLT.RH + ir[None, :], mask=valid[:, None] & (ir < KLT.RR)[None, :], other=0.0)
        xr = xr.to(tl.float32) - tl.load(mrow + 2 * KLT.RH + ir, mask=ir < KLT.RR, other=0.0)[None, :]
    cc = tl.arange(0, CFG.KLT_CW)
    meta = meta_ptr + h64 * (2 * PAGE.DP)
    stream = tl.zeros([CFG.BLOCK_T, CFG.KCBP], tl.float32)  # the codes' bytes, summed piece by piece
    STEPS: tl.constexpr = (PAGE.D + CFG.KLT_CW - 1) // CFG.KLT_CW
    for c in range(STEPS):  # a loop, not unrolled: one step's encode block and thresholds live at a time
        col = c * CFG.KLT_CW + cc
        erow = enc_ptr + h64 * (PAGE.DP * PAGE.DP) + col[None, :]  # enc[h][channel, col]: channel-major rows
        z = tl.zeros([CFG.BLOCK_T, CFG.KLT_CW], tl.float32)
        if KLT.RH > 0:
            ea = tl.load(erow + ia[:, None] * PAGE.DP, mask=(ia < KLT.RH)[:, None], other=0.0)
            z = tl.dot(xa, ea, z, input_precision=CFG.KLT_DOT)
            eb = tl.load(erow + (KLT.RH + ia[:, None]) * PAGE.DP, mask=(ia < KLT.RH)[:, None], other=0.0)
            z = tl.dot(xb, eb, z, input_precision=CFG.KLT_DOT)
        if KLT.RR > 0:
            er = tl.load(erow + (2 * KLT.RH + ir[:, None]) * PAGE.DP, mask=(ir < KLT.RR)[:, None], other=0.0)
            z = tl.dot(xr, er, z, input_precision=CFG.KLT_DOT)
        idx = _nearest_level(z, mid_ptr + (h64 * PAGE.D + tl.where(col < PAGE.D, col, 0)) * 255, CFG.KLT_STEPS)
        stream = _route_code_bytes(idx, tl.load(meta + col), tl.load(meta + PAGE.DP + col), stream, CFG)
    q = tl.arange(0, CFG.KCBP)
    tl.store(
        code_rows[:, None] + q[None, :],
        stream.to(tl.int32).to(tl.uint8),
        mask=valid[:, None] & (q < PAGE.KCB)[None, :],
    )


@triton.jit
def _nearest_level(z, rows, STEPS: tl.constexpr):
    """Per coefficient of z [N, C] the number of its thresholds below it (rows [C]: each coefficient's sorted
    thresholds, +inf past the used ones): a binary search of STEPS steps (2^STEPS - 1 thresholds reachable), as
    ``KeyTransformCoder._nearest_level``; NaN counts none, +inf every used one."""
    idx = tl.zeros(z.shape, tl.int32)
    for s in tl.static_range(STEPS):
        cand = idx + (1 << (STEPS - 1 - s))
        idx = tl.where(tl.load(rows[None, :] + (cand - 1)) < z, cand, idx)
    return idx


@triton.jit
def _route_code_bytes(codes, bo, w, stream, CFG: tl.constexpr):
    """``stream`` [N, KCBP] (fp32 byte values) plus codes [N, C] packed LSB-first (coefficient i: ``w[i]`` bits from
    stream bit ``bo[i]``; w = 0: nothing). A code spans at most two bytes and the pieces in one byte hold disjoint
    bits, so a byte is the sum of its pieces: two products with 0/1 matrices that route each code's low and high
    piece to its byte (fp16 integers <= 255, fp32 sums: exact)."""
    shifted = tl.where((w > 0)[None, :], codes, 0) << (bo & 7)[None, :]  # < 2^15
    q = tl.arange(0, CFG.KCBP)
    byte = (bo >> 3)[:, None]
    stream = mma((shifted & 255).to(tl.float16), (byte == q[None, :]).to(tl.float16), stream, CFG.INTERP)
    return mma((shifted >> 8).to(tl.float16), (byte + 1 == q[None, :]).to(tl.float16), stream, CFG.INTERP)


@triton.jit
def _qjl_signs(
    u_hi,
    u_lo,
    cents,
    cents_lo,
    page,
    off,
    valid,
    d,
    s_hi_ptr,
    s_lo_ptr,
    w_hi_ptr,
    w_lo_ptr,
    PAGE: tl.constexpr,
    CFG: tl.constexpr,
):
    """Store the signs of the residual's sketch S r = S unit - (S Pi^T) c, one bit plane per chunk of CH sketch rows
    (8 planes), from the unit keys (hi + lo) and their centroids (``cents``, + lo parts when SPLIT_SKETCH)."""
    kc = tl.arange(0, CFG.KCWP)
    sc = tl.arange(0, CFG.CHP)
    sbyte = tl.zeros([CFG.BLOCK_T, CFG.CHP], tl.int32)
    for c in tl.static_range(8):
        row = c * PAGE.CH + sc
        # exact (default): hi+lo split products, ~22 bits, so a sign differs from the fp32 reference
        # only where (S r)_i is within ~1e-6 of 0. Fast (KB <= 2 only): one fp16 product per term.
        smask = (sc[None, :] < PAGE.CH) & (row[None, :] < PAGE.D) & (d[:, None] < PAGE.D)
        if CFG.SPLIT_SKETCH:
            sk = _dot3(
                u_hi,
                u_lo,
                s_hi_ptr,
                s_lo_ptr,
                row,
                d,
                smask,
                PAGE.D,
                tl.zeros([CFG.BLOCK_T, CFG.CHP], tl.float32),
                CFG.INTERP,
            )
        else:
            s_hi = tl.load(s_hi_ptr + row[None, :] * PAGE.D + d[:, None], mask=smask, other=0.0)
            sk = mma(u_hi, s_hi, tl.zeros([CFG.BLOCK_T, CFG.CHP], tl.float32), CFG.INTERP)
        for c2 in tl.static_range(PAGE.KCH):
            kr = c2 * PAGE.KCW + kc  # W^T block: rows = chunk c2 coordinates, cols = sketch rows of chunk c
            wmask = (
                (kc[:, None] < PAGE.KCW) & (kr[:, None] < PAGE.D) & (sc[None, :] < PAGE.CH) & (row[None, :] < PAGE.D)
            )
            w_off = row[None, :] * PAGE.D + kr[:, None]
            w_hi = tl.load(w_hi_ptr + w_off, mask=wmask, other=0.0)
            sk = mma(cents[c2], -w_hi, sk, CFG.INTERP)
            if CFG.SPLIT_SKETCH:
                w_lo = tl.load(w_lo_ptr + w_off, mask=wmask, other=0.0)
                sk = mma(cents[c2], -w_lo, sk, CFG.INTERP)
                sk = mma(cents_lo[c2], -w_hi, sk, CFG.INTERP)
        sbyte |= ((sk >= 0) & (row[None, :] < PAGE.D)).to(tl.int32) << c
    tl.store(
        (page + PAGE.OFF_KSGN + off * PAGE.CH)[:, None] + sc[None, :],
        sbyte.to(tl.uint8),
        mask=valid[:, None] & (sc[None, :] < PAGE.CH),
    )


@triton.jit
def _encode_values(v, page, off, valid, d, vpi_hi_ptr, vpi_lo_ptr, vbnd_ptr, PAGE: tl.constexpr, CFG: tl.constexpr):
    """TurboQuant_mse values v [BLOCK_T, DP] (padding columns zero) -> norm and the codebook indices of the rotated
    unit vector Pi_v v / ||v|| (values' own rotation and codebook), stored packed at the tokens' page offsets. Each
    value chunk's rotated coordinates come from hi+lo split products with the chunk's rows of Pi_v (the dense key
    path's ``_dot3``, ~22 bits, for both rotation kinds), so a code differs from the reference only where the
    coordinate is within rounding of a boundary. Returns the norms (fp32, before rounding to the stored dtype)."""
    NORM_T: tl.constexpr = tl.float32 if PAGE.NORM_F32 else tl.float16
    NB: tl.constexpr = 4 if PAGE.NORM_F32 else 2
    VFULL: tl.constexpr = PAGE.VCW == CFG.VCWP and PAGE.VCH * PAGE.VCW == PAGE.D  # no padding chunk columns
    vf = v.to(tl.float32)
    nrm = tl.sqrt_rn(tl.sum(vf * vf, 1))
    unit = vf / tl.maximum(nrm, TINY)[:, None]
    u_hi = unit.to(tl.float16)
    u_lo = (unit - u_hi.to(tl.float32)).to(tl.float16)
    vc = tl.arange(0, CFG.VCWP)
    codes = ()
    vbyte = tl.zeros([CFG.BLOCK_T, CFG.VCWP], tl.int32)
    for c in tl.static_range(PAGE.VCH):
        row = c * PAGE.VCW + vc  # rows of Pi_v that give this chunk's rotated coordinates (planar chunk c)
        inside = (vc[None, :] < PAGE.VCW) & (row[None, :] < PAGE.D)
        y = _dot3(
            u_hi,
            u_lo,
            vpi_hi_ptr,
            vpi_lo_ptr,
            row,
            d,
            inside & (d[:, None] < PAGE.D),
            PAGE.D,
            tl.zeros([CFG.BLOCK_T, CFG.VCWP], tl.float32),
            CFG.INTERP,
        )
        code = _bucketize(y, vbnd_ptr, PAGE.VB)
        if not VFULL:
            code = tl.where(inside, code, 0)  # padding coordinates pack as 0
        if PAGE.VW1 == 0:
            vbyte |= code << (c * PAGE.VW0)
        else:
            codes = codes + (code,)
    vptrs = (page + PAGE.OFF_VIDX + off * (PAGE.CH * PAGE.VB))[:, None] + vc[None, :]
    vmask = valid[:, None] & (vc[None, :] < PAGE.VCW)
    if PAGE.VW1 == 0:
        tl.store(vptrs, vbyte.to(tl.uint8), mask=vmask)
    else:
        _store_packed(codes, vptrs, vmask, PAGE.CH, PAGE.VCW, PAGE.VCH, PAGE.VW0, PAGE.VW1, PAGE.VW2)
    tl.store((page + PAGE.OFF_VNORM + off * NB).to(tl.pointer_type(NORM_T)), nrm.to(NORM_T), mask=valid)
    return nrm


@triton.jit
def _quantize_values(v_ptr, voff, h, stride_vh, valid, page, off, PAGE: tl.constexpr, CFG: tl.constexpr):
    """Group-quantize and store values from the packing's chunk tiles [BLOCK_T, VCWP] (loaded once, no re-layout):
    min/max across whole chunks, one reciprocal per row and group instead of a division per element, and
    round-half-even by adding 1.5 * 2^23 (codes differ from the reference only at ties). Returns per token (CHECK)
    bit 0: a group's |minimum| or, with a V_ABS bound, |maximum| past its bound, bit 1: a group scale past VALUE_GROUP;
    under CHECK the minimum and maximum carry NaN, so a non-finite value sets one of them (0 without CHECK)."""
    LEVELS: tl.constexpr = (1 << PAGE.VB) - 1
    vc = tl.arange(0, CFG.VCWP)
    vt = ()
    for c in tl.static_range(PAGE.VCH):
        col = c * PAGE.VCW + vc
        vt = vt + (
            tl.load(
                v_ptr + voff + h * stride_vh + col[None, :],
                mask=valid[:, None] & (vc[None, :] < PAGE.VCW) & (col[None, :] < PAGE.D),
                other=0.0,
            ).to(tl.float32),
        )
    inv = ()
    zinv = ()
    srow = (page + PAGE.OFF_VSCALE + off * (2 * PAGE.NG)).to(tl.pointer_type(tl.float16))
    zrow = (page + PAGE.OFF_VZERO + off * (2 * PAGE.NG)).to(tl.pointer_type(tl.float16))
    gbad = tl.zeros([CFG.BLOCK_T], tl.int32)
    NAN: tl.constexpr = tl.PropagateNan.ALL if CFG.CHECK else tl.PropagateNan.NONE
    for gi in tl.static_range(PAGE.NG):
        lo2 = tl.full([CFG.BLOCK_T, CFG.VCWP], float("inf"), tl.float32)
        hi2 = tl.full([CFG.BLOCK_T, CFG.VCWP], float("-inf"), tl.float32)
        for c in tl.static_range(PAGE.VCH):
            if _whole_chunk(c, gi, PAGE.VCW, CFG.VCWP, PAGE.GROUP, PAGE.D):
                lo2 = tl.minimum(lo2, vt[c], propagate_nan=NAN)
                hi2 = tl.maximum(hi2, vt[c], propagate_nan=NAN)
            elif _overlaps(c, gi, PAGE.VCW, PAGE.GROUP):
                col = c * PAGE.VCW + vc
                ing = ((col // PAGE.GROUP == gi) & (vc < PAGE.VCW) & (col < PAGE.D))[None, :]
                lo2 = tl.minimum(lo2, tl.where(ing, vt[c], float("inf")), propagate_nan=NAN)
                hi2 = tl.maximum(hi2, tl.where(ing, vt[c], float("-inf")), propagate_nan=NAN)
        if CFG.CHECK:
            lo = tl.reduce(lo2, 1, _min_nan)
            hi = tl.reduce(hi2, 1, _max_nan)
            gbad |= tl.where(
                ~(tl.abs(lo) <= CFG.VALUE_GROUP) | ~(tl.abs(lo) <= CFG.V_ABS) | ~(tl.abs(hi) <= CFG.V_ABS), 1, 0
            )
            gbad |= tl.where(
                ~(tl.math.div_rn(hi - lo, tl.zeros([CFG.BLOCK_T], tl.float32) + LEVELS) <= CFG.VALUE_GROUP), 2, 0
            )
            zero = lo.to(tl.float16)
        else:
            zero = tl.min(lo2, 1).to(tl.float16)
            hi = tl.max(hi2, 1)
        scale = tl.math.div_rn(hi - zero.to(tl.float32), tl.zeros([CFG.BLOCK_T], tl.float32) + LEVELS)
        scale = scale.to(tl.float16)
        tl.store(srow + gi, scale, mask=valid)
        tl.store(zrow + gi, zero, mask=valid)
        r = 1.0 / tl.where(scale > 0, scale.to(tl.float32), 1.0)  # the reference divides by the scale (1 if 0)
        inv = inv + (r,)
        zinv = zinv + (zero.to(tl.float32) * r,)
    vcodes = ()
    for c in tl.static_range(PAGE.VCH):
        col = c * PAGE.VCW + vc
        if _whole_chunk(c, (c * PAGE.VCW) // PAGE.GROUP, PAGE.VCW, CFG.VCWP, PAGE.GROUP, PAGE.D):
            pos = vt[c] * inv[(c * PAGE.VCW) // PAGE.GROUP][:, None] - zinv[(c * PAGE.VCW) // PAGE.GROUP][:, None]
        else:
            cg = (col // PAGE.GROUP)[None, :]
            r2d = tl.zeros([CFG.BLOCK_T, CFG.VCWP], tl.float32)
            z2d = tl.zeros([CFG.BLOCK_T, CFG.VCWP], tl.float32)
            for gi in tl.static_range(PAGE.NG):
                r2d = tl.where(cg == gi, inv[gi][:, None], r2d)
                z2d = tl.where(cg == gi, zinv[gi][:, None], z2d)
            pos = vt[c] * r2d - z2d
        if not CFG.V_FP16:  # fp16 values: zero is their exact minimum, so v - zero >= 0 (no lower clamp)
            pos = tl.maximum(pos, 0.0)
        pos = tl.minimum(pos, LEVELS)
        q = (pos + ROUND_MAGIC).to(tl.int32, bitcast=True) & LEVELS  # + 1.5 * 2^23 rounds half to even
        vcodes = vcodes + (tl.where(((vc < PAGE.VCW) & (col < PAGE.D))[None, :], q, 0),)
    _store_packed(
        vcodes,
        (page + PAGE.OFF_VCODES + off * (PAGE.CH * PAGE.VB))[:, None] + vc[None, :],
        valid[:, None] & (vc[None, :] < PAGE.VCW),
        PAGE.CH,
        PAGE.VCW,
        PAGE.VCH,
        PAGE.VW0,
        PAGE.VW1,
        PAGE.VW2,
    )
    return gbad


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


KLT_COEFFS_PER_STEP = 16  # klt keys: coefficients per step (offline sm_90a compiles, D=128 and 80 at 128 tokens: no
# spills; unrolled steps of 16 or 32 spilled 48-1012 B)
BLOCK_T = 128  # H200, 16k tokens x 8 heads: 547 us at 128 tokens / 8 warps, 761 at 64 / 8, 1152 at 16 / 4 (run 3)
_FITTED_BLOCK_T: dict = {}  # (format, head dim, device) -> the largest tile that fit in shared memory


def default_block_t(head_dim: int) -> int:
    """Tokens per program: shared memory grows with D^2 (the split rotation/sketch matrices); at D=256
    128 tokens need 288 KB (> the H200's 227 KB per block, seen on the GPU), 64 need 176-192 KB."""
    return BLOCK_T if head_dim <= 128 else BLOCK_T // 2 if head_dim <= 256 else BLOCK_T // 4


@dataclass(frozen=True)
class WriteTuning:
    """Launch knobs of ``compress_write``."""

    block_t: int | None = None  # tokens per program; None: by head dim (``default_block_t``), halved while a tile
    # does not fit in shared memory (the size that fit is remembered)
    num_warps: int = 8
    exact_signs: bool = True  # False: the QJL sketch by single fp16 products when indices have <= 2 bits: faster,
    # but ~0.05 % of sign bits (those whose sketch is within rounding of 0) then differ from the fp32 reference —
    # harmless for the estimator, visible as ~1 % output differences against it
    maxnreg: int | None = None  # register cap per thread (128: two 8-warp programs per SM)
    klt_precision: str = "tf32x3"  # klt keys: tl.dot input precision of the encode product on the GPU (3 tensor-core
    # products, ~fp32 accurate; "ieee": fp32 FMAs, whose lowering holds a thread's whole operand rows and columns in
    # registers); the interpreter computes in fp32


DEFAULT_TUNING = WriteTuning()


def _check_inputs(
    k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor, layout: PagedLayout
) -> None:
    """Named errors for K/V, slots or pages that do not fit ``layout``."""
    cuda_or_interpreter(k)
    expect_same_device(k=k, v=v, slots=slots, pages=pages)
    if k.shape != v.shape or k.dim() not in (3, 4) or k.shape[-2] != pages.shape[1] or k.shape[-1] != layout.head_dim:
        raise ShapeError(
            f"k, v: expected [N, {pages.shape[1]}, {layout.head_dim}] or [R, T, {pages.shape[1]}, {layout.head_dim}],"
            f" got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    n = k.shape[0] if k.dim() == 3 else k.shape[0] * k.shape[1]
    if slots.dim() != 1 or slots.shape[0] != n:
        raise ShapeError(f"slots: expected [{n}], got {tuple(slots.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise DTypeError(f"{name}: expected float16, bfloat16 or float32, got {t.dtype}")
    if pages.dtype != torch.uint8 or pages.shape[2] != layout.page_bytes:
        raise ShapeError(
            f"pages: expected uint8 [blocks, H, {layout.page_bytes}], got {pages.dtype} {tuple(pages.shape)}"
        )


def compress_write(
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    pages: torch.Tensor,
    layout: PagedLayout,
    codec: KVCodec,
    *,
    tuning: WriteTuning = DEFAULT_TUNING,
    fault: torch.Tensor | None = None,
    limits: StoreLimits | None = None,
    positions: torch.Tensor | None = None,
) -> None:
    """Encode k, v [N, H, D] (fp16/bf16/fp32) and store them at ``slots`` [N] of ``pages`` (slot < 0 skipped).
    k, v may also be rows [R, T, H, D] of T tokens each (any strides, last dim contiguous; slots [R * T] row by row):
    one launch reads them in place (a cache append of several sequences, ``CompressedKVCache``).

    ``fault`` (int64 [2], with ``limits``): the launch also runs ``validate.check_kv_storable``'s checks and keeps the
    smallest store fault code (``validate.store_fault_code`` is the same in PyTorch) in ``fault[0]`` unless
    ``fault[1]`` is set (the record was closed by a refused commit); nothing syncs with the host.

    Hadamard keys are rotated by one tensor-core product of k in its own dtype with the +-1 matrix sqrt(D) Pi
    (exact products, fp32 sums; the norm from ||M k||^2 = D ||k||^2) and their codes counted against the
    boundaries times sqrt(D) ||k||; other rotations use dense hi+lo split products (~fp32 accurate). Values are
    quantized from the packing's chunk tiles with one reciprocal per group. Codes differ from the reference
    only at ties (H200, run 7: 57.6 us for 16k tokens of mse_k4v3, 33.8 % of copy bandwidth). ``tuning``: launch
    knobs (``WriteTuning``).

    klt keys (``codec.klt``) are coded at ``positions`` (integers, shaped like ``slots``; required): RoPE undone with
    the angle reduced in float64, one fp32-accurate product with the encode matrix, each coefficient's nearest level
    by binary search over its thresholds; their codes differ from the reference only where a coefficient is within
    rounding of a threshold.
    """
    _check_inputs(k, v, slots, pages, layout)
    pos = _klt_positions(codec, positions, slots)
    rows = k.dim() == 4
    n = k.shape[0] * k.shape[1] if rows else k.shape[0]
    if n == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    hkv = pages.shape[1]
    if fault is not None:
        _check_fault_record(fault, k, limits)
    checked = limits if fault is not None else None
    opts = (id(codec), layout.block_size, k.device, k.dtype, v.dtype, hkv, tuning, checked)
    setup = _SETUPS.get(opts)
    if setup is None or setup.codec is not codec:
        setup = _SETUPS[opts] = _setup(codec, layout, k.device, k.dtype, v.dtype, hkv, tuning, checked)
    chosen = tuning.block_t is None
    block_t = tuning.block_t or _FITTED_BLOCK_T.get(setup.fit_key, default_block_t(layout.head_dim))
    args = (
        k,
        v,
        slots,
        pages,
        *setup.consts["write_mats"],
        setup.consts["codebook"],
        setup.consts["bounds"],
        setup.signs,
        *setup.consts["vwrite"],
        setup.consts["vbounds"],
        slots if fault is None else fault,
        pos,
        *setup.klt_args,
        setup.sqrt_d,
        n,
        k.stride(-3),
        k.stride(-2),
        v.stride(-3),
        v.stride(-2),
        layout.page_bytes,
        setup.klt_scale,
        k.shape[1] if rows else n,  # rows: tokens per row and the row strides
        k.stride(0) if rows else 0,
        v.stride(0) if rows else 0,
    )
    while True:
        try:
            grid = (triton.cdiv(n, block_t), hkv)
            maxnreg = tuning.maxnreg
            if maxnreg is None and checked is not None:
                maxnreg = setup.check_register_cap(grid, args, block_t, rows, tuning.num_warps)
            _LAUNCH(
                grid,
                args,
                setup.constexprs(block_t, rows),
                (setup.serial, block_t, rows),
                num_warps=tuning.num_warps,
                maxnreg=maxnreg,
            )
            break
        except OutOfResources:  # raised at compile time, before anything is written
            if block_t <= 16:
                raise
            block_t //= 2
    if chosen:
        _FITTED_BLOCK_T[setup.fit_key] = block_t


_LAUNCH = FastLauncher(_compress_write_kernel)
_SETUPS: dict = {}
_SERIAL = itertools.count()


@dataclass
class _WriteSetup:
    """One write configuration (codec, device, dtypes, heads, knobs): its device constants and compile-time
    bundles, made once (cached by ``compress_write``)."""

    codec: KVCodec
    consts: dict  # ``codec_constants``
    signs: torch.Tensor  # (sqrt(D) Pi)^T in k's dtype (SIGN_MMA > 0), else a placeholder
    sqrt_d: float  # sqrt(D) rounded to fp32, as the reference divides by it
    page: tuple  # the ``PageSpec`` bundle
    cfg: WriteConstexprs  # with the default tile; ``constexprs`` sets BLOCK_T
    fit_key: tuple  # key of the tile size that fit in shared memory
    klt_args: tuple  # klt keys' device constants (meta, enc, mid, mean, turns), placeholders for other keys
    klt_scale: float  # klt keys: RoPE's attention scaling (1.0 otherwise)
    klt_bundle: tuple  # the ``KltSpec`` bundle
    serial: int = field(default_factory=lambda: next(_SERIAL))  # the launch key (an id() could be reused)
    bundles: dict = field(default_factory=dict)  # BLOCK_T -> constexpr kwargs
    caps: dict = field(default_factory=dict)  # (BLOCK_T, rows) -> register cap of the checked kernel

    def constexprs(self, block_t: int, rows: bool, check: bool | None = None) -> dict:
        """The launch's constexpr kwargs (PAGE, CFG) at ``block_t`` tokens per program, for row input or not
        (``check=False``: those of the same write without the store checks)."""
        key = (block_t, rows, check)
        kw = self.bundles.get(key)
        if kw is None:
            cfg = replace(self.cfg, BLOCK_T=block_t, ROWS=rows)
            cfg = cfg if check is None else replace(cfg, CHECK=check)
            kw = self.bundles[key] = dict(PAGE=self.page, CFG=constexpr_bundle(cfg), KLT=self.klt_bundle)
        return kw

    def check_register_cap(self, grid: tuple, args: tuple, block_t: int, rows: bool, num_warps: int) -> int | None:
        """Registers per thread the checked kernel may use and still keep as many programs per SM as the kernel
        without the checks (compiled and loaded once on CUDA to read its count; None elsewhere): the checks add a
        few live values and a rare path, and crossing 128 registers at 8 warps would halve the programs per SM
        (offline sm_90, mse_k4v3: 128 -> 143 uncapped, 128 with the cap and no spills)."""
        key = (block_t, rows)
        if key not in self.caps:
            cap = None
            if not INTERPRET and args[0].is_cuda:
                plain = _LAUNCH.compile(grid, args, self.constexprs(block_t, rows, check=False), num_warps=num_warps)
                plain.run  # noqa: B018  loads the binary: registers per thread are known from then on
                cap = _register_cap(resident_programs(plain, num_warps, args[0].device), num_warps)
            self.caps[key] = cap
        return self.caps[key]


def _register_cap(programs: int, num_warps: int) -> int:
    """The most registers per thread (a multiple of 8, <= 255) at which ``programs`` programs of ``num_warps`` warps
    still fit an SM's register file (the allocation model of ``_launch.resident_programs``)."""
    for regs in range(255, 7, -1):
        if regs % 8 and regs != 255:
            continue
        warp_regs = -(-regs * 32 // 256) * 256
        if 4 * (16384 // warp_regs) // num_warps >= programs:
            return regs
    return 8


def _klt_positions(codec: KVCodec, positions: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    """The positions the kernel reads: klt keys' ``positions`` flattened to one integer per slot (int32 or int64);
    the slots as a placeholder for other keys (not read)."""
    if codec.key_coder is None:
        return slots
    if positions is None:
        raise ShapeError("klt keys are coded at their positions: pass positions (one per slot)")
    expect_same_device(slots=slots, positions=positions)
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise DTypeError(f"positions: expected integers, got {positions.dtype}")
    if positions.numel() != slots.numel():
        raise ShapeError(f"positions: expected {slots.numel()} (one per slot), got {tuple(positions.shape)}")
    pos = positions.reshape(-1)
    return (pos if pos.dtype in (torch.int32, torch.int64) else pos.long()).contiguous()


def _check_fault_record(fault: torch.Tensor, k: torch.Tensor, limits: StoreLimits | None) -> None:
    """Named errors for a fault record the kernel cannot write, or one without bounds."""
    if limits is None:
        raise ArgTypeError("fault: the store checks need their bounds, got limits=None")
    if fault.dtype != torch.int64 or fault.shape != (2,) or fault.device != k.device:
        raise ShapeError(
            f"fault: expected int64 [2] on {k.device}, got {fault.dtype} {tuple(fault.shape)} on {fault.device}"
        )
    if k.shape[-2] > FAULT_MAX_HEADS or k.shape[-1] > FAULT_MAX_COORDS:
        raise ShapeError(
            f"k: the store fault code holds at most {FAULT_MAX_HEADS} KV heads and {FAULT_MAX_COORDS} "
            f"coordinates, got {tuple(k.shape)}"
        )


def _setup(
    codec: KVCodec,
    layout: PagedLayout,
    device: torch.device,
    dtype: torch.dtype,
    v_dtype: torch.dtype,
    hkv: int,
    tuning: WriteTuning,
    limits: StoreLimits | None,
) -> _WriteSetup:
    spec, page = page_spec(layout, codec)
    consts = codec_constants(codec, device)
    # 1: one exact product of k with sqrt(D) Pi; 2: fp32 keys, the unit vector split hi + lo; 0: dense split products
    sign_mode = (1 if dtype != torch.float32 else 2) if hadamard_rotation(spec, codec) else 0
    signs = (
        _sign_matrix_t(codec, device, torch.float16 if dtype == torch.float32 else dtype)
        if sign_mode
        else consts["hsigns"]
    )
    sqrt_d = float(torch.tensor(math.sqrt(layout.head_dim), dtype=torch.float32))  # the reference divides by this
    klt = klt_constants(codec, device)
    if codec.key_coder is not None:
        klt_args = (klt["meta"], klt["enc"], klt["mid"], klt["mean"], klt["turns"])
        klt_steps = int(codec.key_coder.t.bits.max())
    else:  # placeholders of the same dtypes (never read)
        meta, _, _, mean, turns, _ = klt["read"]
        klt_args, klt_steps = (meta, mean, mean, mean, turns), 0
    cfg = WriteConstexprs(
        HKV=hkv,
        KCWP=max(16, next_pow2(spec.KCW)),
        CHP=max(16, next_pow2(spec.CH)),
        VCWP=max(16, next_pow2(spec.VCW)),
        SIGN_MMA=sign_mode,
        SPLIT_SKETCH=tuning.exact_signs or spec.KB > 2,
        SYM_SEARCH=1 <= spec.KB <= 4 and _symmetric(consts["bounds"]),
        V_FP16=v_dtype == torch.float16,
        BLOCK_T=default_block_t(layout.head_dim),
        INTERP=INTERPRET,
        CHECK=limits is not None,
        KLT_STEPS=klt_steps,
        KCBP=max(16, next_pow2(spec.KCB)),
        KLT_CW=min(KLT_COEFFS_PER_STEP, spec.DP),
        KLT_DOT="ieee" if INTERPRET else tuning.klt_precision,
    )
    if limits is not None:
        # |k| per element only where the norm cannot tell: raw keys, or inputs that can exceed the bound (an fp16
        # input is within 65504 whenever it is finite)
        wide = dtype != torch.float16 and limits.k_abs < FP32_MAX
        cfg = replace(
            cfg,
            K_ABS=limits.k_abs,
            K_ELEMS=spec.KEY_MODE in (KEY_RAW, KEY_KLT) or wide,  # klt keys have no norm that tells
            V_ABS=limits.v_abs,
            KEY_NORM=limits.key_norm,
            VALUE_NORM=limits.value_norm,
            VALUE_GROUP=limits.value_group,
        )
    fit_key = (
        layout.fmt,
        layout.head_dim,
        str(device),
        tuning.exact_signs,
        tuning.num_warps,
        sign_mode,
        v_dtype == torch.float16,
        limits is not None,
    )
    klt_scale = klt["scale"] if codec.key_coder is not None else 1.0
    return _WriteSetup(codec, consts, signs, sqrt_d, page, cfg, fit_key, klt_args, klt_scale, klt["bundle"])


def _sign_matrix_t(codec: KVCodec, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(sqrt(D) Pi)^T = (H diag(s))^T of a Hadamard rotation: entries +-1, exact in fp16 and bf16."""
    d = codec.head_dim
    m = (codec.key_rotation.matrix64() * math.sqrt(d)).round()
    if not bool((m.abs() == 1).all()):
        raise AssertionError("a Hadamard rotation times sqrt(D) has +-1 entries")
    return m.T.contiguous().to(device=device, dtype=dtype)


def _symmetric(bounds: torch.Tensor) -> bool:
    """True when the decision boundaries mirror about an exact 0 (every Lloyd-Max and uniform codebook)."""
    b = bounds.cpu()
    return b.numel() % 2 == 1 and bool(b[b.numel() // 2] == 0) and torch.equal(b, -b.flip(0))


def hadamard_rotation(spec: PageSpec, codec: KVCodec) -> bool:
    """True when keys are rotated by a randomized Hadamard matrix (D a power of two whose key chunks are whole
    power-of-two tiles): the sign-matrix product applies; otherwise the kernel rotates with the dense hi+lo
    split products."""
    rot = codec.key_rotation
    return (
        spec.KEY_MODE != KEY_RAW
        and rot is not None
        and rot.kind == "hadamard"
        and spec.D == spec.DP
        and spec.KCW == next_pow2(spec.KCW)
        and spec.KCW >= 16
    )
