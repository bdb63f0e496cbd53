"""Fused hybrid decode, the exact tokens' steps (``@triton.jit`` helpers of ``hybrid_decode``'s kernel).

The recent buffer's uncompressed tokens into the same online softmax as the compressed ones (``_recent_tokens``),
and the multi-token form's (CFG.NEW, speculative verification rows) pieces: each row's query offsets
(``_row_offsets``), its window rule (``_exact_start``, ``_draft_bounds``: which positions it reads compressed and
which exactly) and its exact tokens, ring rows and the new tokens alike (``_exact_rows``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._masking import soft_cap, window_start
from ._tiles import TWO24, mma, online_softmax, value_unit


@triton.jit
def _recent_tokens(
    q,
    rk,
    rv,
    ridx_ptr,
    tile,
    vu,
    r0,
    r1,
    scale_log2,
    state,
    PAGE: tl.constexpr,
    CFG: tl.constexpr,
    pos0=0,
    rows=1,
    wlo=0,
    cap2=1.0,
):
    """Recent-buffer tokens [r0, r1) of sequence ``b`` (exact keys and values, scored with the raw query), BLOCK_R
    per step, into the same online softmax ``state`` (m_i, l_i, acc, zacc) -> the new state. Row t holds position
    pos0 + (t - pos0) mod ``rows`` (the buffer's capacity R: token p in row p % R); under CFG.WINDOW positions
    before ``wlo`` are masked, under CFG.SOFT_CAP scores capped (``cap2``, log2 domain).

    ``q``: (query pointer, sequence stride, head stride); ``rk``, ``rv``: the buffer's keys and values as (pointer,
    row stride, head stride, token stride), row ``ridx_ptr[b]``; ``tile``: the program's (sequence b, KV head h,
    query-tile rows g, their mask)."""
    q_ptr, stride_qb, stride_qh = q
    rk_ptr, stride_rkn, stride_rkh, stride_rkt = rk
    rv_ptr, stride_rvn, stride_rvh, stride_rvt = rv
    b, h, g, gmask = tile
    m_i, l_i, acc, zacc = state
    ridx = tl.load(ridx_ptr + b).to(tl.int64)
    d = tl.arange(0, PAGE.DP)
    qb = (
        tl.load(
            q_ptr + b.to(tl.int64) * stride_qb + (h * CFG.G + g)[None, :].to(tl.int64) * stride_qh + d[:, None],
            mask=gmask[None, :] & (d[:, None] < PAGE.D),
            other=0.0,
        ).to(tl.float32)
        * scale_log2
    )
    rk_base = rk_ptr + ridx * stride_rkn + h.to(tl.int64) * stride_rkh
    rv_base = rv_ptr + ridx * stride_rvn + h.to(tl.int64) * stride_rvh
    for t0 in range(r0, r1, CFG.BLOCK_R):
        t = t0 + tl.arange(0, CFG.BLOCK_R)
        tmask = t < r1
        k = tl.load(
            rk_base + t[:, None].to(tl.int64) * stride_rkt + d[None, :],
            mask=tmask[:, None] & (d[None, :] < PAGE.D),
            other=0.0,
        )
        s = soft_cap(
            mma(k, qb.to(k.dtype), tl.zeros([CFG.BLOCK_R, CFG.GP], tl.float32), CFG.INTERP), cap2, CFG.SOFT_CAP
        )
        if CFG.WINDOW:
            tmask = tmask & (pos0 + ((t - pos0) % rows + rows) % rows >= wlo)
        s = tl.where(tmask[:, None], s, float("-inf"))
        m_i, alpha, p, l_i = online_softmax(s, m_i, l_i, 0, True)
        zacc = zacc * alpha[None, :]
        new_acc = ()
        for c in tl.static_range(PAGE.VCH):
            for j in tl.static_range(CFG.VSC):
                rcol = c * PAGE.VCW + j * CFG.VSUB + vu
                v = tl.load(
                    rv_base + t[None, :].to(tl.int64) * stride_rvt + rcol[:, None],
                    mask=tmask[None, :] & (vu[:, None] < CFG.VSUB) & (rcol[:, None] < PAGE.D),
                    other=0.0,
                )
                pv = mma(v, p.to(v.dtype), tl.zeros([CFG.VSUBP, CFG.GP], tl.float32), CFG.INTERP)
                if CFG.FAST_V:  # the fast-path accumulators hold values * u * 2^-24 (``value_unit``)
                    pv = pv * (value_unit(c, PAGE) / TWO24)
                new_acc = new_acc + (acc[c * CFG.VSC + j] * alpha[None, :] + pv,)
        acc = new_acc
    return m_i, l_i, acc, zacc


@triton.jit
def _row_offsets(b, h, g, stride_t, stride_h, CFG: tl.constexpr):
    """CFG.NEW: element offsets [GP] of the rows' (query token g // G, query head h G + g % G) of sequence ``b`` in
    a [B * QN, Hq, D] tensor with token stride ``stride_t`` and head stride ``stride_h``."""
    return (b * CFG.QN + g // CFG.G).to(tl.int64) * stride_t + (h * CFG.G + g % CFG.G).to(tl.int64) * stride_h


@triton.jit
def _exact_start(pos, CFG: tl.constexpr):
    """``format.exact_start`` with the plan's ring (CFG.XR, CFG.BLOCKW): the first position a query at ``pos`` reads
    exactly (pos + 1 without a ring: everything compressed)."""
    if CFG.XR == 0:
        return pos + 1
    if CFG.BLOCKW:
        return pos - pos % CFG.XR
    return pos + 1 - CFG.XR


@triton.jit
def _draft_bounds(clen, hist, g, window, CFG: tl.constexpr):
    """CFG.NEW, a sequence with ``hist`` history tokens: (each row's position [GP], the first position it reads
    exactly, the first it reads at all (sliding window), the end of the compressed positions any row reads, the
    first position any row reads). Query token i sits at hist + i; positions in [lo, elo) are read compressed (the
    pages hold every token, the new ones too), [max(elo, lo), pos] exactly (the ring holds [elo, hist) of every row:
    R >= QN)."""
    pos = hist + g // CFG.G
    elo = _exact_start(pos, CFG)
    lo = window_start(pos, window, CFG.WINDOW)
    last = hist + CFG.QN - 1
    cend = tl.maximum(clen, tl.minimum(_exact_start(last, CFG), last + 1))
    return pos, elo, lo, cend, window_start(hist, window, CFG.WINDOW)


@triton.jit
def _exact_rows(
    rows,
    reads,
    tokens,
    ring_ptr,
    t0,
    t1,
    pos0,
    ring,
    vu,
    scale_log2,
    cap2,
    state,
    PAGE: tl.constexpr,
    CFG: tl.constexpr,
    RING: tl.constexpr,
):
    """CFG.NEW: exact tokens t in [t0, t1) into the online softmax ``state`` -> the new state, query row r reading
    those whose position lies in [xlo[r], xhi[r]]. ``rows``: (query pointer, the rows' offsets ``_row_offsets``,
    their mask); ``reads``: (xlo, xhi); ``tokens``: (k_base, v_base, stride_kt, stride_vt), token t's key at
    k_base + t * stride_kt and its value at v_base + t * stride_vt. RING: ring rows (position pos0 + (t - pos0) mod
    ``ring``), else the new tokens (position pos0 + t), cast to the ring's dtype (``ring_ptr``'s) as the ring would
    store them."""
    q_ptr, qoff, gmask = rows
    xlo, xhi = reads
    k_base, v_base, stride_kt, stride_vt = tokens
    m_i, l_i, acc, zacc = state
    d = tl.arange(0, PAGE.DP)
    qb = (
        tl.load(q_ptr + qoff[None, :] + d[:, None], mask=gmask[None, :] & (d[:, None] < PAGE.D), other=0.0).to(
            tl.float32
        )
        * scale_log2
    )
    for tb in range(t0, t1, CFG.BLOCK_R):
        t = tb + tl.arange(0, CFG.BLOCK_R)
        tmask = t < t1
        k = tl.load(
            k_base + t[:, None].to(tl.int64) * stride_kt + d[None, :],
            mask=tmask[:, None] & (d[None, :] < PAGE.D),
            other=0.0,
        ).to(ring_ptr.dtype.element_ty)
        s = soft_cap(
            mma(k, qb.to(k.dtype), tl.zeros([CFG.BLOCK_R, CFG.GP], tl.float32), CFG.INTERP), cap2, CFG.SOFT_CAP
        )
        if RING:
            p_t = pos0 + ((t - pos0) % ring + ring) % ring
        else:
            p_t = pos0 + t
        ok = tmask[:, None] & (p_t[:, None] >= xlo[None, :]) & (p_t[:, None] <= xhi[None, :])
        s = tl.where(ok, s, float("-inf"))
        m_i, alpha, p, l_i = online_softmax(s, m_i, l_i, 0, True)
        zacc = zacc * alpha[None, :]
        new_acc = ()
        for c in tl.static_range(PAGE.VCH):
            for j in tl.static_range(CFG.VSC):
                rcol = c * PAGE.VCW + j * CFG.VSUB + vu
                v = tl.load(
                    v_base + t[None, :].to(tl.int64) * stride_vt + rcol[:, None],
                    mask=tmask[None, :] & (vu[:, None] < CFG.VSUB) & (rcol[:, None] < PAGE.D),
                    other=0.0,
                ).to(ring_ptr.dtype.element_ty)
                pv = mma(v, p.to(v.dtype), tl.zeros([CFG.VSUBP, CFG.GP], tl.float32), CFG.INTERP)
                if CFG.FAST_V:  # the fast-path accumulators hold values * u * 2^-24 (``value_unit``)
                    pv = pv * (value_unit(c, PAGE) / TWO24)
                new_acc = new_acc + (acc[c * CFG.VSC + j] * alpha[None, :] + pv,)
        acc = new_acc
    return m_i, l_i, acc, zacc
