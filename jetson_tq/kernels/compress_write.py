"""Compress-on-write: new K/V tokens -> packed TurboQuant fields, stored straight into their pages.

One launch does everything ``KVCodec.encode`` + ``paged.write_slots`` do: per token and KV
head it normalizes the key, rotates it (tensor cores: one exact product with the +-1 matrix of a Hadamard
rotation, else fp16 hi+lo split products, ~fp32 accurate), picks
the codebook indices, takes the QJL signs of the residual's sketch ``S r = S u - (S Pi^T) c`` (the
combined matrices, so the residual is never formed), packs
indices and signs in the planar layout, quantizes the value per group (min/max, fp16 scale and
zero, one reciprocal per group, round-half-even), and writes every field at ``slot = block * block_size + offset`` (vLLM's
``slot_mapping``; slots < 0 are skipped). Each program handles BLOCK_T tokens of one KV head.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ..codec.kv import KVCodec
from ..errors import DTypeError, ShapeError, expect_same_device
from ..format import PagedLayout
from ._launch import FastLauncher
from ._common import INTERPRET, KEY_RAW, PageSpec, codec_constants, cuda_or_interpreter, next_pow2
from ._tiles import K_MSE, K_PROD, K_RAW, V_RAW, mma

TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny, the reference norm clamp
ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: x + it (0 <= x < 2^22) holds round-half-even(x) in its low bits


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
def _store_run(codes, ptrs, mask, RUN_OFF: tl.constexpr, LOW: tl.constexpr, W: tl.constexpr,
               CH: tl.constexpr, CW: tl.constexpr, NCH: tl.constexpr):
    """Store one planar run (bits [LOW, LOW+W) of every code) at byte offset RUN_OFF of the field."""
    WMIN: tl.constexpr = CW // CH
    for k in tl.static_range(W // WMIN):  # piece k of the run = bytes [k*CW, (k+1)*CW)
        byte = tl.zeros(codes[0].shape, tl.int32)
        for c in tl.static_range(NCH):
            if (c * WMIN) % W == k * WMIN:
                byte |= ((codes[c] >> LOW) & ((1 << W) - 1)) << (((c * WMIN) // W) * W)
        tl.store(ptrs + RUN_OFF + k * CW, byte.to(tl.uint8), mask=mask)


@triton.jit
def _store_packed(codes, ptrs, mask, CH: tl.constexpr, CW: tl.constexpr, NCH: tl.constexpr,
                  W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr):
    """Pack per-chunk codes (a tuple of NCH [T, CWP] int32 tiles) into planar runs and store them."""
    if W0 > 0:
        _store_run(codes, ptrs, mask, 0, 0, W0, CH, CW, NCH)
    if W1 > 0:
        _store_run(codes, ptrs, mask, CH * W0, W0, W1, CH, CW, NCH)
    if W2 > 0:
        _store_run(codes, ptrs, mask, CH * (W0 + W1), W0 + W1, W2, CH, CW, NCH)


@triton.jit
def _compress_write_kernel(
        k_ptr, v_ptr, slot_ptr, pages_ptr, pi_hi_ptr, pi_lo_ptr, s_hi_ptr, s_lo_ptr, w_hi_ptr, w_lo_ptr,
        cb_ptr, bnd_ptr, mt_ptr, sqrt_d,
        n_tokens, stride_kt, stride_kh, stride_vt, stride_vh, page_bytes,
        HKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, CH: tl.constexpr, BS: tl.constexpr, PB: tl.constexpr,
        KEY_MODE: tl.constexpr, KB: tl.constexpr, KW0: tl.constexpr, KW1: tl.constexpr, KW2: tl.constexpr,
        KCW: tl.constexpr, KCH: tl.constexpr, OFF_KIDX: tl.constexpr, OFF_KSGN: tl.constexpr,
        OFF_KNORM: tl.constexpr, OFF_KRNORM: tl.constexpr, OFF_KRAW: tl.constexpr, NORM_F32: tl.constexpr,
        VAL_MODE: tl.constexpr, VB: tl.constexpr, VW0: tl.constexpr, VW1: tl.constexpr, VW2: tl.constexpr,
        VCW: tl.constexpr, VCH: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
        OFF_VCODES: tl.constexpr, OFF_VSCALE: tl.constexpr, OFF_VZERO: tl.constexpr, OFF_VRAW: tl.constexpr,
        RAW_BF16: tl.constexpr,
        KCWP: tl.constexpr, CHP: tl.constexpr, VCWP: tl.constexpr,
        SPLIT_SKETCH: tl.constexpr, SIGN_MMA: tl.constexpr,
        SYM_SEARCH: tl.constexpr, V_FP16: tl.constexpr, BLOCK_T: tl.constexpr, INTERP: tl.constexpr):
    pid_t, h = tl.program_id(0), tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + t, mask=t < n_tokens, other=-1).to(tl.int64)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    page = pages_ptr + ((slot // BS) * (HKV * page_bytes) + h.to(tl.int64) * page_bytes)  # [T] byte pointers
    off = slot % BS
    d = tl.arange(0, DP)
    dmask = valid[:, None] & (d[None, :] < D)
    t64 = t.to(tl.int64)
    RAW_T: tl.constexpr = tl.bfloat16 if RAW_BF16 else tl.float16
    NORM_T: tl.constexpr = tl.float32 if NORM_F32 else tl.float16
    NB: tl.constexpr = 4 if NORM_F32 else 2
    KFULL: tl.constexpr = KCW == KCWP and KCH * KCW == D  # every key chunk column is a coordinate (no padding)

    # ---------------------------------------------------------------- keys
    kin = tl.load(k_ptr + t64[:, None] * stride_kt + h * stride_kh + d[None, :], mask=dmask, other=0.0)
    kc = tl.arange(0, KCWP)
    if KEY_MODE == K_RAW:
        tl.store((page + OFF_KRAW + off * (2 * D))[:, None].to(tl.pointer_type(RAW_T)) + d[None, :],
                 kin.to(tl.float32).to(RAW_T), mask=dmask)
    else:
        if SIGN_MMA == 1 and KEY_MODE == K_MSE:
            # every chunk's k . M_i first: ||M k||^2 = D ||k||^2 gives the norm with no fp32 copy of k
            accs = ()
            for c in tl.static_range(KCH):
                row = c * KCW + kc
                m = tl.load(mt_ptr + d[:, None] * D + row[None, :], mask=(kc[None, :] < KCW) & (row[None, :] < D),
                            other=0.0)
                accs = accs + (mma(kin, m, tl.zeros([BLOCK_T, KCWP], tl.float32), INTERP),)
            sq = tl.sum(accs[0] * accs[0], 1)
            for c in tl.static_range(1, KCH):
                sq += tl.sum(accs[c] * accs[c], 1)
            nrm = tl.sqrt_rn(sq * (1.0 / D))
        else:
            k = kin.to(tl.float32)
            nrm = tl.sqrt_rn(tl.sum(k * k, 1))
        if SIGN_MMA != 1 or KEY_MODE == K_PROD:
            unit = k / tl.maximum(nrm, TINY)[:, None]
            u_hi = unit.to(tl.float16)
            u_lo = (unit - u_hi.to(tl.float32)).to(tl.float16)
            # ||r||^2 = ||unit||^2 - 2 <Pi unit, c> + ||c||^2 (Pi orthogonal): no residual tile is ever formed
            r2 = tl.sum(unit * unit, 1)
        if SIGN_MMA == 1:
            rs = nrm * sqrt_d  # (k . M_i) / rs = (Pi u)_i, M = sqrt(D) Pi = H diag(s) (entries +-1, exact in k's dtype)
        elif SIGN_MMA == 2:
            rs = tl.zeros_like(nrm) + sqrt_d  # fp32 input: the unit vector split hi + lo, each product exact
        codes = ()
        cents = ()
        cents_lo = ()
        kbyte = tl.zeros([BLOCK_T, KCWP], tl.int32)
        for c in tl.static_range(KCH):
            row = c * KCW + kc  # rows of Pi that give this chunk's rotated coordinates (planar chunk c)
            inside = (kc[None, :] < KCW) & (row[None, :] < D)
            if SIGN_MMA > 0:
                if SIGN_MMA == 1 and KEY_MODE == K_MSE:
                    acc = accs[c]
                else:
                    m = tl.load(mt_ptr + d[:, None] * D + row[None, :], mask=(kc[None, :] < KCW) & (row[None, :] < D),
                                other=0.0)
                if SIGN_MMA == 1 and KEY_MODE == K_PROD:
                    acc = mma(kin, m, tl.zeros([BLOCK_T, KCWP], tl.float32), INTERP)
                elif SIGN_MMA == 2:
                    acc = mma(u_lo, m, mma(u_hi, m, tl.zeros([BLOCK_T, KCWP], tl.float32), INTERP), INTERP)
                if SYM_SEARCH:
                    code = _search_symmetric(acc, rs, bnd_ptr, KB)
                else:
                    code = _bucketize(acc * (1.0 / tl.maximum(rs, TINY))[:, None], bnd_ptr, KB)
                if KEY_MODE == K_PROD:
                    y = acc * (1.0 / tl.maximum(rs, TINY))[:, None]
            else:
                y = _dot3(u_hi, u_lo, pi_hi_ptr, pi_lo_ptr, row, d,
                          (kc[None, :] < KCW) & (row[None, :] < D) & (d[:, None] < D), D,
                          tl.zeros([BLOCK_T, KCWP], tl.float32), INTERP)
                code = _bucketize(y, bnd_ptr, KB)
            if not KFULL:
                code = tl.where(inside, code, 0)  # padding coordinates pack as 0
            if KW1 == 0:
                kbyte |= code << (c * KW0)
            else:
                codes = codes + (code,)
            if KEY_MODE == K_PROD:
                cent = tl.where(inside, tl.load(cb_ptr + code), 0.0)
                r2 += tl.sum(cent * (cent - 2.0 * y), 1)
                c_hi = cent.to(tl.float16)
                cents = cents + (c_hi,)
                if SPLIT_SKETCH:
                    cents_lo = cents_lo + ((cent - c_hi.to(tl.float32)).to(tl.float16),)
        kptrs = (page + OFF_KIDX + off * (CH * KB))[:, None] + kc[None, :]
        if KB > 0:
            if KW1 == 0:
                tl.store(kptrs, kbyte.to(tl.uint8), mask=valid[:, None] & (kc[None, :] < KCW))
            else:
                _store_packed(codes, kptrs, valid[:, None] & (kc[None, :] < KCW), CH, KCW, KCH, KW0, KW1, KW2)
        tl.store((page + OFF_KNORM + off * NB).to(tl.pointer_type(NORM_T)), nrm.to(NORM_T), mask=valid)
        if KEY_MODE == K_PROD:
            # sketch chunk c of S r = S unit - (S Pi^T) c, for the 8 one-bit planes of the signs
            sc = tl.arange(0, CHP)
            sbyte = tl.zeros([BLOCK_T, CHP], tl.int32)
            for c in tl.static_range(8):
                row = c * CH + sc
                # exact (default): hi+lo split products, ~22 bits, so a sign differs from the fp32 reference
                # only where (S r)_i is within ~1e-6 of 0. Fast (KB <= 2 only): one fp16 product per term.
                smask = (sc[None, :] < CH) & (row[None, :] < D) & (d[:, None] < D)
                if SPLIT_SKETCH:
                    sk = _dot3(u_hi, u_lo, s_hi_ptr, s_lo_ptr, row, d, smask, D,
                               tl.zeros([BLOCK_T, CHP], tl.float32), INTERP)
                else:
                    s_hi = tl.load(s_hi_ptr + row[None, :] * D + d[:, None], mask=smask, other=0.0)
                    sk = mma(u_hi, s_hi, tl.zeros([BLOCK_T, CHP], tl.float32), INTERP)
                for c2 in tl.static_range(KCH):
                    kr = c2 * KCW + kc  # W^T block: rows = chunk c2 coordinates, cols = sketch rows of chunk c
                    wmask = (kc[:, None] < KCW) & (kr[:, None] < D) & (sc[None, :] < CH) & (row[None, :] < D)
                    w_off = row[None, :] * D + kr[:, None]
                    w_hi = tl.load(w_hi_ptr + w_off, mask=wmask, other=0.0)
                    sk = mma(cents[c2], -w_hi, sk, INTERP)
                    if SPLIT_SKETCH:
                        w_lo = tl.load(w_lo_ptr + w_off, mask=wmask, other=0.0)
                        sk = mma(cents[c2], -w_lo, sk, INTERP)
                        sk = mma(cents_lo[c2], -w_hi, sk, INTERP)
                sbyte |= ((sk >= 0) & (row[None, :] < D)).to(tl.int32) << c
            tl.store((page + OFF_KSGN + off * CH)[:, None] + sc[None, :], sbyte.to(tl.uint8),
                     mask=valid[:, None] & (sc[None, :] < CH))
            rn = nrm * tl.sqrt_rn(tl.maximum(r2, 0.0))
            tl.store((page + OFF_KRNORM + off * NB).to(tl.pointer_type(NORM_T)), rn.to(NORM_T), mask=valid)

    # ---------------------------------------------------------------- values
    if VAL_MODE == V_RAW:
        v = tl.load(v_ptr + t64[:, None] * stride_vt + h * stride_vh + d[None, :], mask=dmask, other=0.0)
        tl.store((page + OFF_VRAW + off * (2 * D))[:, None].to(tl.pointer_type(RAW_T)) + d[None, :],
                 v.to(tl.float32).to(RAW_T), mask=dmask)
    else:
        _quantize_values(v_ptr, t64, h, stride_vt, stride_vh, valid, page, off, D, CH, VB, VW0, VW1, VW2, VCW, VCH,
                     GROUP, NG, OFF_VCODES, OFF_VSCALE, OFF_VZERO, VCWP, V_FP16, BLOCK_T)


@triton.jit
def _quantize_values(v_ptr, t64, h, stride_vt, stride_vh, valid, page, off, D: tl.constexpr, CH: tl.constexpr,
                 VB: tl.constexpr, VW0: tl.constexpr, VW1: tl.constexpr, VW2: tl.constexpr, VCW: tl.constexpr,
                 VCH: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, OFF_VCODES: tl.constexpr,
                 OFF_VSCALE: tl.constexpr, OFF_VZERO: tl.constexpr, VCWP: tl.constexpr, V_FP16: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    """Group-quantize and store values from the packing's chunk tiles [BLOCK_T, VCWP] (loaded once, no re-layout):
    min/max across whole chunks, one reciprocal per row and group instead of a division per element, and
    round-half-even by adding 1.5 * 2^23 (codes differ from the reference only at ties)."""
    LEVELS: tl.constexpr = (1 << VB) - 1
    vc = tl.arange(0, VCWP)
    vt = ()
    for c in tl.static_range(VCH):
        col = c * VCW + vc
        vt = vt + (tl.load(v_ptr + t64[:, None] * stride_vt + h * stride_vh + col[None, :],
                           mask=valid[:, None] & (vc[None, :] < VCW) & (col[None, :] < D), other=0.0).to(tl.float32),)
    inv = ()
    zinv = ()
    srow = (page + OFF_VSCALE + off * (2 * NG)).to(tl.pointer_type(tl.float16))
    zrow = (page + OFF_VZERO + off * (2 * NG)).to(tl.pointer_type(tl.float16))
    for gi in tl.static_range(NG):
        lo2 = tl.full([BLOCK_T, VCWP], float("inf"), tl.float32)
        hi2 = tl.full([BLOCK_T, VCWP], float("-inf"), tl.float32)
        for c in tl.static_range(VCH):
            if _whole_chunk(c, gi, VCW, VCWP, GROUP, D):
                lo2 = tl.minimum(lo2, vt[c])
                hi2 = tl.maximum(hi2, vt[c])
            elif _overlaps(c, gi, VCW, GROUP):
                col = c * VCW + vc
                ing = ((col // GROUP == gi) & (vc < VCW) & (col < D))[None, :]
                lo2 = tl.minimum(lo2, tl.where(ing, vt[c], float("inf")))
                hi2 = tl.maximum(hi2, tl.where(ing, vt[c], float("-inf")))
        zero = tl.min(lo2, 1).to(tl.float16)
        scale = tl.math.div_rn(tl.max(hi2, 1) - zero.to(tl.float32), tl.zeros([BLOCK_T], tl.float32) + LEVELS)
        scale = scale.to(tl.float16)
        tl.store(srow + gi, scale, mask=valid)
        tl.store(zrow + gi, zero, mask=valid)
        r = 1.0 / tl.where(scale > 0, scale.to(tl.float32), 1.0)  # the reference divides by the scale (1 if 0)
        inv = inv + (r,)
        zinv = zinv + (zero.to(tl.float32) * r,)
    vcodes = ()
    for c in tl.static_range(VCH):
        col = c * VCW + vc
        if _whole_chunk(c, (c * VCW) // GROUP, VCW, VCWP, GROUP, D):
            pos = vt[c] * inv[(c * VCW) // GROUP][:, None] - zinv[(c * VCW) // GROUP][:, None]
        else:
            cg = (col // GROUP)[None, :]
            r2d = tl.zeros([BLOCK_T, VCWP], tl.float32)
            z2d = tl.zeros([BLOCK_T, VCWP], tl.float32)
            for gi in tl.static_range(NG):
                r2d = tl.where(cg == gi, inv[gi][:, None], r2d)
                z2d = tl.where(cg == gi, zinv[gi][:, None], z2d)
            pos = vt[c] * r2d - z2d
        if not V_FP16:  # fp16 values: zero is their exact minimum, so v - zero >= 0 (no lower clamp)
            pos = tl.maximum(pos, 0.0)
        pos = tl.minimum(pos, LEVELS)
        q = (pos + ROUND_MAGIC).to(tl.int32, bitcast=True) & LEVELS  # + 1.5 * 2^23 rounds half to even
        vcodes = vcodes + (tl.where(((vc < VCW) & (col < D))[None, :], q, 0),)
    _store_packed(vcodes, (page + OFF_VCODES + off * (CH * VB))[:, None] + vc[None, :],
                  valid[:, None] & (vc[None, :] < VCW), CH, VCW, VCH, VW0, VW1, VW2)


BLOCK_T = 128  # H200, 16k tokens x 8 heads: 547 us at 128 tokens / 8 warps, 761 at 64 / 8, 1152 at 16 / 4 (run 3)
_FITTED_BLOCK_T: dict = {}  # (format, head dim, device) -> the largest tile that fit in shared memory


def default_block_t(head_dim: int) -> int:
    """Tokens per program: shared memory grows with D^2 (the split rotation/sketch matrices); at D=256
    128 tokens need 288 KB (> the H200's 227 KB per block, seen on the GPU), 64 need 176-192 KB."""
    return BLOCK_T if head_dim <= 128 else BLOCK_T // 2 if head_dim <= 256 else BLOCK_T // 4


def compress_write(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor,
                   layout: PagedLayout, codec: KVCodec, *, block_t: int | None = None, num_warps: int = 8,
                   exact_signs: bool = True, maxnreg: int | None = None) -> None:
    """Encode k, v [N, H, D] (fp16/bf16/fp32) and store them at ``slots`` [N] of ``pages`` (slot < 0 skipped).

    ``exact_signs=False`` forms the QJL sketch with single fp16 products when indices have <= 2 bits:
    faster, but ~0.05 % of sign bits (those whose sketch is within rounding of 0) then differ from the
    fp32 reference — harmless for the estimator, visible as ~1 % output differences against it.
    ``block_t`` (tokens per program) defaults by head dim and halves if a tile does not fit in shared memory;
    ``maxnreg`` caps the registers per thread (128: two 8-warp programs per SM).
    Hadamard keys are rotated by one tensor-core product of k in its own dtype with the +-1 matrix sqrt(D) Pi
    (exact products, fp32 sums; the norm from ||M k||^2 = D ||k||^2) and their codes counted against the
    boundaries times sqrt(D) ||k||; other rotations use dense hi+lo split products (~fp32 accurate). Values are
    quantized from the packing's chunk tiles with one reciprocal per group. Codes differ from the reference
    only at ties (H200, run 7: 57.6 us for 16k tokens of mse_k4v3, 33.8 % of copy bandwidth).
    """
    cuda_or_interpreter(k)
    expect_same_device(k=k, v=v, slots=slots, pages=pages)
    if k.shape != v.shape or k.dim() != 3 or k.shape[1] != pages.shape[1] or k.shape[2] != layout.head_dim:
        raise ShapeError(f"k, v: expected [N, {pages.shape[1]}, {layout.head_dim}], got {tuple(k.shape)} and {tuple(v.shape)}")
    if slots.dim() != 1 or slots.shape[0] != k.shape[0]:
        raise ShapeError(f"slots: expected [{k.shape[0]}], got {tuple(slots.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise DTypeError(f"{name}: expected float16, bfloat16 or float32, got {t.dtype}")
    if pages.dtype != torch.uint8 or pages.shape[2] != layout.page_bytes:
        raise ShapeError(f"pages: expected uint8 [blocks, H, {layout.page_bytes}], got {pages.dtype} {tuple(pages.shape)}")
    n = k.shape[0]
    if n == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    opts = (id(codec), layout.block_size, k.device, k.dtype, v.dtype, exact_signs, num_warps, maxnreg)
    setup = _SETUPS.get(opts)
    if setup is None or setup[0] is not codec:
        setup = _SETUPS[opts] = _setup(codec, layout, k.device, k.dtype, v.dtype, exact_signs, num_warps)
    _, consts, signs, kw, sqrt_d, key = setup
    chosen = block_t is None
    block_t = block_t or _FITTED_BLOCK_T.get(key, default_block_t(layout.head_dim))
    while True:
        try:
            _LAUNCH((triton.cdiv(n, block_t), pages.shape[1]),
                    (k, v, slots, pages, *consts["write_mats"], consts["codebook"], consts["bounds"], signs, sqrt_d, n, k.stride(0), k.stride(1), v.stride(0), v.stride(1), layout.page_bytes),
                    {**kw, "HKV": pages.shape[1], "BLOCK_T": block_t}, key + (pages.shape[1], block_t),
                    num_warps=num_warps, maxnreg=maxnreg)
            break
        except OutOfResources:  # raised at compile time, before anything is written
            if block_t <= 16:
                raise
            block_t //= 2
    if chosen:
        _FITTED_BLOCK_T[key] = block_t


_LAUNCH = FastLauncher(_compress_write_kernel)
_SETUPS: dict = {}


def _setup(codec: KVCodec, layout: PagedLayout, device: torch.device, dtype: torch.dtype, v_dtype: torch.dtype,
           exact_signs: bool, num_warps: int) -> tuple:
    """(codec, device constants, sign matrix, constexprs, sqrt(D) as fp32, fitted-tile key) of one write
    configuration (cached by the caller)."""
    spec = PageSpec.of(layout, codec.raw_dtype)
    consts = codec_constants(codec, device)
    # 1: one exact product of k with sqrt(D) Pi; 2: fp32 keys, the unit vector split hi + lo; 0: dense split products
    sign_mode = (1 if dtype != torch.float32 else 2) if hadamard_rotation(spec, codec) else 0
    signs = _sign_matrix_t(codec, device, torch.float16 if dtype == torch.float32 else dtype) if sign_mode else \
        consts["hsigns"]
    sqrt_d = float(torch.tensor(math.sqrt(layout.head_dim), dtype=torch.float32))  # the reference divides by this
    kw = spec.constexprs()
    kw.update(KCWP=max(16, next_pow2(spec.KCW)), CHP=max(16, next_pow2(spec.CH)), VCWP=max(16, next_pow2(spec.VCW)),
              SPLIT_SKETCH=exact_signs or spec.KB > 2,
              SIGN_MMA=sign_mode, SYM_SEARCH=1 <= spec.KB <= 4 and _symmetric(consts["bounds"]),
              V_FP16=v_dtype == torch.float16, INTERP=INTERPRET)
    key = (layout.fmt, layout.head_dim, str(device), exact_signs, num_warps, sign_mode, v_dtype == torch.float16)
    return codec, consts, signs, kw, sqrt_d, key


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
    return (spec.KEY_MODE != KEY_RAW and rot is not None and rot.kind == "hadamard" and spec.D == spec.DP
            and spec.KCW == next_pow2(spec.KCW) and spec.KCW >= 16)
