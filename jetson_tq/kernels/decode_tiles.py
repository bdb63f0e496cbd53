"""Fused hybrid decode, the compressed tokens' steps (``@triton.jit`` helpers of ``hybrid_decode``'s kernel).

Per program, once: the query rotation inside the launch (``_rotate_query``, FUSE_Q), the transformed query as
tensor-core operands (``_key_operands``, ``_sign_operands``) and the online softmax's empty state (``_empty_state``);
per tile of BLOCK_N compressed tokens: their pages through the block table (``_tile_pages``), their scores
(``_key_scores``) and their values into the accumulators (``_value_tile``, ``_mse_value_tile``); after the tile
loop, mse values' sums turned back from the rotated domain once (``_unrotate_values``). The klt keys' steps are
``decode_klt``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._tiles import (
    K_PROD,
    K_RAW,
    TWO24,
    V_MSE,
    V_RAW,
    centroid_lookup,
    chunk_codes,
    folded_value_tile,
    fwht_rows,
    load_norms,
    mma,
    nibble_centroids,
    subnormal16,
)
from .decode_exact import _row_offsets


@triton.jit
def _rotate_query(
    q_ptr, hs_ptr, qt_ptr, b, h, g, gmask, qrow, stride_qb, stride_qh, qt_scale, PAGE: tl.constexpr, CFG: tl.constexpr
):
    """The query transform inside the launch (randomized Hadamard rotation, mse keys): every split of this
    (sequence, KV head) writes the same Pi q * scale rows, which ``_query_operands`` reads back chunk by chunk."""
    dq = tl.arange(0, PAGE.DP)
    if CFG.NEW:
        qoff = _row_offsets(b, h, g, stride_qb, stride_qh, CFG)
        q0 = tl.load(q_ptr + qoff[:, None] + dq[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    else:
        q0 = tl.load(
            q_ptr + b.to(tl.int64) * stride_qb + (h * CFG.G + g)[:, None].to(tl.int64) * stride_qh + dq[None, :],
            mask=gmask[:, None],
            other=0.0,
        ).to(tl.float32)
    qr = fwht_rows(q0 * tl.load(hs_ptr + dq)[None, :], CFG.GP, PAGE.DP, CFG.LOG2D) * qt_scale
    tl.store(qt_ptr + qrow[:, None] * CFG.QW + dq[None, :], qr, mask=gmask[:, None])
    tl.debug_barrier()


@triton.jit
def _key_operands(qt_ptr, qrow, gmask, kc, k_alpha, k_beta, k_gamma, PAGE: tl.constexpr, CFG: tl.constexpr):
    """The transformed query Pi q as B operands [key chunk, GP] in fp16 (raw keys: their dtype), one per chunk:
    (operands, (k >> 1)-plane operands (K_HIGH), alpha sum(q) (FAST_K)).

    Fast path (affine codebooks: c[k] = alpha + beta k (+ gamma (k >> 1) for 2-bit Lloyd-Max)):
    <q, c[idx]> = alpha sum(q) + beta <q, k> (+ gamma <q, k >> 1>) with k read as an fp16 subnormal plane
    (bits * 2^(KB c) * 2^-24); the 2^-(KB c) goes into the query operand."""
    RAW_T: tl.constexpr = tl.bfloat16 if PAGE.RAW_BF16 else tl.float16
    KDOT_T: tl.constexpr = RAW_T if PAGE.KEY_MODE == K_RAW else tl.float16
    kadd = tl.zeros([CFG.GP], tl.float32)
    qk = ()
    qh = ()
    for c in tl.static_range(PAGE.KCH):
        kcol = c * PAGE.KCW + kc
        qc = tl.load(
            qt_ptr + qrow[None, :] * CFG.QW + kcol[:, None],
            mask=gmask[None, :] & (kc[:, None] < PAGE.KCW) & (kcol[:, None] < PAGE.D),
            other=0.0,
        )
        if CFG.FAST_K:
            kadd += k_alpha * tl.sum(qc, 0)
            qk = qk + ((qc * (k_beta / (1 << (PAGE.KB * c)))).to(tl.float16),)
            if CFG.K_HIGH:
                qh = qh + ((qc * (k_gamma / (2 << (2 * c)))).to(tl.float16),)
        else:
            qk = qk + (qc.to(KDOT_T),)
    return qk, qh, kadd


@triton.jit
def _sign_operands(qt_ptr, qrow, gmask, sc, PAGE: tl.constexpr, CFG: tl.constexpr):
    """Prod keys: the sketch S q as fp16 B operands [CH, GP], one per sign bit plane (times 2 / 2^plane), and
    sum(S q): <q, sign> = 2 <q, bit> - sum(q). Other keys: empty."""
    qs = ()
    ssub = tl.zeros([CFG.GP], tl.float32)
    if PAGE.KEY_MODE == K_PROD:
        for c in tl.static_range(8):
            scol = c * PAGE.CH + sc
            qsc = tl.load(
                qt_ptr + qrow[None, :] * CFG.QW + PAGE.D + scol[:, None],
                mask=gmask[None, :] & (sc[:, None] < PAGE.CH) & (scol[:, None] < PAGE.D),
                other=0.0,
            )
            qsa = (qsc * (2.0 / (1 << c))).to(tl.float16)
            ssub += tl.sum(qsc, 0)
            qs = qs + (qsa,)
    return qs, ssub


@triton.jit
def _empty_state(PAGE: tl.constexpr, CFG: tl.constexpr):
    """The online softmax's start: (zero-point sums [NGP, GP] of the FAST_V path, one value accumulator [VSUBP, GP]
    per value sub-chunk, running max [GP], running sum tile [BLOCK_N, GP])."""
    zacc = tl.zeros([CFG.NGP, CFG.GP], tl.float32)  # fast path: sum_n p * zero[n, group]
    acc = ()
    for _ in tl.static_range(PAGE.VCH * CFG.VSC):
        acc = acc + (tl.zeros([CFG.VSUBP, CFG.GP], tl.float32),)
    m_i = tl.full([CFG.GP], float("-inf"), tl.float32)
    l_t = tl.zeros([CFG.BLOCK_N, CFG.GP], tl.float32)
    return zacc, acc, m_i, l_t


@triton.jit
def _tile_pages(pages_ptr, bt_ptr, b, n0, end, head_off, stride_bt, page_bytes, PAGE: tl.constexpr, CFG: tl.constexpr):
    """(page base pointers, token offsets in their pages, valid-token mask) of compressed tokens
    [n0, n0 + BLOCK_N) of sequence ``b`` (KV head at ``head_off``) through the block table."""
    n = n0 + tl.arange(0, CFG.BLOCK_N)
    nmask = n < end
    if PAGE.BS % CFG.BLOCK_N == 0:  # the tile lies in one page (n0 is a BLOCK_N multiple): one block id, one pointer
        blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + n0 // PAGE.BS)
        page = pages_ptr + (blk.to(tl.int64) * (CFG.HKV * page_bytes) + head_off)
        off = n0 % PAGE.BS + tl.arange(0, CFG.BLOCK_N)
    elif CFG.BLOCK_N == 2 * PAGE.BS:  # two pages: two block ids, the base pointer picked per token
        b0 = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + n0 // PAGE.BS)
        b1 = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + n0 // PAGE.BS + 1, mask=n0 + PAGE.BS < end, other=0)
        blk = tl.where(tl.arange(0, CFG.BLOCK_N) < PAGE.BS, b0, b1)
        page = pages_ptr + (blk.to(tl.int64) * (CFG.HKV * page_bytes) + head_off)
        off = tl.arange(0, CFG.BLOCK_N) % PAGE.BS
    else:
        blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + n // PAGE.BS, mask=nmask, other=0)
        page = pages_ptr + (blk.to(tl.int64) * (CFG.HKV * page_bytes) + head_off)  # [N] byte pointers
        off = n % PAGE.BS
    return page, off, nmask


@triton.jit
def _key_scores(
    page, off, nmask, kc, sc, qk, qh, kadd, qs, ssub, cb_ptr, qjl_scale, PAGE: tl.constexpr, CFG: tl.constexpr
):
    """Log2-domain scores [BLOCK_N, GP] of one tile's keys against the query operands: ||k|| <Pi q, c[idx]>
    (+ qjl ||r|| <S q, signs> for prod keys), or <q, k> for raw keys."""
    RAW_T: tl.constexpr = tl.bfloat16 if PAGE.RAW_BF16 else tl.float16
    if PAGE.KEY_MODE == K_RAW:
        kraw = tl.load(
            (page + PAGE.OFF_KRAW + off * (2 * PAGE.D))[:, None].to(tl.pointer_type(RAW_T)) + kc[None, :],
            mask=nmask[:, None] & (kc[None, :] < PAGE.D),
            other=0.0,
        )
        s = mma(kraw, qk[0], tl.zeros([CFG.BLOCK_N, CFG.GP], tl.float32), CFG.INTERP)
    else:
        kptr = (page + PAGE.OFF_KIDX + off * (PAGE.CH * PAGE.KB))[:, None] + kc[None, :]
        kmask = nmask[:, None] & (kc[None, :] < PAGE.KCW)
        if PAGE.KW1 == 0:
            xk = tl.load(kptr, mask=kmask, other=0)
        s = tl.zeros([CFG.BLOCK_N, CFG.GP], tl.float32)
        if CFG.LUT_PRMT:  # 4-bit codes, two per byte: both chunks' centroids from one byte-permute lookup
            c_lo, c_hi = nibble_centroids(xk, CFG.KLUT)
            s = mma(c_hi, qk[1], mma(c_lo, qk[0], s, CFG.INTERP), CFG.INTERP)
        for c in tl.static_range(0 if CFG.LUT_PRMT else PAGE.KCH):
            if CFG.FAST_K:
                s = mma(subnormal16(xk & (((1 << PAGE.KB) - 1) << (PAGE.KB * c))), qk[c], s, CFG.INTERP)
                if CFG.K_HIGH:
                    s = mma(subnormal16(xk & (2 << (2 * c))), qh[c], s, CFG.INTERP)
            else:
                if PAGE.KW1 == 0:
                    code = (xk >> (c * PAGE.KW0)) & ((1 << PAGE.KW0) - 1)
                else:
                    code = chunk_codes(kptr, kmask, c, PAGE.CH, PAGE.KCW // PAGE.CH, PAGE.KW0, PAGE.KW1, PAGE.KW2)
                s = mma(centroid_lookup(code, cb_ptr, PAGE.KB, 1), qk[c], s, CFG.INTERP)
        if CFG.FAST_K:
            s = s * TWO24 + kadd[None, :]
        knorm = load_norms(page + PAGE.OFF_KNORM, off, nmask, PAGE.NORM_F32)
        s = s * knorm[:, None]
        if PAGE.KEY_MODE == K_PROD:
            xs = tl.load(
                (page + PAGE.OFF_KSGN + off * PAGE.CH)[:, None] + sc[None, :],
                mask=nmask[:, None] & (sc[None, :] < PAGE.CH),
                other=0,
            )
            sq = tl.zeros([CFG.BLOCK_N, CFG.GP], tl.float32)
            for c in tl.static_range(8):
                sq = mma(subnormal16(xs & (1 << c)), qs[c], sq, CFG.INTERP)
            rnorm = load_norms(page + PAGE.OFF_KRNORM, off, nmask, PAGE.NORM_F32)
            s = s + (sq * TWO24 - ssub[None, :]) * (qjl_scale * rnorm)[:, None]
    return s


@triton.jit
def _value_tile(page, off, nmask, vu, ng, p, alpha, acc, zacc, zero_rt, vcb_ptr, PAGE: tl.constexpr, CFG: tl.constexpr):
    """One tile's values into the accumulators (rescaled by ``alpha``): v^T tiles [coords, N] (loaded transposed: the
    bytes of one token are a column) times the probabilities p [N, GP]. -> (acc, zacc)."""
    RAW_T: tl.constexpr = tl.bfloat16 if PAGE.RAW_BF16 else tl.float16
    if PAGE.VAL_MODE == V_RAW:
        vraw = tl.load(
            (page + PAGE.OFF_VRAW + off * (2 * PAGE.D))[None, :].to(tl.pointer_type(RAW_T)) + vu[:, None],
            mask=nmask[None, :] & (vu[:, None] < PAGE.D),
            other=0.0,
        )
        acc = (mma(vraw, p.to(RAW_T), acc[0] * alpha[None, :], CFG.INTERP),)
    elif PAGE.VAL_MODE == V_MSE:
        acc = _mse_value_tile(page, off, nmask, vu, p, alpha, acc, vcb_ptr, PAGE, CFG)
    else:
        p16 = p.to(tl.float16)
        vrow = page + PAGE.OFF_VCODES + off * (PAGE.CH * PAGE.VB)
        srow = (page + PAGE.OFF_VSCALE + off * (2 * PAGE.NG)).to(tl.pointer_type(tl.float16))
        zrow = (page + PAGE.OFF_VZERO + off * (2 * PAGE.NG)).to(tl.pointer_type(tl.float16))
        xvs = ()
        if PAGE.VW1 == 0:
            for j in tl.static_range(CFG.VSC):
                xvs = xvs + (
                    tl.load(
                        vrow[None, :] + (j * CFG.VSUB + vu)[:, None],
                        mask=nmask[None, :] & (vu[:, None] < CFG.VSUB),
                        other=0,
                    ),
                )
        else:
            for _ in tl.static_range(CFG.VSC):
                xvs = xvs + (0,)
        new_acc = ()
        for c in tl.static_range(PAGE.VCH):
            for j in tl.static_range(CFG.VSC):
                vptr = vrow[None, :] + (j * CFG.VSUB + vu)[:, None]
                vmask = nmask[None, :] & (vu[:, None] < CFG.VSUB)
                if CFG.FAST_V:
                    # the sub-chunk lies in one group: fold the per-token scale into P, keep codes as
                    # subnormal planes; zero points go through zacc
                    grp = (c * PAGE.VCW + j * CFG.VSUB) // PAGE.GROUP
                    vs = tl.load(srow + grp, mask=nmask, other=0.0)
                    w = p16 * vs[:, None]  # fp16 product: P is converted to the operand layout once
                    tile = folded_value_tile(xvs[j], vptr, vmask, w, zero_rt, c, PAGE, CFG.INTERP)
                    new_acc = new_acc + (acc[c * CFG.VSC + j] * alpha[None, :] + tile,)
                else:
                    if PAGE.VW1 == 0:
                        code = (xvs[j] >> (c * PAGE.VW0)) & ((1 << PAGE.VW0) - 1)
                    else:
                        code = chunk_codes(vptr, vmask, c, PAGE.CH, PAGE.VCW // PAGE.CH, PAGE.VW0, PAGE.VW1, PAGE.VW2)
                    if PAGE.GROUP % CFG.VSUB == 0:
                        grp = (c * PAGE.VCW + j * CFG.VSUB) // PAGE.GROUP
                        vs = tl.load(srow + grp, mask=nmask, other=0.0).to(tl.float32)[None, :]
                        vz = tl.load(zrow + grp, mask=nmask, other=0.0).to(tl.float32)[None, :]
                    else:
                        grp = tl.minimum((c * PAGE.VCW + j * CFG.VSUB + vu) // PAGE.GROUP, PAGE.NG - 1)
                        vs = tl.load(srow[None, :] + grp[:, None], mask=vmask, other=0.0).to(tl.float32)
                        vz = tl.load(zrow[None, :] + grp[:, None], mask=vmask, other=0.0).to(tl.float32)
                    v = (code.to(tl.float32) * vs + vz).to(tl.float16)
                    new_acc = new_acc + (mma(v, p16, acc[c * CFG.VSC + j] * alpha[None, :], CFG.INTERP),)
        acc = new_acc
        if CFG.FAST_V:
            zt = tl.load(zrow[None, :] + ng[:, None], mask=nmask[None, :] & (ng[:, None] < PAGE.NG), other=0.0)
            zacc = zacc * alpha[None, :] + mma(zt, p16, tl.zeros([CFG.NGP, CFG.GP], tl.float32) + zero_rt, CFG.INTERP)
    return acc, zacc


@triton.jit
def _mse_value_tile(page, off, nmask, vu, p, alpha, acc, vcb_ptr, PAGE: tl.constexpr, CFG: tl.constexpr):
    """mse values: one tile's ||v|| c[idx] in the rotated domain, chunk by chunk ([VCW coordinates, N], the centroids
    by ``centroid_lookup``: a 3-bit Lloyd-Max codebook is not affine) times p into the chunk accumulators (rescaled
    by ``alpha``). ``_unrotate_values`` turns the sums back once per program."""
    p16 = p.to(tl.float16)
    vptr = (page + PAGE.OFF_VIDX + off * (PAGE.CH * PAGE.VB))[None, :] + vu[:, None]
    vmask = nmask[None, :] & (vu[:, None] < PAGE.VCW)
    vnorm = load_norms(page + PAGE.OFF_VNORM, off, nmask, PAGE.NORM_F32)
    if PAGE.VW1 == 0:
        xv = tl.load(vptr, mask=vmask, other=0)
    new_acc = ()
    for c in tl.static_range(PAGE.VCH):
        if PAGE.VW1 == 0:
            code = (xv >> (c * PAGE.VW0)) & ((1 << PAGE.VW0) - 1)
        else:
            code = chunk_codes(vptr, vmask, c, PAGE.CH, PAGE.VCW // PAGE.CH, PAGE.VW0, PAGE.VW1, PAGE.VW2)
        v = (centroid_lookup(code, vcb_ptr, PAGE.VB, 1).to(tl.float32) * vnorm[None, :]).to(tl.float16)
        new_acc = new_acc + (mma(v, p16, acc[c] * alpha[None, :], CFG.INTERP),)
    return new_acc


@triton.jit
def _unrotate_values(acc, vpi_ptr, vu, PAGE: tl.constexpr, CFG: tl.constexpr):
    """mse values: the chunk accumulators [VSUBP, GP] summed in the rotated domain, turned back: output chunk c' =
    sum over chunks c of (Pi_v[chunk c, chunk c'])^T @ acc[c] (three-pass TF32 tensor-core products, ``tf32x3``:
    ~fp32 accurate, and fp32's range, which sums of thousands of tokens need; padding rows and columns of Pi_v read
    as zero, so the padding coordinates' sums do not count). Linear, so it commutes with the online softmax's
    rescaling: the recent tokens then add to the same accumulators in the original domain, and the split partials
    merge as they are."""
    out = ()
    for co in tl.static_range(PAGE.VCH):
        col = co * PAGE.VCW + vu  # original coordinates of output chunk co
        cmask = (vu[:, None] < PAGE.VCW) & (col[:, None] < PAGE.D)
        o = tl.zeros([CFG.VSUBP, CFG.GP], tl.float32)
        for c in tl.static_range(PAGE.VCH):
            row = c * PAGE.VCW + vu  # rotated coordinates of chunk c
            pit = tl.load(
                vpi_ptr + row[None, :] * PAGE.D + col[:, None],
                mask=cmask & (vu[None, :] < PAGE.VCW) & (row[None, :] < PAGE.D),
                other=0.0,
            )
            o = tl.dot(pit, acc[c], o, input_precision="tf32x3")
        out = out + (o,)
    return out
