"""Compress-on-write, the device side: new K/V tokens -> packed TurboQuant fields, stored straight into their pages.

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

This file holds the kernel and its ``CFG`` contract (``WriteConstexprs``); the encoders are ``compress_encode``,
the host side (knobs, checks, the printable ``WritePlan``, the launch) ``compress_write_plan``.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from ..validate import (
    FP32_MAX,
)
from ._tiles import K_KLT, K_RAW, V_MSE, V_RAW
from .compress_checks import _over, _record_fault
from .compress_encode import (
    _encode_keys,
    _encode_klt_keys,
    _encode_values,
    _quantize_values,
    _token_offsets,
)


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
    # the key path's constants (mse / prod keys): (pi, s, w, cb_ptr, bnd_ptr, mt_ptr); pi: rotation Pi as fp16 [D, D]
    # (hi, lo) pointers (hi + lo = Pi to ~22 bits; dense rotation), s: QJL sketch S likewise, w: W = S Pi^T likewise
    # (the sketch of the centroids), cb_ptr: fp32 key codebook, bnd_ptr: its decision boundaries, mt_ptr: (sqrt(D)
    # Pi)^T in k's dtype, entries +-1 (SIGN_MMA > 0)
    keys,
    values,  # mse values: (the value rotation Pi_v as fp16 (hi, lo) pointers, fp32 decision boundaries of its codebook)
    fault_ptr,  # int64 [2]: the first store fault (``validate.FAULT_NONE``: none), then 1 once closed (CHECK)
    pos_ptr,  # int [N]: each token's position in its sequence (klt keys; else a placeholder)
    # klt keys (``_common.klt_constants``; placeholders otherwise): (meta: int32 [HKV, 2, DP] code bit offsets and
    # widths, enc: fp32 [HKV, DP, DP] encode matrix transposed (row = channel, column = coefficient), mid: fp32
    # [HKV, D, 255] decision thresholds between used levels (+inf past them), mean: fp32 [HKV, DP], turns: fp64 [RHP]
    # RoPE frequencies in turns per position)
    klt,
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
            klt,
            klt_scale,
            PAGE,
            CFG,
            KLT,
        )
        nrm = tl.zeros([CFG.BLOCK_T], tl.float32)  # no norm stored (K_ELEMS checks the elements)
    else:
        nrm = _encode_keys(kin, page, off, valid, d, keys, sqrt_d, PAGE, CFG)
        if CFG.CHECK:  # a non-finite key has a non-finite norm
            bad = bad | ~(nrm <= CFG.KEY_NORM)
    voff = _token_offsets(t, t64, row_tokens, stride_vb, stride_vt, CFG.ROWS)
    # the values' (pointer, token offsets, head stride): helpers form head h's rows where they read them (row pointers
    # formed once up front stayed live into the checks and moved the checked kernel's registers, offline sm_90)
    vsrc = (v_ptr, voff, stride_vh)
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
        vnrm = _encode_values(v, page, off, valid, d, values, PAGE, CFG)
        gbad = tl.zeros([CFG.BLOCK_T], tl.int32)
        if CFG.CHECK:  # bit 2: the value norm past its bound (a non-finite value has a non-finite norm)
            gbad = tl.where(~(vnrm <= CFG.VALUE_NORM), 4, 0)
            bad = bad | _over(v, dmask, CFG.V_ABS) | (gbad != 0)
    else:
        gbad = _quantize_values(vsrc, h, valid, page, off, PAGE, CFG)
        bad = bad | (gbad != 0)
    if CFG.CHECK:
        if tl.max((valid & bad).to(tl.int32), 0) != 0:  # rare: the exact fault code, from a second load of the tiles
            _record_fault((k_ptr, koff, stride_kh), vsrc, fault_ptr, nrm, gbad, slot, valid, h, PAGE, CFG)
