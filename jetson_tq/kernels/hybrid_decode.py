"""Fused hybrid decode: one query token per sequence over compressed pages AND the recent buffer.

One program = one (sequence, KV head, split). It walks its share of the compressed tokens through
the block table (vLLM 0.26 layout: slot = block * block_size + offset), BLOCK_N tokens per tile,
scoring every tile for all G query heads of the KV head at once (GQA: the tile is loaded once):

    score = ||k|| <Pi q, c[idx]> + sqrt(pi/2)/D ||r|| <S q, signs>      (keys never rebuilt)
    value = code * scale + zero                                         (per group of coordinates)

with (Pi q, S q) computed once per query (scaled by softmax_scale*log2 e): inside this launch for mse
keys under a randomized Hadamard rotation (a Walsh-Hadamard transform of q in registers), else by
``query_transform``. Affine key codebooks (uniform grids; 1-2 bit Lloyd-Max) are scored from the index
bits read as fp16 operand planes; 4-bit Lloyd-Max ones through byte permutes in inline PTX (``nibble_centroids``),
other codebooks (and the CPU interpreter) through a warp-shuffle lookup per coordinate.
Packed fields are read chunk by chunk (see ``_tiles``): a chunk of codes is a shift and a mask of
a loaded (BLOCK_N, bytes) tile and feeds ``tl.dot`` directly. The splits cut the sequence's compressed
tokens followed by its uncompressed recent-buffer tokens, so a program may attend to both, in one online
softmax. With several splits each program writes a partial (output, log-sum-exp) and ``_decode_reduce_kernel``
merges them in a second launch; with ``fused_reduce=True`` the last program of each (sequence, KV head) to finish
merges them instead (``_reduce_on_arrival``: arrival counters, two levels), one launch per call. No host sync and no allocation after the first call of a
shape (workspaces are cached), so the launcher can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..paged import PagedKV
from ..errors import DTypeError, ShapeError, expect_same_device
from ._common import (INTERPRET, KEY_MSE, KEY_RAW, VAL_GROUP, PageSpec, codec_constants, counters,
                      cuda_or_interpreter, next_pow2, workspace)
from ._tiles import (K_PROD, K_RAW, TWO24, V_RAW, centroid_lookup, chunk_codes, folded_value_tile, fwht_rows, mma,
                     nibble_centroids, nibble_lut_asm, online_softmax, subnormal16, value_unit)
from ._launch import FastLauncher, resident_programs
from .query_transform import query_transform

LOG2E = 1.4426950408889634


@triton.jit
def _hybrid_decode_kernel(
        qt_ptr, q_ptr, pages_ptr, bt_ptr, clen_ptr, rk_ptr, rv_ptr, rlen_ptr, ridx_ptr, cb_ptr, hs_ptr,
        out_ptr, po_ptr, plse_ptr, cnt_ptr,
        stride_qb, stride_qh, stride_bt, page_bytes,
        stride_rkn, stride_rkh, stride_rkt, stride_rvn, stride_rvh, stride_rvt,
        stride_ob, stride_oh, tokens_per_split, n_splits, group_size, scale_log2, qt_scale, qjl_scale, k_alpha, k_beta, k_gamma,
        zero_rt,
        HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, QW: tl.constexpr,
        D: tl.constexpr, DP: tl.constexpr, CH: tl.constexpr, BS: tl.constexpr, PB: tl.constexpr,
        KEY_MODE: tl.constexpr, KB: tl.constexpr, KW0: tl.constexpr, KW1: tl.constexpr, KW2: tl.constexpr,
        KCW: tl.constexpr, KCH: tl.constexpr, OFF_KIDX: tl.constexpr, OFF_KSGN: tl.constexpr,
        OFF_KNORM: tl.constexpr, OFF_KRNORM: tl.constexpr, OFF_KRAW: tl.constexpr, NORM_F32: tl.constexpr,
        VAL_MODE: tl.constexpr, VB: tl.constexpr, VW0: tl.constexpr, VW1: tl.constexpr, VW2: tl.constexpr,
        VCW: tl.constexpr, VCH: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
        OFF_VCODES: tl.constexpr, OFF_VSCALE: tl.constexpr, OFF_VZERO: tl.constexpr, OFF_VRAW: tl.constexpr,
        RAW_BF16: tl.constexpr,
        KCWP: tl.constexpr, CHP: tl.constexpr, VSUB: tl.constexpr, VSUBP: tl.constexpr, VSC: tl.constexpr,
        NGP: tl.constexpr, FAST_K: tl.constexpr, K_HIGH: tl.constexpr, FAST_V: tl.constexpr,
        FUSE_Q: tl.constexpr, LOG2D: tl.constexpr, LUT_PRMT: tl.constexpr, KLUT: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SINGLE: tl.constexpr, FUSED_REDUCE: tl.constexpr,
        SPB: tl.constexpr, INTERP: tl.constexpr):
    # Tiles are kept transposed: scores sT [tokens, GP query heads] = codes [tokens, chunk] @ q^T,
    # so packed bytes load as (tokens, bytes) rows and feed the tensor cores without a transpose.
    pid_bh, split = tl.program_id(0), tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    clen = tl.load(clen_ptr + b)
    rlen = tl.load(rlen_ptr + b)
    g = tl.arange(0, GP)
    gmask = g < G
    qrow = b * (HKV * G) + h * G + g  # flat query-head rows of this KV head
    RAW_T: tl.constexpr = tl.bfloat16 if RAW_BF16 else tl.float16
    KDOT_T: tl.constexpr = RAW_T if KEY_MODE == K_RAW else tl.float16

    if FUSE_Q:
        # the query transform in this launch (randomized Hadamard rotation, mse keys): every split of this
        # (sequence, KV head) writes the same Pi q * scale rows, then reads them back chunk by chunk below
        dq = tl.arange(0, DP)
        q0 = tl.load(q_ptr + b.to(tl.int64) * stride_qb + (h * G + g)[:, None].to(tl.int64) * stride_qh + dq[None, :],
                     mask=gmask[:, None], other=0.0).to(tl.float32)
        qr = fwht_rows(q0 * tl.load(hs_ptr + dq)[None, :], GP, DP, LOG2D) * qt_scale
        tl.store(qt_ptr + qrow[:, None] * QW + dq[None, :], qr, mask=gmask[:, None])
        tl.debug_barrier()

    # ---- the transformed query as fp16 B operands [chunk, GP], one (or two) per chunk, loaded once.
    # Fast path (affine codebooks: c[k] = alpha + beta k (+ gamma (k >> 1) for 2-bit Lloyd-Max)):
    # <q, c[idx]> = alpha sum(q) + beta <q, k> (+ gamma <q, k >> 1>) with k read as an fp16 subnormal
    # plane (bits * 2^(KB c) * 2^-24); the 2^-(KB c) goes into the query operand.
    kc = tl.arange(0, KCWP)
    kadd = tl.zeros([GP], tl.float32)
    qk = ()
    qh = ()
    for c in tl.static_range(KCH):
        kcol = c * KCW + kc
        qc = tl.load(qt_ptr + qrow[None, :] * QW + kcol[:, None],
                     mask=gmask[None, :] & (kc[:, None] < KCW) & (kcol[:, None] < D), other=0.0)
        if FAST_K:
            kadd += k_alpha * tl.sum(qc, 0)
            qk = qk + ((qc * (k_beta / (1 << (KB * c)))).to(tl.float16),)
            if K_HIGH:
                qh = qh + ((qc * (k_gamma / (2 << (2 * c)))).to(tl.float16),)
        else:
            qk = qk + (qc.to(KDOT_T),)
    sc = tl.arange(0, CHP)
    qs = ()
    ssub = tl.zeros([GP], tl.float32)
    if KEY_MODE == K_PROD:
        for c in tl.static_range(8):
            scol = c * CH + sc
            qsc = tl.load(qt_ptr + qrow[None, :] * QW + D + scol[:, None],
                          mask=gmask[None, :] & (sc[:, None] < CH) & (scol[:, None] < D), other=0.0)
            qsa = (qsc * (2.0 / (1 << c))).to(tl.float16)
            ssub += tl.sum(qsc, 0)  # <q, sign> = 2 <q, bit> - sum(q)
            qs = qs + (qsa,)

    vu = tl.arange(0, VSUBP)
    ng = tl.arange(0, NGP)
    zacc = tl.zeros([NGP, GP], tl.float32)  # fast path: sum_n p * zero[n, group]
    acc = ()
    for i in tl.static_range(VCH * VSC):
        acc = acc + (tl.zeros([VSUBP, GP], tl.float32),)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_t = tl.zeros([BLOCK_N, GP], tl.float32)

    # ---- this split's share of the sequence's tokens, compressed ones first, then the recent buffer's:
    # virtual tokens [start, start + tps) of [0, clen + rlen); compressed [start, end), BLOCK_N per tile.
    # The split size follows this sequence's own length (at least tokens_per_split, a BLOCK_N multiple), not the
    # block table's capacity: under vLLM the table spans max_model_len, and capacity-sized splits left most
    # programs of an 8k sequence idle in a 128k table
    tps = tl.maximum(tokens_per_split, tl.cdiv(clen + rlen, n_splits * BLOCK_N) * BLOCK_N)
    start = split * tps
    end = tl.minimum(start + tps, clen)
    head_off = h.to(tl.int64) * page_bytes
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        if BS % BLOCK_N == 0:  # the tile lies in one page (n0 is a BLOCK_N multiple): one block id, one base pointer
            blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + n0 // BS)
            page = pages_ptr + (blk.to(tl.int64) * (HKV * page_bytes) + head_off)
            off = n0 % BS + tl.arange(0, BLOCK_N)
        elif BLOCK_N == 2 * BS:  # two pages: two block ids, the base pointer picked per token
            b0 = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + n0 // BS)
            b1 = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + n0 // BS + 1, mask=n0 + BS < end, other=0)
            blk = tl.where(tl.arange(0, BLOCK_N) < BS, b0, b1)
            page = pages_ptr + (blk.to(tl.int64) * (HKV * page_bytes) + head_off)
            off = tl.arange(0, BLOCK_N) % BS
        else:
            blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + n // BS, mask=nmask, other=0)
            page = pages_ptr + (blk.to(tl.int64) * (HKV * page_bytes) + head_off)  # [N] byte pointers
            off = n % BS
        # scores of this tile, [N, GP]
        if KEY_MODE == K_RAW:
            kraw = tl.load((page + OFF_KRAW + off * (2 * D))[:, None].to(tl.pointer_type(RAW_T)) + kc[None, :],
                           mask=nmask[:, None] & (kc[None, :] < D), other=0.0)
            s = mma(kraw, qk[0], tl.zeros([BLOCK_N, GP], tl.float32), INTERP)
        else:
            kptr = (page + OFF_KIDX + off * (CH * KB))[:, None] + kc[None, :]
            kmask = nmask[:, None] & (kc[None, :] < KCW)
            if KW1 == 0:
                xk = tl.load(kptr, mask=kmask, other=0)
            s = tl.zeros([BLOCK_N, GP], tl.float32)
            if LUT_PRMT:  # 4-bit codes, two per byte: both chunks' centroids from one byte-permute lookup
                c_lo, c_hi = nibble_centroids(xk, KLUT)
                s = mma(c_hi, qk[1], mma(c_lo, qk[0], s, INTERP), INTERP)
            for c in tl.static_range(0 if LUT_PRMT else KCH):
                if FAST_K:
                    s = mma(subnormal16(xk & (((1 << KB) - 1) << (KB * c))), qk[c], s, INTERP)
                    if K_HIGH:
                        s = mma(subnormal16(xk & (2 << (2 * c))), qh[c], s, INTERP)
                else:
                    if KW1 == 0:
                        code = (xk >> (c * KW0)) & ((1 << KW0) - 1)
                    else:
                        code = chunk_codes(kptr, kmask, c, CH, KCW // CH, KW0, KW1, KW2)
                    s = mma(centroid_lookup(code, cb_ptr, KB, 1), qk[c], s, INTERP)
            if FAST_K:
                s = s * TWO24 + kadd[None, :]
            if NORM_F32:
                knorm = tl.load((page + OFF_KNORM + off * 4).to(tl.pointer_type(tl.float32)), mask=nmask, other=0.0)
            else:
                knorm = tl.load((page + OFF_KNORM + off * 2).to(tl.pointer_type(tl.float16)), mask=nmask,
                                other=0.0).to(tl.float32)
            s = s * knorm[:, None]
            if KEY_MODE == K_PROD:
                xs = tl.load((page + OFF_KSGN + off * CH)[:, None] + sc[None, :],
                             mask=nmask[:, None] & (sc[None, :] < CH), other=0)
                sq = tl.zeros([BLOCK_N, GP], tl.float32)
                for c in tl.static_range(8):
                    sq = mma(subnormal16(xs & (1 << c)), qs[c], sq, INTERP)
                if NORM_F32:
                    rnorm = tl.load((page + OFF_KRNORM + off * 4).to(tl.pointer_type(tl.float32)), mask=nmask,
                                    other=0.0)
                else:
                    rnorm = tl.load((page + OFF_KRNORM + off * 2).to(tl.pointer_type(tl.float16)), mask=nmask,
                                    other=0.0).to(tl.float32)
                s = s + (sq * TWO24 - ssub[None, :]) * (qjl_scale * rnorm)[:, None]
        s = tl.where(nmask[:, None], s, float("-inf"))
        # the running sum stays a [BLOCK_N, GP] tile (one FFMA per element) and is reduced over tokens once, after
        # the loop, instead of a shuffle reduction per tile
        m_i, alpha, p, l_t = online_softmax(s, m_i, l_t, 0, False)
        # values: v^T tiles [coords, N] (loaded transposed: bytes of one token are a column)
        if VAL_MODE == V_RAW:
            vraw = tl.load((page + OFF_VRAW + off * (2 * D))[None, :].to(tl.pointer_type(RAW_T)) + vu[:, None],
                           mask=nmask[None, :] & (vu[:, None] < D), other=0.0)
            acc = (mma(vraw, p.to(RAW_T), acc[0] * alpha[None, :], INTERP),)
        else:
            p16 = p.to(tl.float16)
            vrow = page + OFF_VCODES + off * (CH * VB)
            srow = (page + OFF_VSCALE + off * (2 * NG)).to(tl.pointer_type(tl.float16))
            zrow = (page + OFF_VZERO + off * (2 * NG)).to(tl.pointer_type(tl.float16))
            xvs = ()
            if VW1 == 0:
                for j in tl.static_range(VSC):
                    xvs = xvs + (tl.load(vrow[None, :] + (j * VSUB + vu)[:, None],
                                         mask=nmask[None, :] & (vu[:, None] < VSUB), other=0),)
            else:
                for j in tl.static_range(VSC):
                    xvs = xvs + (0,)
            new_acc = ()
            for c in tl.static_range(VCH):
                for j in tl.static_range(VSC):
                    vptr = vrow[None, :] + (j * VSUB + vu)[:, None]
                    vmask = nmask[None, :] & (vu[:, None] < VSUB)
                    if FAST_V:
                        # the sub-chunk lies in one group: fold the per-token scale into P, keep codes as
                        # subnormal planes; zero points go through zacc
                        grp = (c * VCW + j * VSUB) // GROUP
                        vs = tl.load(srow + grp, mask=nmask, other=0.0)
                        w = p16 * vs[:, None]  # fp16 product: P is converted to the operand layout once
                        tile = folded_value_tile(xvs[j], vptr, vmask, w, zero_rt, c, CH, VCW, VB, VW0, VW1, VW2,
                                                 INTERP)
                        new_acc = new_acc + (acc[c * VSC + j] * alpha[None, :] + tile,)
                    else:
                        if VW1 == 0:
                            code = (xvs[j] >> (c * VW0)) & ((1 << VW0) - 1)
                        else:
                            code = chunk_codes(vptr, vmask, c, CH, VCW // CH, VW0, VW1, VW2)
                        if GROUP % VSUB == 0:
                            grp = (c * VCW + j * VSUB) // GROUP
                            vs = tl.load(srow + grp, mask=nmask, other=0.0).to(tl.float32)[None, :]
                            vz = tl.load(zrow + grp, mask=nmask, other=0.0).to(tl.float32)[None, :]
                        else:
                            grp = tl.minimum((c * VCW + j * VSUB + vu) // GROUP, NG - 1)
                            vs = tl.load(srow[None, :] + grp[:, None], mask=vmask, other=0.0).to(tl.float32)
                            vz = tl.load(zrow[None, :] + grp[:, None], mask=vmask, other=0.0).to(tl.float32)
                        v = (code.to(tl.float32) * vs + vz).to(tl.float16)
                        new_acc = new_acc + (mma(v, p16, acc[c * VSC + j] * alpha[None, :], INTERP),)
            acc = new_acc
            if FAST_V:
                zt = tl.load(zrow[None, :] + ng[:, None], mask=nmask[None, :] & (ng[:, None] < NG), other=0.0)
                zacc = zacc * alpha[None, :] + mma(zt, p16, tl.zeros([NGP, GP], tl.float32) + zero_rt, INTERP)

    l_i = tl.sum(l_t, 0)
    # ---- recent (uncompressed) tokens [r0, r1) of this split: spread over the splits like the compressed ones
    # (one program taking the whole buffer made its split the last to finish: run 6, B=1/1k 13 -> 23 us at 16 per step)
    r0 = tl.maximum(start - clen, 0)
    r1 = tl.minimum(start + tps - clen, rlen)
    if r1 > r0:
        ridx = tl.load(ridx_ptr + b).to(tl.int64)
        d = tl.arange(0, DP)
        qb = tl.load(q_ptr + b.to(tl.int64) * stride_qb + (h * G + g)[None, :].to(tl.int64) * stride_qh + d[:, None],
                     mask=gmask[None, :] & (d[:, None] < D), other=0.0).to(tl.float32) * scale_log2
        rk_base = rk_ptr + ridx * stride_rkn + h.to(tl.int64) * stride_rkh
        rv_base = rv_ptr + ridx * stride_rvn + h.to(tl.int64) * stride_rvh
        for t0 in range(r0, r1, BLOCK_R):
            t = t0 + tl.arange(0, BLOCK_R)
            tmask = t < r1
            k = tl.load(rk_base + t[:, None].to(tl.int64) * stride_rkt + d[None, :],
                        mask=tmask[:, None] & (d[None, :] < D), other=0.0)
            s = mma(k, qb.to(k.dtype), tl.zeros([BLOCK_R, GP], tl.float32), INTERP)
            s = tl.where(tmask[:, None], s, float("-inf"))
            m_i, alpha, p, l_i = online_softmax(s, m_i, l_i, 0, True)
            zacc = zacc * alpha[None, :]
            new_acc = ()
            for c in tl.static_range(VCH):
                for j in tl.static_range(VSC):
                    rcol = c * VCW + j * VSUB + vu
                    v = tl.load(rv_base + t[None, :].to(tl.int64) * stride_rvt + rcol[:, None],
                                mask=tmask[None, :] & (vu[:, None] < VSUB) & (rcol[:, None] < D), other=0.0)
                    pv = mma(v, p.to(v.dtype), tl.zeros([VSUBP, GP], tl.float32), INTERP)
                    if FAST_V:  # the fast-path accumulators hold values * u * 2^-24 (``value_unit``)
                        pv = pv * (value_unit(c, CH, VCW, VB, VW0, VW1, VW2) / TWO24)
                    new_acc = new_acc + (acc[c * VSC + j] * alpha[None, :] + pv,)
            acc = new_acc

    # ---- write the output (one split) or this split's partial (output, log2-sum-exp)
    inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
    for c in tl.static_range(VCH):
        for j in tl.static_range(VSC):
            col = c * VCW + j * VSUB + vu
            omask = gmask[None, :] & (vu[:, None] < VSUB) & (col[:, None] < D)
            o = acc[c * VSC + j]
            if FAST_V:
                grp = (c * VCW + j * VSUB) // GROUP
                zsum = tl.sum(tl.where(ng[:, None] == grp, zacc, 0.0), 0)
                o = o * (TWO24 / value_unit(c, CH, VCW, VB, VW0, VW1, VW2)) + zsum[None, :]
            o = o * inv[None, :]
            if SINGLE:
                optr = out_ptr + b.to(tl.int64) * stride_ob + (h * G + g)[None, :].to(tl.int64) * stride_oh + col[:, None]
                tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=omask)
            else:
                prow = qrow.to(tl.int64) * n_splits + split
                tl.store(po_ptr + prow[None, :] * D + col[:, None], o, mask=omask)
    if not SINGLE:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
        tl.store(plse_ptr + qrow.to(tl.int64) * n_splits + split, lse, mask=gmask)
        if FUSED_REDUCE:
            _reduce_on_arrival(po_ptr, plse_ptr, cnt_ptr, out_ptr, pid_bh, b, h, split, n_splits, group_size,
                               qrow, g, gmask, stride_ob, stride_oh, G, GP, D, DP, SPB)


@triton.jit
def _merge_partials(po_ptr, plse_ptr, qrow, gmask, first, step, count, n_splits,
                    GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, SPB: tl.constexpr):
    """Online merge of ``count`` split partials (normalized output, log2-sum-exp) of the GP query rows ``qrow``
    at split slots first, first + step, ...: (sum of weighted outputs [GP, DP], sum of weights, max log2-sum-exp).
    Loads bypass L1 (``.cg``): the partials were written by other programs of this launch."""
    sb = tl.arange(0, SPB)
    d = tl.arange(0, DP)
    m = tl.full([GP], float("-inf"), tl.float32)
    lsum = tl.zeros([GP], tl.float32)
    o = tl.zeros([GP, DP], tl.float32)
    for i0 in range(0, count, SPB):
        smask = (i0 + sb) < count
        slot = qrow[None, :].to(tl.int64) * n_splits + (first + (i0 + sb) * step)[:, None]  # [SPB, GP]
        lse = tl.load(plse_ptr + slot, mask=smask[:, None] & gmask[None, :], other=float("-inf"),
                      cache_modifier=".cg")
        x = tl.load(po_ptr + slot[:, :, None] * D + d[None, None, :],
                    mask=(lse > float("-inf"))[:, :, None] & (d < D)[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe[None, :])
        o = o * alpha[:, None] + tl.sum(w[:, :, None] * x, 0)
        lsum = lsum * alpha + tl.sum(w, 0)
        m = m_new
    return o, lsum, m


@triton.jit
def _store_heads(out_ptr, b, h, g, gmask, o, stride_ob, stride_oh, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """Write the [GP, DP] output rows of KV head ``h``'s query heads of sequence ``b``."""
    d = tl.arange(0, DP)
    optr = out_ptr + b.to(tl.int64) * stride_ob + (h * G + g)[:, None].to(tl.int64) * stride_oh + d[None, :]
    tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & (d[None, :] < D))


