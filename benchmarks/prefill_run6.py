"""Run-6 chunked-prefill kernel (commit 9fdc709), kept only to time it beside the new one in run 7; delete after.

Chunked prefill: a chunk of T query tokens per sequence over the compressed tokens, the recent ring
and (causally) the chunk's own fp16 keys/values, in one flash-attention pass, under decode's window rule
(``format.exact_start``, mirrored by ``_window_lo``): a query at position p reads positions older than
p + 1 - R (sliding) or than its own R-token block p - p % R (BLOCK_WINDOW) compressed (history and chunk
alike: the pages already hold the chunk) and the rest exactly.

One program = BLOCK_M query rows of one (sequence, KV head); a row is a (token, query head) pair,
so the G query heads of a KV head share every loaded tile (GQA). History tiles are expanded from
their packed bytes into registers chunk by chunk (see ``_tiles``) and multiplied on the tensor
cores against the transformed query (Pi q, S q); the history is never decompressed into memory.
Same contract as ``attention.reference.paged_attention_prefill``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from jetson_tq.paged import PagedKV
from jetson_tq.errors import DTypeError, ShapeError, expect_same_device
from jetson_tq.kernels._common import INTERPRET, VAL_GROUP, codec_constants, cuda_or_interpreter, next_pow2
from jetson_tq.kernels._tiles import (K_PROD, K_RAW, TWO24, V_RAW, centroid_lookup, chunk_codes, folded_value_tile, mma,
                     online_softmax, subnormal16)
from jetson_tq.kernels.hybrid_decode import LOG2E, _spec, fast_key_planes, value_subchunks
from jetson_tq.kernels.query_transform import query_transform


@triton.jit
def _qchunk(qt_ptr, qrow, rmask, col0, CW: tl.constexpr, cols, QW: tl.constexpr, LIMIT: tl.constexpr, factor):
    """factor * transformed-query columns [col0, col0 + CW) (< LIMIT) of rows ``qrow`` -> fp32 [M, CWP]."""
    col = col0 + cols
    q = tl.load(qt_ptr + qrow[:, None] * QW + col[None, :],
                mask=rmask[:, None] & (cols[None, :] < CW) & (col[None, :] < LIMIT), other=0.0)
    return q * factor


@triton.jit
def _window_lo(pos, ring, BLOCK_WINDOW: tl.constexpr):
    """First position a query at ``pos`` reads exactly (``format.exact_start``; ring >= 1 under BLOCK_WINDOW)."""
    if BLOCK_WINDOW:
        return pos - pos % ring
    return pos + 1 - ring


@triton.jit
def _dense_part(k_base, v_base, skt, svt, t_start, n_tok, pos0, ring, RING: tl.constexpr, qpos, lo, qraw, acc, zacc,
                m_i, l_i, rk_ptr, rv_ptr,
                D: tl.constexpr, DP: tl.constexpr, VCW: tl.constexpr, VCH: tl.constexpr, VSUB: tl.constexpr,
                VSUBP: tl.constexpr, VSC: tl.constexpr, VB: tl.constexpr, FAST_V: tl.constexpr,
                ONE_RUN: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr):
    """Attend to uncompressed tokens [t_start, n_tok) (k^T tiles loaded [D, tokens]) whose positions lie in each
    row's exact window [lo, qpos]: ring rows (RING: row t holds the position p >= pos0 with p % ring == t) or the
    chunk itself (position pos0 + t)."""
    d = tl.arange(0, DP)
    vu = tl.arange(0, VSUBP)
    for t0 in range(t_start, n_tok, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        if RING:
            pos = pos0 + ((t - pos0 % ring) % ring + ring) % ring
        else:
            pos = pos0 + t
        tmask = (t >= t_start) & (t < n_tok)
        kt = tl.load(k_base + t[None, :].to(tl.int64) * skt + d[:, None], mask=tmask[None, :] & (d[:, None] < D),
                     other=0.0)
        kt = kt.to(rk_ptr.dtype.element_ty)  # the chunk goes through the buffer dtype, as it will be stored there
        s = mma(qraw, kt, tl.zeros([qraw.shape[0], BLOCK_N], tl.float32), INTERP)
        s = tl.where(tmask[None, :] & (pos[None, :] >= lo[:, None]) & (pos[None, :] <= qpos[:, None]), s, float("-inf"))
        m_i, alpha, p, l_i = online_softmax(s, m_i, l_i, 1)
        zacc = zacc * alpha[:, None]
        new_acc = ()
        for c in tl.static_range(VCH):
            for j in tl.static_range(VSC):
                col = c * VCW + j * VSUB + vu
                v = tl.load(v_base + t[:, None].to(tl.int64) * svt + col[None, :],
                            mask=tmask[:, None] & (vu[None, :] < VSUB) & (col[None, :] < D), other=0.0)
                v = v.to(rv_ptr.dtype.element_ty)
                pv = mma(p.to(v.dtype), v, tl.zeros([qraw.shape[0], VSUBP], tl.float32), INTERP)
                if FAST_V:  # the fast-path accumulators hold values * 2^(c*VB - 24)
                    pv = pv * ((1 << (c * VB * ONE_RUN)) / TWO24)
                new_acc = new_acc + (acc[c * VSC + j] * alpha[:, None] + pv,)
        acc = new_acc
    return acc, zacc, m_i, l_i


@triton.jit
def _prefill_kernel(
        qt_ptr, q_ptr, k_ptr, v_ptr, pages_ptr, bt_ptr, clen_ptr, rk_ptr, rv_ptr, rlen_ptr, ridx_ptr, cb_ptr,
        out_ptr, T, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
        stride_vb, stride_vh, stride_vt, stride_bt, page_bytes,
        stride_rkn, stride_rkh, stride_rkt, stride_rvn, stride_rvh, stride_rvt,
        stride_ob, stride_oh, stride_ot, scale_log2, qjl_scale, k_alpha, k_beta, k_gamma, zero_rt, ring,
        HKV: tl.constexpr, G: tl.constexpr, QW: tl.constexpr,
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
        BLOCK_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr):
    pid_bh, pid_m = tl.program_id(0), tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    clen = tl.load(clen_ptr + b)
    rlen = tl.load(rlen_ptr + b)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows = (token, query head of this KV head)
    rmask = r < T * G
    tok = r // G
    hq = h * G + r % G
    qrow = ((b * (HKV * G) + hq) * T + tok).to(tl.int64)  # row of the transformed query
    # window rule: the row at position qpos reads positions < lo compressed and [lo, qpos] exactly
    hist = clen + rlen
    qpos = hist + tok
    lo = _window_lo(qpos, ring, BLOCK_WINDOW)
    first_tok = pid_m * BLOCK_M // G
    last_tok = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, T - 1)
    lo_first = _window_lo(hist + first_tok, ring, BLOCK_WINDOW)  # lo grows with the token: the tile's bounds
    lo_last = _window_lo(hist + last_tok, ring, BLOCK_WINDOW)
    RAW_T: tl.constexpr = tl.bfloat16 if RAW_BF16 else tl.float16

    # ---- constants the fast planes add, per row: alpha * sum(Pi q) and sum(S q). The query chunks
    # themselves are re-read (L1) and scaled inside the tile loop, so no operand tile stays live in
    # registers across it (register pressure, not bandwidth, limits this kernel).
    kc = tl.arange(0, KCWP)
    sc = tl.arange(0, CHP)
    kadd = tl.zeros([BLOCK_M], tl.float32)
    ssub = tl.zeros([BLOCK_M], tl.float32)
    if FAST_K:
        for c in tl.static_range(KCH):
            kadd += k_alpha * tl.sum(_qchunk(qt_ptr, qrow, rmask, c * KCW, KCW, kc, QW, D, 1.0), 1)
    if KEY_MODE == K_PROD:
        for c in tl.static_range(8):
            ssub += tl.sum(_qchunk(qt_ptr, qrow, rmask, D + c * CH, CH, sc, QW, 2 * D, 1.0), 1)

    vu = tl.arange(0, VSUBP)
    ng = tl.arange(0, NGP)
    zacc = tl.zeros([BLOCK_M, NGP], tl.float32)  # fast path: sum_n p * zero[n, group]
    acc = ()
    for i in tl.static_range(VCH * VSC):
        acc = acc + (tl.zeros([BLOCK_M, VSUBP], tl.float32),)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)

    # ---- compressed tokens (history and, past the window, the chunk: the pages hold both), BLOCK_N per tile
    # (tiles are loaded [bytes, tokens]: B operands)
    head_off = h.to(tl.int64) * page_bytes
    cend = tl.maximum(lo_last, 0)
    for n0 in range(0, cend, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < cend
        blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + n // BS, mask=nmask, other=0)
        page = pages_ptr + (blk.to(tl.int64) * (HKV * page_bytes) + head_off)
        off = n % BS
        if KEY_MODE == K_RAW:
            kraw = tl.load((page + OFF_KRAW + off * (2 * D))[None, :].to(tl.pointer_type(RAW_T)) + kc[:, None],
                           mask=nmask[None, :] & (kc[:, None] < D), other=0.0)
            q0 = _qchunk(qt_ptr, qrow, rmask, 0, D, kc, QW, D, 1.0).to(RAW_T)
            s = mma(q0, kraw, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), INTERP)
        else:
            kptr = (page + OFF_KIDX + off * (CH * KB))[None, :] + kc[:, None]
            kmask = nmask[None, :] & (kc[:, None] < KCW)
            if KW1 == 0:
                xk = tl.load(kptr, mask=kmask, other=0)
            s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for c in tl.static_range(KCH):
                qc = _qchunk(qt_ptr, qrow, rmask, c * KCW, KCW, kc, QW, D, 1.0)
                if FAST_K:
                    s = mma((qc * (k_beta / (1 << (KB * c)))).to(tl.float16),
                            subnormal16(xk & (((1 << KB) - 1) << (KB * c))), s, INTERP)
                    if K_HIGH:
                        s = mma((qc * (k_gamma / (2 << (2 * c)))).to(tl.float16), subnormal16(xk & (2 << (2 * c))),
                                s, INTERP)
                else:
                    if KW1 == 0:
                        code = (xk >> (c * KW0)) & ((1 << KW0) - 1)
                    else:
                        code = chunk_codes(kptr, kmask, c, CH, KCW // CH, KW0, KW1, KW2)
                    s = mma(qc.to(tl.float16), centroid_lookup(code, cb_ptr, KB, 0), s, INTERP)
            if FAST_K:
                s = s * TWO24 + kadd[:, None]
            if NORM_F32:
                knorm = tl.load((page + OFF_KNORM + off * 4).to(tl.pointer_type(tl.float32)), mask=nmask, other=0.0)
            else:
                knorm = tl.load((page + OFF_KNORM + off * 2).to(tl.pointer_type(tl.float16)), mask=nmask,
                                other=0.0).to(tl.float32)
            s = s * knorm[None, :]
            if KEY_MODE == K_PROD:
                xs = tl.load((page + OFF_KSGN + off * CH)[None, :] + sc[:, None],
                             mask=nmask[None, :] & (sc[:, None] < CH), other=0)
                sq = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for c in tl.static_range(8):
                    qsc = _qchunk(qt_ptr, qrow, rmask, D + c * CH, CH, sc, QW, 2 * D, 2.0 / (1 << c))
                    sq = mma(qsc.to(tl.float16), subnormal16(xs & (1 << c)), sq, INTERP)
                if NORM_F32:
                    rnorm = tl.load((page + OFF_KRNORM + off * 4).to(tl.pointer_type(tl.float32)), mask=nmask,
                                    other=0.0)
                else:
                    rnorm = tl.load((page + OFF_KRNORM + off * 2).to(tl.pointer_type(tl.float16)), mask=nmask,
                                    other=0.0).to(tl.float32)
                s = s + (sq * TWO24 - ssub[:, None]) * (qjl_scale * rnorm)[None, :]
        s = tl.where(nmask[None, :] & (n[None, :] < lo[:, None]), s, float("-inf"))
        m_i, alpha, p, l_i = online_softmax(s, m_i, l_i, 1)
        if VAL_MODE == V_RAW:
            vraw = tl.load((page + OFF_VRAW + off * (2 * D))[:, None].to(tl.pointer_type(RAW_T)) + vu[None, :],
                           mask=nmask[:, None] & (vu[None, :] < D), other=0.0)
            acc = (mma(p.to(RAW_T), vraw, acc[0] * alpha[:, None], INTERP),)
        else:
            p16 = p.to(tl.float16)
            vrow = page + OFF_VCODES + off * (CH * VB)
            srow = (page + OFF_VSCALE + off * (2 * NG)).to(tl.pointer_type(tl.float16))
            zrow = (page + OFF_VZERO + off * (2 * NG)).to(tl.pointer_type(tl.float16))
            xvs = ()
            if VW1 == 0:
                for j in tl.static_range(VSC):
                    xvs = xvs + (tl.load(vrow[:, None] + (j * VSUB + vu)[None, :],
                                         mask=nmask[:, None] & (vu[None, :] < VSUB), other=0),)
            else:
                for j in tl.static_range(VSC):
                    xvs = xvs + (0,)
            new_acc = ()
            for c in tl.static_range(VCH):
                for j in tl.static_range(VSC):
                    vptr = vrow[:, None] + (j * VSUB + vu)[None, :]
                    vmask = nmask[:, None] & (vu[None, :] < VSUB)
                    if FAST_V:  # per-token scale folded into P, codes as subnormal planes, zeros via zacc
                        grp = (c * VCW + j * VSUB) // GROUP
                        vs = tl.load(srow + grp, mask=nmask, other=0.0).to(tl.float32)
                        w = (p * vs[None, :]).to(tl.float16)
                        tile = folded_value_tile(xvs[j], vptr, vmask, w, zero_rt, c, CH, VCW, VB, VW0, VW1, VW2,
                                                 False, INTERP)
                        new_acc = new_acc + (acc[c * VSC + j] * alpha[:, None] + tile,)
                    else:
                        if VW1 == 0:
                            code = (xvs[j] >> (c * VW0)) & ((1 << VW0) - 1)
                        else:
                            code = chunk_codes(vptr, vmask, c, CH, VCW // CH, VW0, VW1, VW2)
                        if GROUP % VSUB == 0:
                            grp = (c * VCW + j * VSUB) // GROUP
                            vs = tl.load(srow + grp, mask=nmask, other=0.0).to(tl.float32)[:, None]
                            vz = tl.load(zrow + grp, mask=nmask, other=0.0).to(tl.float32)[:, None]
                        else:
                            grp = tl.minimum((c * VCW + j * VSUB + vu) // GROUP, NG - 1)
                            vs = tl.load(srow[:, None] + grp[None, :], mask=vmask, other=0.0).to(tl.float32)
                            vz = tl.load(zrow[:, None] + grp[None, :], mask=vmask, other=0.0).to(tl.float32)
                        v = (code.to(tl.float32) * vs + vz).to(tl.float16)
                        new_acc = new_acc + (mma(p16, v, acc[c * VSC + j] * alpha[:, None], INTERP),)
            acc = new_acc
            if FAST_V:
                zt = tl.load(zrow[:, None] + ng[None, :], mask=nmask[:, None] & (ng[None, :] < NG), other=0.0)
                zacc = zacc * alpha[:, None] + mma(p16, zt, tl.zeros([BLOCK_M, NGP], tl.float32) + zero_rt, INTERP)

    # ---- the exact window: ring rows, then the chunk itself (both uncompressed)
    d = tl.arange(0, DP)
    qraw = (tl.load(q_ptr + b.to(tl.int64) * stride_qb + hq[:, None].to(tl.int64) * stride_qh
                    + tok[:, None].to(tl.int64) * stride_qt + d[None, :],
                    mask=rmask[:, None] & (d[None, :] < D), other=0.0).to(tl.float32) * scale_log2
            ).to(rk_ptr.dtype.element_ty)
    ridx = tl.load(ridx_ptr + b).to(tl.int64)
    ring_rows = tl.where(lo_first < hist, rlen, 0)  # skip the ring once the window left it
    acc, zacc, m_i, l_i = _dense_part(rk_ptr + ridx * stride_rkn + h.to(tl.int64) * stride_rkh,
                                      rv_ptr + ridx * stride_rvn + h.to(tl.int64) * stride_rvh,
                                      stride_rkt, stride_rvt, 0, ring_rows, clen, tl.maximum(ring, 1), True, qpos, lo,
                                      qraw, acc, zacc, m_i, l_i, rk_ptr, rv_ptr,
                                      D, DP, VCW, VCH, VSUB, VSUBP, VSC, VB, FAST_V, VW1 == 0, BLOCK_N, INTERP)
    t_start = tl.maximum(lo_first - hist, 0) // BLOCK_N * BLOCK_N
    acc, zacc, m_i, l_i = _dense_part(k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh,
                                      v_ptr + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh,
                                      stride_kt, stride_vt, t_start, last_tok + 1, hist, 1, False, qpos, lo,
                                      qraw, acc, zacc, m_i, l_i, rk_ptr, rv_ptr,
                                      D, DP, VCW, VCH, VSUB, VSUBP, VSC, VB, FAST_V, VW1 == 0, BLOCK_N, INTERP)

    inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
    for c in tl.static_range(VCH):
        for j in tl.static_range(VSC):
            col = c * VCW + j * VSUB + vu
            optr = (out_ptr + b.to(tl.int64) * stride_ob + hq[:, None].to(tl.int64) * stride_oh
                    + tok[:, None].to(tl.int64) * stride_ot + col[None, :])
            o = acc[c * VSC + j]
            if FAST_V:
                grp = (c * VCW + j * VSUB) // GROUP
                o = o * (TWO24 / (1 << (c * VB * (VW1 == 0)))) + tl.sum(tl.where(ng[None, :] == grp, zacc, 0.0), 1)[:, None]
            tl.store(optr, (o * inv[:, None]).to(out_ptr.dtype.element_ty),
                     mask=rmask[:, None] & (vu[None, :] < VSUB) & (col[None, :] < D))


BLOCK_M = 32  # M < 64 keeps Triton on mma.sync (wgmma + heavy register use miscomputed on the H200, run 1)
BLOCK_N = 64


def chunked_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV,
                    softmax_scale: float | None = None, *, out: torch.Tensor | None = None,
                    block_m: int = BLOCK_M, block_n: int = BLOCK_N, num_warps: int = 4,
                    num_stages: int = 2, fold_values: bool = True) -> torch.Tensor:
    """Attention of q [B, Hq, T, D] over ``kv``'s history plus the chunk's own k, v [B, Hkv, T, D] (causal, window
    rule; ``kv.pages`` already hold the chunk's compressed tokens)."""
    cuda_or_interpreter(q)
    expect_same_device(q=q, k=k, v=v, pages=kv.pages)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ShapeError(f"{name}: expected a 4-d tensor [B, H, T, D], got {tuple(t.shape)}")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise DTypeError(f"{name}: expected float16, bfloat16 or float32, got {t.dtype}")
    bsz, hq, t_len, d = q.shape
    hkv = kv.num_kv_heads
    if d != kv.head_dim or bsz != kv.batch_size or hq % hkv:
        raise ShapeError(f"q: expected [{kv.batch_size}, k*{hkv}, T, {kv.head_dim}], got {tuple(q.shape)}")
    if k.shape != v.shape or k.shape != (bsz, hkv, t_len, d):
        raise ShapeError(f"k, v: expected [{bsz}, {hkv}, {t_len}, {d}], got {tuple(k.shape)} and {tuple(v.shape)}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if out is None:
        out = torch.empty_like(q)
    if t_len == 0:
        return out
    spec, spec_kw = _spec(kv.layout, kv.codec)
    consts = codec_constants(kv.codec, q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qt = query_transform(q.reshape(bsz * hq, t_len, d), consts["qmat"], scale * LOG2E)
    g = hq // hkv
    rk, rv = kv.recent_k, kv.recent_v
    ring = rk.shape[2]  # the window R: positions older than exact_start(p) are read compressed
    if rk.shape[2] == 0 or rk.numel() == 0:  # no buffer storage: point at k, never read (recent_lens are 0)
        rk, rv = k, v
    vsub, vsc = value_subchunks(spec)
    fast_k, k_high = fast_key_planes(spec, consts)
    fast_v = fold_values and spec.VAL_MODE == VAL_GROUP and spec.GROUP % vsub == 0
    ka, kb_, kg = consts["kfit"] or (0.0, 0.0, 0.0)
    grid = (bsz * hkv, triton.cdiv(t_len * g, block_m))
    _prefill_kernel[grid](
        qt, q, k, v, kv.pages, kv.block_table, kv.compressed_lens, rk, rv, kv.recent_lens, kv.recent_index,
        consts["codebook"], out, t_len, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), kv.block_table.stride(0), spec.PB,
        rk.stride(0), rk.stride(1), rk.stride(2), rv.stride(0), rv.stride(1), rv.stride(2),
        out.stride(0), out.stride(1), out.stride(2), scale * LOG2E, kv.codec.qjl_scale, ka, kb_, kg, 0.0, ring,
        HKV=hkv, G=g, QW=qt.shape[1], **spec_kw,
        KCWP=max(16, next_pow2(spec.KCW)), CHP=max(16, next_pow2(spec.CH)), VSUB=vsub,
        VSUBP=max(16, next_pow2(vsub)), VSC=vsc, NGP=max(16, next_pow2(spec.NG)),
        FAST_K=fast_k, K_HIGH=k_high, FAST_V=fast_v, BLOCK_WINDOW=kv.layout.fmt.block_window and ring > 0,
        BLOCK_M=block_m, BLOCK_N=block_n, INTERP=INTERPRET, num_warps=num_warps, num_stages=num_stages)
    return out

