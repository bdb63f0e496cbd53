"""Chunked prefill, step 2 on the device: a flash-attention loop over the dequantized workspace and the exact part.

A chunk of T query tokens per sequence attends to the compressed tokens, the recent ring and (causally) the chunk's
own fp16 keys/values, under decode's window rule (``format.exact_start``, mirrored by ``prefill_dequant._window_lo``):
a query at position p reads positions older than p + 1 - R (sliding) or than its own R-token block p - p % R
(BLOCK_WINDOW) compressed (history and chunk alike: the pages already hold the chunk) and the rest exactly.

Two launches per history segment (one kernel that dequantized every tile inside each 128-row program was
latency-bound at 2.4-2.6x SDPA flash on the H200):

1. ``prefill_dequant._dequant_kernel`` decompresses the segment's compressed tokens once into an fp16 workspace.
2. ``_prefill_kernel`` (here) runs a plain fp16 flash-attention loop over it (one program = BLOCK_M rows of one
   (sequence, KV head); a row is a (token, query head) pair, so the G query heads of a KV head share every
   tile): tiles every row reads whole without masks, then the tiles at the rows' window bound masked, then
   (last segment) the exact part — ring rows and the chunk itself — from fp16.

The workspace holds at most ``workspace_tokens`` tokens per (sequence, KV head); a longer history is processed in
segments, the running (acc, max, sum) of every row carried between the flash launches in an fp32 state buffer, so
extra memory stays bounded at any history. Compile-time facts come in one bundle, ``CFG`` (``PrefillConstexprs``).
This file holds the ``@triton.jit`` code only; sizing, the printable ``PrefillPlan`` and ``run`` are
``prefill_plan``. Same contract as ``attention.reference.paged_attention_prefill``.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from ._masking import add_sink, soft_cap, window_start
from ._tiles import mma, online_softmax
from .prefill_dequant import _window_lo


@dataclass(frozen=True)
class PrefillConstexprs:
    """What one flash launch fixes at compile time: the kernel's ``CFG`` bundle (``_common.constexpr_bundle``)."""

    HKV: int  # KV heads
    G: int  # query heads per KV head
    QW: int  # transformed query row width (D, or 2 D with S q)
    KW: int  # workspace key row width (DP, or 2 DP for prod keys)
    D: int  # head dim
    DP: int  # head dim padded to a power of two
    PROD: bool  # prod keys: a second score product against S q
    KQ_BF16: bool  # raw bf16 keys: the query operand in bf16
    BLOCK_WINDOW: bool  # window rule: own R-token block (else the last R)
    LOAD_STATE: bool  # start from the previous segment's running state
    FINAL: bool  # last segment: the exact part and the output (else store the running state)
    ALIGNED: bool  # reproducible mode: the exact part in position-aligned tiles (``_exact_aligned``)
    BLOCK_M: int  # rows (token, query head) per program
    BLOCK_N: int  # tokens per tile
    INTERP: bool  # Triton's CPU interpreter
    SINKS: bool = False  # per-query-head sink logits in the final denominator (``attention.extras``)
    SOFT_CAP: bool = False  # scores soft-capped
    WINDOW: bool = False  # a sliding window: nothing before a row's window start is read


@triton.jit
def _ws_load(base, rows, ld, j, COL: tl.constexpr, W: tl.constexpr, MASKED: tl.constexpr):
    """Columns [COL, COL + DP) of workspace ``rows`` (row width W), masked by ``ld`` or not at all."""
    if MASKED:
        x = tl.load(base + rows * W + COL + j, mask=ld, other=0.0)
    else:
        x = tl.load(base + rows * W + COL + j)
    return x