@triton.jit
def _reduce_on_arrival(po_ptr, plse_ptr, cnt_ptr, out_ptr, pid_bh, b, h, split, n_splits, group_size, qrow, g, gmask,
                       stride_ob, stride_oh, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                       SPB: tl.constexpr):
    """The split reduction inside the decode launch, in two levels of arrival counters per (sequence, KV head):
    the last program of a group of ``group_size`` splits to finish merges the group's partials into the group's
    first slot; the last group to finish merges the group partials into the output. Each counter is set back to 0
    by the program that found itself last, so the next launch (or graph replay) starts from zeros."""
    n_groups = (n_splits + group_size - 1) // group_size
    grp = split // group_size
    in_grp = tl.minimum(group_size, n_splits - grp * group_size)
    cbase = cnt_ptr + pid_bh * (n_groups + 1)
    tl.debug_barrier()  # every thread's partial stores come before the release below (one arrival per program)
    arrived = tl.atomic_add(cbase + 1 + grp, 1, sem="acq_rel", scope="gpu")
    if arrived == in_grp - 1:
        tl.store(cbase + 1 + grp, 0)
        o, lsum, m = _merge_partials(po_ptr, plse_ptr, qrow, gmask, grp * group_size, 1, in_grp, n_splits, GP, D,
                                     DP, SPB)
        d = tl.arange(0, DP)
        inv = tl.where(lsum > 0, 1.0 / lsum, 0.0)
        if n_groups > 1:  # this group's merged partial into its first slot, then the second level
            first = qrow.to(tl.int64) * n_splits + grp * group_size
            tl.store(po_ptr + first[:, None] * D + d[None, :], o * inv[:, None], mask=gmask[:, None] & (d[None, :] < D))
            tl.store(plse_ptr + first, tl.where(lsum > 0, m + tl.log2(lsum), float("-inf")), mask=gmask)
            tl.debug_barrier()
            arrived = tl.atomic_add(cbase, 1, sem="acq_rel", scope="gpu")
            if arrived == n_groups - 1:
                tl.store(cbase, 0)
                o, lsum, m = _merge_partials(po_ptr, plse_ptr, qrow, gmask, 0, group_size, n_groups, n_splits, GP, D,
                                             DP, SPB)
                inv = tl.where(lsum > 0, 1.0 / lsum, 0.0)
                _store_heads(out_ptr, b, h, g, gmask, o * inv[:, None], stride_ob, stride_oh, G, D, DP)
        else:
            _store_heads(out_ptr, b, h, g, gmask, o * inv[:, None], stride_ob, stride_oh, G, D, DP)


@triton.jit
def _decode_reduce_kernel(po_ptr, plse_ptr, out_ptr, stride_ob, stride_oh, n_splits,
                          HQ: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr):
    # One program per (sequence, query head): merge n_splits partial outputs by their log-sum-exp.
    row = tl.program_id(0)
    b = row // HQ
    hq = row % HQ
    s = tl.arange(0, SP)
    d = tl.arange(0, DP)
    lse = tl.load(plse_ptr + row.to(tl.int64) * n_splits + s, mask=s < n_splits, other=float("-inf"))
    mx = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - mx), 0.0)
    o = tl.load(po_ptr + (row.to(tl.int64) * n_splits + s)[:, None] * D + d[None, :],
                mask=(s[:, None] < n_splits) & (d[None, :] < D) & (lse[:, None] > float("-inf")), other=0.0)
    tot = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(tot > 0, tot, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + hq.to(tl.int64) * stride_oh + d,
             res.to(out_ptr.dtype.element_ty), mask=d < D)


# ------------------------------------------------------------------------------------ launcher
# Launch defaults from benchmarks/sweep_decode.py on the H200 (docs/benchmarks.md): small programs
# (32 tokens, 2 warps, no software pipelining) and ~16 of them per SM hide the load -> unpack -> MMA
# latency chain better than fewer, larger ones (occupancy, not instruction count, was the limit);
# formats with 3-4 bit key indices do best with 16-token, 1-warp programs, whether the indices go through a
# codebook lookup (Lloyd-Max, run 4: 693 vs 800 us) or one bit plane (uniform, run 5: 502 vs 566 us).
BLOCK_N = 32
NUM_WARPS = 2
WIDE_BLOCK_N = 16
WIDE_NUM_WARPS = 1
# and a cap of 128 registers per thread (16 one-warp programs per SM, one full wave of WAVES programs; run 6b:
# mse_k4v3u 526 -> 349 us, mse_k4v3 740 -> 594 us at B=8/64k against 167 registers = 12 programs = 1.33 waves)
WIDE_MAXNREG = 128
NUM_STAGES = 1
# one-warp programs of 3/4-bit keys pipeline their tile loads (num_stages=2: the next tile's key and value bytes go
# to shared memory by cp.async while this one is scored; run 8: 345 -> 308 us at B=8/64k, 109 -> 90.5 at B=1/128k)
WIDE_NUM_STAGES = 2
BLOCK_R = 16  # recent-buffer tokens per step: 64 set the register count (252 -> 167 per thread for mse_k4v3, sm_90)
MERGE_ELEMS = 2048  # partial-output elements merged per step in the in-launch reduction (SPB * GP * DP)
WAVES = 16.0  # programs per SM when no GPU can tell (offline compiles, interpreter); on CUDA the split count aims
# at the compiled kernel's resident programs per SM (``_one_wave``): 16 for 1-warp programs at 128 registers