@triton.jit
def _workspace_tile(n0, s0, cend, lo, qk, qs, state, ws, xs, MASKED: tl.constexpr, CFG: tl.constexpr):
    """One flash step over the dequantized tokens [n0, n0 + BLOCK_N) (workspace rows n - s0). ``MASKED``: the tile
    may reach past ``cend``, past a row's window bound ``lo`` or (WINDOW) below a row's sliding-window start ``wlo``
    (rows below ``wmin``, every row's, are never loaded); otherwise every row reads all of it. ``state``: (acc, max,
    sum); ``ws``: the key and value workspace bases; ``xs``: (wlo, wmin, cap2)."""
    acc, m_i, l_i = state
    wk_base, wv_base = ws
    wlo, wmin, cap2 = xs
    n = n0 + tl.arange(0, CFG.BLOCK_N)
    j = tl.arange(0, CFG.DP)[None, :]
    rows = (n - s0)[:, None]
    ld = (n < cend)[:, None]
    if CFG.WINDOW:  # nothing below every row's window start is loaded
        ld = ld & (n >= wmin)[:, None]
    kt = _ws_load(wk_base, rows, ld, j, 0, CFG.KW, MASKED)
    s = mma(qk, tl.trans(kt), tl.zeros([qk.shape[0], CFG.BLOCK_N], tl.float32), CFG.INTERP)
    if CFG.PROD:
        s = mma(qs, tl.trans(_ws_load(wk_base, rows, ld, j, CFG.DP, CFG.KW, MASKED)), s, CFG.INTERP)
    s = soft_cap(s, cap2, CFG.SOFT_CAP)
    if MASKED:
        ok = (n[None, :] < cend) & (n[None, :] < lo[:, None])
        if CFG.WINDOW:
            ok = ok & (n[None, :] >= wlo[:, None])
        s = tl.where(ok, s, float("-inf"))
    m_i, alpha, p, l_i = online_softmax(s, m_i, l_i, 1)
    vt = _ws_load(wv_base, rows, ld, j, 0, CFG.DP, MASKED)
    acc = mma(p.to(vt.dtype), vt, acc * alpha[:, None], CFG.INTERP)
    return acc, m_i, l_i


@triton.jit
def _workspace_span(n_lo, n_hi, s0, cend, lo, qk, qs, state, ws, xs, MASKED: tl.constexpr, CFG: tl.constexpr):
    """``_workspace_tile`` over the tiles [n_lo, n_hi) (BLOCK_N each) into ``state`` (acc, max, sum); ``ws``: the
    key and value workspace bases, ``xs``: (row window starts, every row's, cap2) of the extras."""
    for n0 in range(n_lo, n_hi, CFG.BLOCK_N):
        state = _workspace_tile(n0, s0, cend, lo, qk, qs, state, ws, xs, MASKED, CFG)
    return state


@triton.jit
def _dense_part(
    src, t_start, n_tok, pos0, ring, rows, state, rk_ptr, rv_ptr, cap2, RING: tl.constexpr, CFG: tl.constexpr
):
    """Attend to uncompressed tokens [t_start, n_tok) whose positions lie in each row's exact window [lo, qpos]
    (``lo`` already raised to the row's sliding-window start):
    ring rows (RING: row t holds the position p >= pos0 with p % ring == t) or the chunk itself (position pos0 + t).
    ``src``: (key base, value base, key token stride, value token stride); ``rows``: (qpos, lo, raw query) of the
    rows; ``state``: their (acc, max, sum); ``rk_ptr``, ``rv_ptr``: the ring (its element types)."""
    k_base, v_base, skt, svt = src
    qpos, lo, qraw = rows
    acc, m_i, l_i = state
    j = tl.arange(0, CFG.DP)[None, :]
    for t0 in range(t_start, n_tok, CFG.BLOCK_N):
        t = t0 + tl.arange(0, CFG.BLOCK_N)
        if RING:
            pos = pos0 + ((t - pos0 % ring) % ring + ring) % ring
        else:
            pos = pos0 + t
        tmask = (t >= t_start) & (t < n_tok)
        tcol = t[:, None].to(tl.int64)
        ld = tmask[:, None] & (j < CFG.D)
        kt = tl.load(k_base + tcol * skt + j, mask=ld, other=0.0).to(rk_ptr.dtype.element_ty)  # as stored in the ring
        s = soft_cap(
            mma(qraw, tl.trans(kt), tl.zeros([qraw.shape[0], CFG.BLOCK_N], tl.float32), CFG.INTERP), cap2, CFG.SOFT_CAP
        )
        s = tl.where(tmask[None, :] & (pos[None, :] >= lo[:, None]) & (pos[None, :] <= qpos[:, None]), s, float("-inf"))
        m_i, alpha, p, l_i = online_softmax(s, m_i, l_i, 1)
        v = tl.load(v_base + tcol * svt + j, mask=ld, other=0.0).to(rv_ptr.dtype.element_ty)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], CFG.INTERP)
    return acc, m_i, l_i


@triton.jit
def _exact_aligned(ring_src, chunk_src, clen, hist, ring, p_start, p_end, rows, state, rk_ptr, cap2, CFG: tl.constexpr):
    """Reproducible mode's exact part: positions [p_start, p_end) in tiles aligned to multiples of CFG.BLOCK_N, each
    token taken from the ring (positions [clen, hist), column p % ring) or from the chunk (position hist + t), so a
    row meets the same tiles in the same order whatever chunk (or decode step) it arrives in. ``ring_src``,
    ``chunk_src``: (key base, value base, key token stride, value token stride); ``rows``, ``state``: as
    ``_dense_part``'s."""
    rk_base, rv_base, srkt, srvt = ring_src
    k_base, v_base, skt, svt = chunk_src
    qpos, lo, qraw = rows
    acc, m_i, l_i = state
    j = tl.arange(0, CFG.DP)[None, :]
    for p0 in range(tl.maximum(p_start, 0) // CFG.BLOCK_N * CFG.BLOCK_N, p_end, CFG.BLOCK_N):
        pos = p0 + tl.arange(0, CFG.BLOCK_N)
        in_ring = (pos >= clen) & (pos < hist)
        in_chunk = (pos >= hist) & (pos < p_end)
        rcol = (pos % ring).to(tl.int64)[:, None]
        tcol = tl.maximum(pos - hist, 0).to(tl.int64)[:, None]
        ldr = in_ring[:, None] & (j < CFG.D)
        ldc = in_chunk[:, None] & (j < CFG.D)
        kr = tl.load(rk_base + rcol * srkt + j, mask=ldr, other=0.0)
        kc = tl.load(k_base + tcol * skt + j, mask=ldc, other=0.0).to(rk_ptr.dtype.element_ty)
        kt = tl.where(in_ring[:, None], kr, kc)
        s = soft_cap(
            mma(qraw, tl.trans(kt), tl.zeros([qraw.shape[0], CFG.BLOCK_N], tl.float32), CFG.INTERP), cap2, CFG.SOFT_CAP
        )
        ok = (in_ring | in_chunk)[None, :] & (pos[None, :] >= lo[:, None]) & (pos[None, :] <= qpos[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_i, alpha, p, l_i = online_softmax(s, m_i, l_i, 1)
        vr = tl.load(rv_base + rcol * srvt + j, mask=ldr, other=0.0)
        vc = tl.load(v_base + tcol * svt + j, mask=ldc, other=0.0).to(vr.dtype)
        v = tl.where(in_ring[:, None], vr, vc)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], CFG.INTERP)
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(
    # ---- pointers
    qt_ptr,  # fp32 [B * Hq * T, QW]: transformed query rows (Pi q, S q) * scale * log2(e)
    q_ptr,  # [B, Hq, T, D]: the chunk's queries (the exact part scores them raw)
    k_ptr,  # [B, HKV, T, D]: the chunk's keys
    v_ptr,  # [B, HKV, T, D]: the chunk's values
    wk_ptr,  # [B * HKV, seg, KW]: dequantized keys of this segment (``_dequant_kernel``)
    wv_ptr,  # [B * HKV, seg, DP]: dequantized values
    st_ptr,  # fp32 [rows, DP + 4]: running state between segments: output [:DP], max [DP], sum [DP + 1]
    clen_ptr,  # int32 [B]: compressed tokens per sequence
    rk_ptr,  # [rows, HKV, R, D]: recent-buffer keys
    rv_ptr,  # [rows, HKV, R, D]: recent-buffer values
    rlen_ptr,  # int32 [B]: recent tokens per sequence
    ridx_ptr,  # int32 [B]: recent-buffer row of each sequence
    out_ptr,  # [B, Hq, T, D]: output
    sinks_ptr,  # fp32 [Hq]: sink logits (SINKS)
    # ---- segment and chunk sizes
    s0,  # first token of this segment
    seg,  # tokens per segment
    T,  # chunk tokens
    # ---- strides (elements): (sequence or buffer row, head, token) of each tensor (``prefill_plan.run``)
    q_strides,
    k_strides,
    v_strides,
    rk_strides,
    rv_strides,
    out_strides,
    # ---- scalars
    scale_log2,  # softmax scale * log2(e)
    ring,  # the recent window R
    cap2,  # soft cap * log2(e) (SOFT_CAP)
    window,  # sliding window W (WINDOW)
    # ---- compile time
    CFG: tl.constexpr,  # ``PrefillConstexprs`` bundle
):
    """Flash attention of BLOCK_M rows over workspace segment [s0, s0 + seg); ``CFG.FINAL``: then the exact part and
    the output, else the running state is stored; ``CFG.LOAD_STATE``: start from the previous segment's state."""
    pid_bh, pid_m = tl.program_id(0), tl.program_id(1)
    b = pid_bh // CFG.HKV
    h = pid_bh % CFG.HKV
    clen = tl.load(clen_ptr + b)
    rlen = tl.load(rlen_ptr + b)
    r = pid_m * CFG.BLOCK_M + tl.arange(0, CFG.BLOCK_M)  # rows = (token, query head of this KV head)
    rmask = r < T * CFG.G
    tok = r // CFG.G
    hq = h * CFG.G + r % CFG.G
    qrow = ((b * (CFG.HKV * CFG.G) + hq) * T + tok).to(tl.int64)  # row of the transformed query
    # window rule: the row at position qpos reads positions < lo compressed and [lo, qpos] exactly
    hist = clen + rlen
    qpos = hist + tok
    lo = _window_lo(qpos, ring, CFG.BLOCK_WINDOW)
    first_tok = pid_m * CFG.BLOCK_M // CFG.G
    last_tok = tl.minimum((pid_m * CFG.BLOCK_M + CFG.BLOCK_M - 1) // CFG.G, T - 1)
    lo_first = _window_lo(hist + first_tok, ring, CFG.BLOCK_WINDOW)  # lo grows with the token: the tile's bounds
    lo_last = _window_lo(hist + last_tok, ring, CFG.BLOCK_WINDOW)
    wlo = window_start(qpos, window, CFG.WINDOW)  # the sliding window's start of each row, of the first and last row
    wlo_first = window_start(hist + first_tok, window, CFG.WINDOW)
    wlo_last = window_start(hist + last_tok, window, CFG.WINDOW)
    KQ_T: tl.constexpr = tl.bfloat16 if CFG.KQ_BF16 else tl.float16

    # the transformed query (Pi q, and S q for prod keys), loaded once as tensor-core operands
    j = tl.arange(0, CFG.DP)[None, :]
    qmask = rmask[:, None] & (j < CFG.D)
    qk = tl.load(qt_ptr + qrow[:, None] * CFG.QW + j, mask=qmask, other=0.0).to(KQ_T)
    if CFG.PROD:
        qs = tl.load(qt_ptr + qrow[:, None] * CFG.QW + CFG.D + j, mask=qmask, other=0.0).to(tl.float16)
    else:
        qs = qk
    st_row = (pid_bh * tl.num_programs(1) + pid_m).to(tl.int64) * CFG.BLOCK_M + tl.arange(0, CFG.BLOCK_M)
    if CFG.LOAD_STATE:
        acc = tl.load(st_ptr + st_row[:, None] * (CFG.DP + 4) + j)
        m_i = tl.load(st_ptr + st_row * (CFG.DP + 4) + CFG.DP)
        l_i = tl.load(st_ptr + st_row * (CFG.DP + 4) + CFG.DP + 1)
    else:
        acc = tl.zeros([CFG.BLOCK_M, CFG.DP], tl.float32)
        m_i = tl.full([CFG.BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([CFG.BLOCK_M], tl.float32)

    # ---- compressed tokens of this segment (history and, past the window, the chunk), dequantized in the
    # workspace: tiles every row reads whole, then the tiles at the window edge (masked)
    wbase = pid_bh.to(tl.int64) * seg
    wk_base = wk_ptr + wbase * CFG.KW
    wv_base = wv_ptr + wbase * CFG.DP
    cend = tl.minimum(tl.maximum(lo_last, 0), s0 + seg)
    cfull = tl.minimum(tl.maximum(lo_first, 0) // CFG.BLOCK_N * CFG.BLOCK_N, cend)
    state, ws, xs = (acc, m_i, l_i), (wk_base, wv_base), (wlo, 0, cap2)
    wfull = s0
    if CFG.WINDOW:  # tiles below the last row's window start, masked; none below the first row's is touched
        wmin = tl.maximum(wlo_first, 0)
        w0 = tl.maximum(s0, wmin // CFG.BLOCK_N * CFG.BLOCK_N)
        wfull = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(wlo_last, 0), CFG.BLOCK_N) * CFG.BLOCK_N, w0), cend)
        xs = (wlo, wmin, cap2)
        state = _workspace_span(w0, wfull, s0, cend, lo, qk, qs, state, ws, xs, True, CFG)
    state = _workspace_span(wfull, cfull, s0, cend, lo, qk, qs, state, ws, xs, False, CFG)
    c0 = tl.maximum(cfull, wfull)
    state = _workspace_span(c0, cend, s0, cend, lo, qk, qs, state, ws, xs, True, CFG)
    acc, m_i, l_i = state

    if CFG.FINAL:
        # ---- the exact window: ring rows, then the chunk itself (both uncompressed)
        stride_qb, stride_qh, stride_qt = q_strides
        qraw = (
            tl.load(
                q_ptr
                + b.to(tl.int64) * stride_qb
                + hq[:, None].to(tl.int64) * stride_qh
                + tok[:, None].to(tl.int64) * stride_qt
                + j,
                mask=qmask,
                other=0.0,
            ).to(tl.float32)
            * scale_log2
        ).to(rk_ptr.dtype.element_ty)
        ridx = tl.load(ridx_ptr + b).to(tl.int64)
        if CFG.WINDOW:  # the exact part reads [max(lo, wlo), qpos]
            lo = tl.maximum(lo, wlo)
            lo_first = tl.maximum(lo_first, wlo_first)
        stride_rkn, stride_rkh, stride_rkt = rk_strides
        stride_rvn, stride_rvh, stride_rvt = rv_strides
        stride_kb, stride_kh, stride_kt = k_strides
        stride_vb, stride_vh, stride_vt = v_strides
        ring_src = (
            rk_ptr + ridx * stride_rkn + h.to(tl.int64) * stride_rkh,
            rv_ptr + ridx * stride_rvn + h.to(tl.int64) * stride_rvh,
            stride_rkt,
            stride_rvt,
        )
        chunk_src = (
            k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh,
            v_ptr + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh,
            stride_kt,
            stride_vt,
        )
        rows, state = (qpos, lo, qraw), (acc, m_i, l_i)
        if CFG.ALIGNED:
            p_end = hist + last_tok + 1
            state = _exact_aligned(
                ring_src, chunk_src, clen, hist, tl.maximum(ring, 1), lo_first, p_end, rows, state, rk_ptr, cap2, CFG
            )
        else:
            ring_rows = tl.where(lo_first < hist, rlen, 0)  # skip the ring once the window left it
            state = _dense_part(
                ring_src, 0, ring_rows, clen, tl.maximum(ring, 1), rows, state, rk_ptr, rv_ptr, cap2, True, CFG
            )
            t_start = tl.maximum(lo_first - hist, 0) // CFG.BLOCK_N * CFG.BLOCK_N
            state = _dense_part(
                chunk_src, t_start, last_tok + 1, hist, 1, rows, state, rk_ptr, rv_ptr, cap2, False, CFG
            )
        acc, m_i, l_i = state
        l_i = add_sink(l_i, m_i, sinks_ptr, hq, rmask, CFG.SINKS)
        inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        stride_ob, stride_oh, stride_ot = out_strides
        optr = (
            out_ptr
            + b.to(tl.int64) * stride_ob
            + hq[:, None].to(tl.int64) * stride_oh
            + tok[:, None].to(tl.int64) * stride_ot
            + j
        )
        tl.store(optr, (acc * inv[:, None]).to(out_ptr.dtype.element_ty), mask=qmask)
    else:
        tl.store(st_ptr + st_row[:, None] * (CFG.DP + 4) + j, acc)
        tl.store(st_ptr + st_row * (CFG.DP + 4) + CFG.DP, m_i)
        tl.store(st_ptr + st_row * (CFG.DP + 4) + CFG.DP + 1, l_i)