_SPECS: dict = {}


def _spec(layout, codec) -> tuple[PageSpec, dict]:
    """PageSpec of (layout, codec) and its constexpr kwargs, computed once (the launcher runs every decode step)."""
    key = (layout, codec.fmt, codec.head_dim, codec.raw_dtype)
    if key not in _SPECS:
        spec = PageSpec.of(layout, codec.raw_dtype)
        _SPECS[key] = (spec, spec.constexprs())
    return _SPECS[key]


def value_subchunks(spec: PageSpec) -> tuple[int, int]:
    """(coordinates per value sub-chunk, sub-chunks per chunk): a chunk is cut at value-group edges when it spans several."""
    if spec.VAL_MODE == VAL_GROUP and spec.VCW % spec.GROUP == 0 and spec.GROUP < spec.VCW:
        return spec.GROUP, spec.VCW // spec.GROUP
    return spec.VCW, 1


def choose_splits(batch: int, num_kv_heads: int, capacity: int, num_sms: int, block_n: int = BLOCK_N,
                  waves: float = WAVES) -> int:
    """Splits per sequence so that B * Hkv * splits programs give every SM at most ``waves`` programs (host-side only).

    Rounded down: with ``waves`` = programs resident per SM, a few programs past one full wave make a second, almost
    empty wave that the whole launch waits for (H200 run 6: 1600 programs on 1584 slots, 944 vs 740 us)."""
    tiles = max(1, -(-capacity // block_n))
    want = max(1, int(waves * num_sms) // max(1, batch * num_kv_heads))
    return max(1, min(tiles, want, 256))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def fast_key_planes(spec: PageSpec, consts: dict, enabled: bool = True) -> tuple[bool, bool]:
    """(FAST_K, K_HIGH): score keys from index bit planes (affine codebook, one planar run) and whether the
    2-bit Lloyd-Max codebook's extra (k >> 1) plane is needed."""
    fit = consts["kfit"]
    fast = enabled and spec.KEY_MODE != KEY_RAW and spec.KB > 0 and spec.KW1 == 0 and fit is not None
    return fast, fast and fit[2] != 0.0


def fused_query(spec: PageSpec, codec) -> bool:
    """True when the decode launch rotates the query itself (mse keys, randomized Hadamard, D a power of two >= 16)."""
    rot = codec.key_rotation
    return spec.KEY_MODE == KEY_MSE and rot is not None and rot.kind == "hadamard" and spec.D == spec.DP


class _DecodePlan:
    """Everything a decode launch needs that depends only on shapes, strides, format and knobs: computed once."""

    __slots__ = ("codec", "consts", "fuse", "qt", "scale_qt", "grid", "reduce_grid", "splits", "ints", "floats",
                 "kw", "key", "reduce_kw", "num_warps", "num_stages", "maxnreg", "po", "plse", "cnt", "fused_reduce",
                 "rk_fallback")


_PLANS: dict = {}
_DECODE = FastLauncher(_hybrid_decode_kernel)
_REDUCE = FastLauncher(_decode_reduce_kernel)


def _make_plan(q, kv, scale, out, num_splits, block_n, fast_keys, fold_values, fuse_query, num_warps, num_stages,
               waves, block_r, fused_reduce, maxnreg, prmt_keys) -> _DecodePlan:
    cuda_or_interpreter(q)
    expect_same_device(q=q, pages=kv.pages)
    if q.dim() != 3:
        raise ShapeError(f"q: expected [B, Hq, D], got {tuple(q.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise DTypeError(f"q: expected float16, bfloat16 or float32, got {q.dtype}")
    bsz, hq, d = q.shape
    hkv = kv.num_kv_heads
    if d != kv.head_dim or bsz != kv.batch_size or hq % hkv:
        raise ShapeError(f"q: expected [{kv.batch_size}, k*{hkv}, {kv.head_dim}], got {tuple(q.shape)}")
    spec, spec_kw = _spec(kv.layout, kv.codec)
    consts = codec_constants(kv.codec, q.device)
    fast_k, k_high = fast_key_planes(spec, consts, fast_keys)
    # 4-bit codebook keys, two codes per byte: byte-permute lookup (inline PTX: not under the CPU interpreter)
    klut = (nibble_lut_asm(consts["codebook"].cpu()) if prmt_keys and not fast_k and not INTERPRET
            and spec.KEY_MODE != KEY_RAW and spec.KB == 4 and spec.KW1 == 0 else None)
    wide = spec.KB >= 3  # 3/4-bit keys (lookup or one wide plane): 16-token one-warp programs measured best
    block_n = block_n or (WIDE_BLOCK_N if wide else BLOCK_N)
    num_warps = num_warps or (WIDE_NUM_WARPS if wide else NUM_WARPS)
    if maxnreg is None:
        maxnreg = WIDE_MAXNREG if wide and num_warps == WIDE_NUM_WARPS else 0
    if num_stages is None:
        num_stages = WIDE_NUM_STAGES if wide and num_warps == WIDE_NUM_WARPS else NUM_STAGES
    plan = _DecodePlan()
    plan.codec, plan.consts = kv.codec, consts
    plan.fuse = fuse_query and fused_query(spec, kv.codec)
    plan.scale_qt = scale * LOG2E
    plan.qt = workspace("qt_fused" if plan.fuse else "qt", (bsz * hq, consts["qmat"].shape[0] if not plan.fuse else d),
                        torch.float32, q.device)
    g = hq // hkv
    rk, rv = kv.recent_k, kv.recent_v
    plan.rk_fallback = rk.shape[2] == 0 or rk.numel() == 0  # no ring storage: point at q, never read
    # splits cut the virtual tokens [0, compressed capacity + ring capacity)
    capacity = kv.block_table.shape[1] * spec.BS + (0 if plan.rk_fallback else rk.shape[2])
    splits = num_splits or choose_splits(bsz, hkv, capacity, _num_sms(q.device), block_n, waves or WAVES)
    tokens_per_split = block_n  # the smallest split; the kernel sizes splits from each sequence's length
    plan.splits, plan.grid, plan.reduce_grid = splits, (bsz * hkv, splits), (bsz * hq,)
    plan.fused_reduce = fused_reduce and splits > 1
    group_size = math.isqrt(splits - 1) + 1 if splits > 1 else 1  # ~sqrt(splits) splits per first-level group
    if splits > 1:
        plan.po = workspace("decode_po", (bsz * hq * splits, d), torch.float32, q.device)
        plan.plse = workspace("decode_lse", (bsz * hq * splits,), torch.float32, q.device)
    else:
        plan.po = plan.plse = None
    n_cnt = bsz * hkv * (2 + (splits - 1) // group_size) if plan.fused_reduce else 1
    plan.cnt = counters(n_cnt, q.device)
    if plan.rk_fallback:
        rk = rv = q.unsqueeze(2)
    vsub, vsc = value_subchunks(spec)
    fast_v = fold_values and spec.VAL_MODE == VAL_GROUP and spec.GROUP % vsub == 0
    ka, kb_, kg = consts["kfit"] or (0.0, 0.0, 0.0)
    ob, oh = (out.stride(0), out.stride(1)) if out is not None else (hq * d, d)
    plan.ints = (q.stride(0), q.stride(1), kv.block_table.stride(0), spec.PB,
                 rk.stride(0), rk.stride(1), rk.stride(2), rv.stride(0), rv.stride(1), rv.stride(2),
                 ob, oh, tokens_per_split, splits, group_size)
    plan.floats = (scale * LOG2E, scale * LOG2E / math.sqrt(d), kv.codec.qjl_scale, ka, kb_, kg, 0.0)
    plan.kw = dict(HKV=hkv, G=g, GP=next_pow2(g), QW=plan.qt.shape[1], **spec_kw,
                   KCWP=max(16, next_pow2(spec.KCW)), CHP=max(16, next_pow2(spec.CH)), VSUB=vsub,
                   VSUBP=max(16, next_pow2(vsub)), VSC=vsc, NGP=max(16, next_pow2(spec.NG)),
                   FAST_K=fast_k, K_HIGH=k_high, FAST_V=fast_v, FUSE_Q=plan.fuse, LOG2D=max(d, 1).bit_length() - 1,
                   LUT_PRMT=klut is not None, KLUT=klut or "",
                   BLOCK_N=block_n, BLOCK_R=block_r, SINGLE=splits == 1, FUSED_REDUCE=plan.fused_reduce,
                   SPB=max(1, MERGE_ELEMS // (next_pow2(g) * next_pow2(d))), INTERP=INTERPRET)
    plan.reduce_kw = dict(HQ=hq, D=d, DP=next_pow2(d), SP=max(2, next_pow2(splits)))
    plan.num_warps, plan.num_stages, plan.maxnreg = num_warps, num_stages, maxnreg or None
    plan.key = (id(plan),)
    if waves is None and num_splits is None and splits > 1:  # one full wave of the compiled kernel's programs
        fit = choose_splits(bsz, hkv, capacity, _num_sms(q.device), block_n, _one_wave(plan, q, kv, rk, rv))
        if fit != splits:
            return _make_plan(q, kv, scale, out, fit, block_n, fast_keys, fold_values, fuse_query, num_warps,
                              num_stages, waves, block_r, fused_reduce, maxnreg, prmt_keys)
    return plan


def _decode_args(plan: _DecodePlan, q, kv, rk, rv, out) -> tuple:
    """The decode kernel's runtime arguments (everything but the constexprs) for one call."""
    po, plse = (plan.po, plan.plse) if plan.splits > 1 else (out, out)
    return (plan.qt, q, kv.pages, kv.block_table, kv.compressed_lens, rk, rv, kv.recent_lens, kv.recent_index,
            plan.consts["codebook"], plan.consts["hsigns"], out, po, plse, plan.cnt, *plan.ints, *plan.floats)


def _one_wave(plan: _DecodePlan, q, kv, rk, rv) -> float:
    """Programs per SM for the split count: as many as the compiled kernel keeps resident (registers, shared memory),
    so the grid is one full wave for every format and head dim; WAVES without a GPU to load the kernel on."""
    if not q.is_cuda or INTERPRET:
        return WAVES
    compiled = _DECODE.compile(plan.grid, _decode_args(plan, q, kv, rk, rv, q), plan.kw, num_warps=plan.num_warps,
                               num_stages=plan.num_stages, maxnreg=plan.maxnreg)
    compiled.run  # noqa: B018  loads the binary: registers per thread are known from then on
    return float(resident_programs(compiled, plan.num_warps, q.device))


def hybrid_decode(q: torch.Tensor, kv: PagedKV, softmax_scale: float | None = None, *,
                  out: torch.Tensor | None = None, num_splits: int | None = None,
                  block_n: int | None = None, fast_keys: bool = True, fold_values: bool = True,
                  fuse_query: bool = True, num_warps: int | None = None, num_stages: int | None = None,
                  waves: float | None = None, block_r: int = BLOCK_R, fused_reduce: bool = False,
                  maxnreg: int | None = None, prmt_keys: bool = True) -> torch.Tensor:
    """Attention of one query token per sequence, q [B, Hq, D] (fp16/bf16/fp32), over ``kv`` -> [B, Hq, D].

    Launch knobs (``block_n``, ``num_warps``, ``num_stages``, ``block_r`` = recent-buffer tokens
    per step, ``maxnreg`` = register cap per thread, 0 for none) default to the best of the H200 sweep for the format
    (benchmarks/sweep_decode.py); ``waves`` = programs per SM the split count aims for (default: as many as the
    compiled kernel keeps resident, one full wave); ``fused_reduce=True`` merges the splits inside the decode launch (one launch
    per call: ~25 us less host time per eager call, but 2-38 % more device time in H200 run 6, so not the
    default);
    ``fast_keys``/``prmt_keys``/``fold_values``/``fuse_query`` switch the bit-plane key scores, the byte-permute
    4-bit centroid lookup, the folded value path and the in-launch query rotation off (for tests and measurements). Results do not depend on them.

    Same contract as ``attention.reference.paged_attention_decode`` (a sequence with nothing cached
    gets zeros instead of an error, so padded CUDA-graph batches are safe). Everything that depends only on
    shapes, strides and knobs is computed on the first call of a shape and cached (``_DecodePlan``), and
    the kernels launch through ``FastLauncher``: an eager call costs a few µs of host time.
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    rk = kv.recent_k
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    key = (id(kv.codec), kv.layout.block_size, q.shape, q.dtype, q.stride(), q.device, kv.pages.device,
           kv.block_table.shape[1], kv.block_table.stride(0), rk.shape, rk.stride(), kv.recent_v.stride(),
           None if out is None else out.stride(), scale, num_splits, block_n, fast_keys, fold_values, fuse_query,
           num_warps, num_stages, waves, block_r, fused_reduce, maxnreg, prmt_keys)
    plan = _PLANS.get(key)
    if plan is None or plan.codec is not kv.codec:
        plan = _PLANS[key] = _make_plan(q, kv, scale, out, num_splits, block_n, fast_keys, fold_values, fuse_query,
                                        num_warps, num_stages, waves, block_r, fused_reduce, maxnreg, prmt_keys)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not plan.fuse:
        query_transform(q, plan.consts["qmat"], plan.scale_qt, out=plan.qt)
    po, plse = (plan.po, plan.plse) if plan.splits > 1 else (out, out)
    rk, rv = (q.unsqueeze(2), q.unsqueeze(2)) if plan.rk_fallback else (kv.recent_k, kv.recent_v)
    # the plan fixes every int argument; only the data pointers' 16-byte alignment can change between calls
    # (any misaligned pointer: the generic per-argument key)
    aligned = True if (q.data_ptr() | kv.pages.data_ptr() | kv.block_table.data_ptr() | kv.compressed_lens.data_ptr()
                       | rk.data_ptr() | rv.data_ptr() | kv.recent_lens.data_ptr() | kv.recent_index.data_ptr()
                       | out.data_ptr()) % 16 == 0 else None
    _DECODE(plan.grid, _decode_args(plan, q, kv, rk, rv, out), plan.kw, plan.key, num_warps=plan.num_warps,
            num_stages=plan.num_stages, maxnreg=plan.maxnreg, aligned=aligned)
    if plan.splits > 1 and not plan.fused_reduce:
        _REDUCE(plan.reduce_grid, (po, plse, out, out.stride(0), out.stride(1), plan.splits), plan.reduce_kw,
                plan.key, num_warps=4, aligned=aligned)
    return out
