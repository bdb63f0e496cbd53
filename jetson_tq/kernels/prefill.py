"""Chunked prefill: a chunk of T query tokens per sequence over the compressed tokens, the recent ring
and (causally) the chunk's own fp16 keys/values, under decode's window rule (``format.exact_start``, mirrored
by ``_window_lo``): a query at position p reads positions older than p + 1 - R (sliding) or than its own
R-token block p - p % R (BLOCK_WINDOW) compressed (history and chunk alike: the pages already hold the chunk)
and the rest exactly.

Two launches per history segment (H200 run 8: the run-7 kernel, which dequantized every tile inside each
128-row program, was latency-bound at 2.4-2.6x SDPA flash):

1. ``_dequant_kernel`` decompresses the segment's compressed tokens once into an fp16 workspace: keys in the
   rotated domain with the norm folded in (``||k|| c[idx]``; prod keys also ``qjl ||r|| signs``, scored
   against S q), values ``code * scale + zero`` (mse values rotated back: ``||v|| Pi_v^T c[idx]``).
2. ``_prefill_kernel`` runs a plain fp16 flash-attention loop over it (one program = BLOCK_M rows of one
   (sequence, KV head); a row is a (token, query head) pair, so the G query heads of a KV head share every
   tile): tiles every row reads whole without masks, then the tiles at the rows' window bound masked, then
   (last segment) the exact part — ring rows and the chunk itself — from fp16.

The workspace holds at most ``workspace_tokens`` tokens per (sequence, KV head) (default: what fits in
``WORKSPACE_BYTES``); a longer history is processed in segments, the running (acc, max, sum) of every row
carried between the flash launches in an fp32 state buffer, so extra memory stays bounded at any history.
Same contract as ``attention.reference.paged_attention_prefill``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..attention.extras import NO_EXTRAS, AttentionExtras
from ..errors import DTypeError, ShapeError, expect_same_device
from ..format import PREFILL_WORKSPACE_BYTES
from ..paged import PagedKV
from ._common import (
    INTERPRET,
    KEY_PROD,
    KEY_RAW,
    LOG2E,
    VAL_RAW,
    codec_constants,
    cuda_or_interpreter,
    klt_constants,
    page_spec,
)
from ._launch import FastLauncher
from ._masking import add_sink, extras_args, extras_flags, soft_cap, window_start
from ._tiles import (
    K_KLT,
    K_PROD,
    K_RAW,
    V_GROUP,
    V_MSE,
    V_RAW,
    centroid_lookup,
    field_tile,
    klt_keys,
    klt_levels,
    klt_operands,
    load_norms,
    mma,
    online_softmax,
    rope_cos_sin,
    run_bits,
    unrotate_rows,
)
from .query_transform import query_transform


@triton.jit
def _window_lo(pos, ring, BLOCK_WINDOW: tl.constexpr):
    """First position a query at ``pos`` reads exactly (``format.exact_start``; ring >= 1 under BLOCK_WINDOW)."""
    if BLOCK_WINDOW:
        return pos - pos % ring
    return pos + 1 - ring


@triton.jit
def _dequant_kernel(
    # ---- pointers
    pages_ptr,  # uint8 [blocks, HKV, PB]: the compressed pages
    bt_ptr,  # int32 [B, table width]: block table
    clen_ptr,  # int32 [B]: compressed tokens per sequence
    rlen_ptr,  # int32 [B]: recent tokens per sequence
    cb_ptr,  # fp32: key codebook
    vcb_ptr,  # fp32: value codebook (mse values)
    vpi_ptr,  # fp32 [D, D]: the value rotation Pi_v (mse values)
    klt_meta_ptr,  # klt keys (``_common.klt_constants``' read arguments): code bit offsets and widths
    klt_lv_ptr,  # level tables, or cubic levels' coefficients (KLT.CUBIC)
    klt_dec_ptr,  # decode matrix
    klt_mean_ptr,  # mean
    klt_turns_ptr,  # RoPE frequencies
    wk_ptr,  # [B * HKV, seg, KW]: key workspace
    wv_ptr,  # [B * HKV, seg, DP]: value workspace
    # ---- sizes, strides, scalars
    s0,  # first token of this segment
    seg,  # tokens per segment (workspace rows per (sequence, KV head))
    T,  # chunk tokens
    ring,  # the recent window R
    stride_bt,
    qjl_scale,  # sqrt(pi / 2) / D
    klt_scale,  # klt keys: RoPE's attention scaling
    window,  # the sliding window W (WINDOW)
    # ---- compile time
    HKV: tl.constexpr,  # KV heads
    KW: tl.constexpr,  # workspace key row width: DP, or 2 DP for prod keys (signs at DP)
    BLOCK_WINDOW: tl.constexpr,  # window rule: own R-token block (else the last R)
    WINDOW: tl.constexpr,  # a sliding window: tokens before the first row's window start are never read
    BLOCK_T: tl.constexpr,  # tokens per program
    TOKEN_MAJOR: tl.constexpr,  # workspace rows ordered (sequence, token, KV head), else (sequence, KV head, token)
    PAGE: tl.constexpr,  # ``PageSpec`` bundle
    KLT: tl.constexpr,  # ``KltSpec`` bundle
    INTERP: tl.constexpr,
):
    """Compressed tokens [s0, s0 + seg) of one (sequence, KV head) that any chunk row reads (positions below the last
    row's window bound) -> workspace rows n - s0: key [KW] (fp16 ||k|| c[idx]; prod: then qjl ||r|| signs at DP;
    klt: the post-RoPE key),
    value [DP] (code * scale + zero; mse values in the original domain, ||v|| Pi_v^T c[idx]); padding columns zero.
    ``TOKEN_MAJOR`` lays the rows out as the paged [pages, page tokens, KV heads, DP] cache an external
    flash-attention kernel reads (``prefill_flash``)."""
    D: tl.constexpr = PAGE.D
    DP: tl.constexpr = PAGE.DP
    CH: tl.constexpr = PAGE.CH
    pid_bh, pid_t = tl.program_id(0), tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    hist = tl.load(clen_ptr + b) + tl.load(rlen_ptr + b)
    cend = tl.minimum(tl.maximum(_window_lo(hist + T - 1, ring, BLOCK_WINDOW), 0), s0 + seg)
    n = s0 + pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    live = s0 + pid_t * BLOCK_T < cend
    if WINDOW:  # nothing before the first chunk row's window start is read
        wmin = window_start(hist, window, WINDOW)
        live = live & (s0 + pid_t * BLOCK_T + BLOCK_T > wmin)
    if live:
        RAW_T: tl.constexpr = tl.bfloat16 if PAGE.RAW_BF16 else tl.float16
        j = tl.arange(0, DP)[None, :]
        nmask = n < cend
        if WINDOW:
            nmask = nmask & (n >= wmin)
        blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + n // PAGE.BS, mask=nmask, other=0)
        base = pages_ptr + (blk.to(tl.int64) * (HKV * PAGE.PB) + h.to(tl.int64) * PAGE.PB)  # [BLOCK_T] token pages
        offn = n % PAGE.BS
        page = base[:, None]
        off = offn[:, None]
        tmask = nmask[:, None] & (j < D)
        if TOKEN_MAJOR:
            row1 = (b.to(tl.int64) * seg + (n - s0).to(tl.int64)) * HKV + h
        else:
            row1 = pid_bh.to(tl.int64) * seg + (n - s0).to(tl.int64)
        row = row1[:, None]
        kdst = wk_ptr + row * KW + j
        if PAGE.KEY_MODE == K_RAW:
            kt = tl.load((page + PAGE.OFF_KRAW + off * (2 * D)).to(tl.pointer_type(RAW_T)) + j, mask=tmask, other=0.0)
        elif PAGE.KEY_MODE == K_KLT:
            _klt_workspace_keys(
                base + PAGE.OFF_KCODE + offn * PAGE.KCB,
                nmask,
                n,
                h,
                wk_ptr + row1 * KW,
                klt_meta_ptr,
                klt_lv_ptr,
                klt_dec_ptr,
                klt_mean_ptr,
                klt_turns_ptr,
                klt_scale,
                PAGE,
                KLT,
                INTERP,
            )
        else:
            code = field_tile(page + PAGE.OFF_KIDX + off * (CH * PAGE.KB), tmask, j, CH, PAGE.KW0, PAGE.KW1, PAGE.KW2)
            knorm = load_norms(base + PAGE.OFF_KNORM, offn, nmask, PAGE.NORM_F32)
            cent = centroid_lookup(code, cb_ptr, PAGE.KB, 1).to(tl.float32)  # the rotated unit key
            kt = tl.where(j < D, cent * knorm[:, None], 0.0).to(tl.float16)
            if PAGE.KEY_MODE == K_PROD:  # qjl * ||r|| * signs as +-1, scored against S q
                rnorm = load_norms(base + PAGE.OFF_KRNORM, offn, nmask, PAGE.NORM_F32)
                sgn = (2 * run_bits(page + PAGE.OFF_KSGN + off * CH, tmask, j, CH, 1) - 1).to(tl.float32)
                ks = tl.where(j < D, sgn * (qjl_scale * rnorm)[:, None], 0.0)
                tl.store(kdst + DP, ks.to(wk_ptr.dtype.element_ty), mask=nmask[:, None])
        if PAGE.KEY_MODE != K_KLT:
            tl.store(kdst, kt.to(wk_ptr.dtype.element_ty), mask=nmask[:, None])
        if PAGE.VAL_MODE == V_RAW:
            vt = tl.load((page + PAGE.OFF_VRAW + off * (2 * D)).to(tl.pointer_type(RAW_T)) + j, mask=tmask, other=0.0)
        elif PAGE.VAL_MODE == V_GROUP:
            code = field_tile(page + PAGE.OFF_VCODES + off * (CH * PAGE.VB), tmask, j, CH, PAGE.VW0, PAGE.VW1, PAGE.VW2)
            srow = (page + PAGE.OFF_VSCALE + off * (2 * PAGE.NG)).to(tl.pointer_type(tl.float16))
            zrow = (page + PAGE.OFF_VZERO + off * (2 * PAGE.NG)).to(tl.pointer_type(tl.float16))
            rmask = nmask[:, None]
            vs = tl.load(srow, mask=rmask, other=0.0).to(tl.float32)
            vz = tl.load(zrow, mask=rmask, other=0.0).to(tl.float32)
            for g in tl.static_range(1, PAGE.NG):  # per-token scale / zero of each coordinate's group
                sel = (j // PAGE.GROUP) == g
                vs = tl.where(sel, tl.load(srow + g, mask=rmask, other=0.0).to(tl.float32), vs)
                vz = tl.where(sel, tl.load(zrow + g, mask=rmask, other=0.0).to(tl.float32), vz)
            vt = tl.where(j < D, code.to(tl.float32) * vs + vz, 0.0)
        else:  # mse: the fp32 centroids rotated back, ||v|| Pi_v^T c[idx], stored a block of columns at a time
            code = field_tile(page + PAGE.OFF_VIDX + off * (CH * PAGE.VB), tmask, j, CH, PAGE.VW0, PAGE.VW1, PAGE.VW2)
            vnorm = load_norms(base + PAGE.OFF_VNORM, offn, nmask, PAGE.NORM_F32)
            cent = tl.load(vcb_ptr + code)
            UW: tl.constexpr = _unrotate_width(DP)
            for u in tl.static_range(DP // UW):
                vt = unrotate_rows(cent, vpi_ptr, u * UW, UW, D, DP) * vnorm[:, None]
                cols = u * UW + tl.arange(0, UW)[None, :]
                tl.store(wv_ptr + row * DP + cols, vt.to(wv_ptr.dtype.element_ty), mask=nmask[:, None])
        if PAGE.VAL_MODE != V_MSE:
            tl.store(wv_ptr + row * DP + j, vt.to(wv_ptr.dtype.element_ty), mask=nmask[:, None])


@triton.constexpr_function
def _unrotate_width(dp):
    """Workspace columns of mse values rotated back per product: at most 64 (an fp32 [DP, 64] operand)."""
    return min(dp, 64)


@triton.jit
def _klt_workspace_keys(
    rows,
    nmask,
    n,
    h,
    dst,
    meta_ptr,
    lv_ptr,
    dec_ptr,
    mean_ptr,
    turns_ptr,
    scale,
    PAGE: tl.constexpr,
    KLT: tl.constexpr,
    INTERP: tl.constexpr,
):
    """klt keys at positions ``n`` [N] (codes at byte pointers ``rows``) decoded to post-RoPE keys in the workspace
    rows starting at ``dst`` [N]: channels in their own order, padding columns zero."""
    cops, dops = klt_operands(h, meta_ptr, lv_ptr, dec_ptr, mean_ptr, PAGE, KLT)
    z = klt_levels(rows, nmask, cops, PAGE, KLT, INTERP)
    ia = tl.arange(0, KLT.RHP)
    ir = tl.arange(0, KLT.RRP)
    cos, sin = rope_cos_sin(n[None, :], tl.load(turns_ptr + ia)[:, None])
    ka, kb, kr = klt_keys(z, cos * scale, sin * scale, dops, KLT, INTERP)
    ty = dst.dtype.element_ty
    cols = dst[None, :]  # the keys are [channels, tokens]
    tmask = nmask[None, :]
    tl.store(cols + ia[:, None], ka.to(ty), mask=tmask & (ia < KLT.RH)[:, None])
    tl.store(cols + KLT.RH + ia[:, None], kb.to(ty), mask=tmask & (ia < KLT.RH)[:, None])
    if KLT.RR > 0:
        tl.store(cols + 2 * KLT.RH + ir[:, None], kr.to(ty), mask=tmask & (ir < KLT.RR)[:, None])
    j = tl.arange(0, PAGE.DP)
    if PAGE.D < PAGE.DP:
        tl.store(
            dst[:, None] + j[None, :], tl.zeros([n.shape[0], PAGE.DP], ty), mask=nmask[:, None] & (j >= PAGE.D)[None, :]
        )


@triton.jit
def _ws_load(base, rows, ld, j, COL: tl.constexpr, W: tl.constexpr, MASKED: tl.constexpr):
    """Columns [COL, COL + DP) of workspace ``rows`` (row width W), masked by ``ld`` or not at all."""
    if MASKED:
        x = tl.load(base + rows * W + COL + j, mask=ld, other=0.0)
    else:
        x = tl.load(base + rows * W + COL + j)
    return x


@triton.jit
def _workspace_tile(
    n0,
    s0,
    cend,
    lo,
    qk,
    qs,
    state,
    ws,
    xs,
    KW: tl.constexpr,
    DP: tl.constexpr,
    PROD: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERP: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """One flash step over the dequantized tokens [n0, n0 + BLOCK_N) (workspace rows n - s0). ``MASKED``: the tile
    may reach past ``cend``, past a row's window bound ``lo`` or (WINDOW) below a row's sliding-window start ``wlo``
    (rows below ``wmin``, every row's, are never loaded); otherwise every row reads all of it. ``state``: (acc, max,
    sum); ``ws``: the key and value workspace bases; ``xs``: (wlo, wmin, cap2)."""
    acc, m_i, l_i = state
    wk_base, wv_base = ws
    wlo, wmin, cap2 = xs
    n = n0 + tl.arange(0, BLOCK_N)
    j = tl.arange(0, DP)[None, :]
    rows = (n - s0)[:, None]
    ld = (n < cend)[:, None]
    if WINDOW:  # nothing below every row's window start is loaded
        ld = ld & (n >= wmin)[:, None]
    kt = _ws_load(wk_base, rows, ld, j, 0, KW, MASKED)
    s = mma(qk, tl.trans(kt), tl.zeros([qk.shape[0], BLOCK_N], tl.float32), INTERP)
    if PROD:
        s = mma(qs, tl.trans(_ws_load(wk_base, rows, ld, j, DP, KW, MASKED)), s, INTERP)
    s = soft_cap(s, cap2, SOFT_CAP)
    if MASKED:
        ok = (n[None, :] < cend) & (n[None, :] < lo[:, None])
        if WINDOW:
            ok = ok & (n[None, :] >= wlo[:, None])
        s = tl.where(ok, s, float("-inf"))
    m_i, alpha, p, l_i = online_softmax(s, m_i, l_i, 1)
    vt = _ws_load(wv_base, rows, ld, j, 0, DP, MASKED)
    acc = mma(p.to(vt.dtype), vt, acc * alpha[:, None], INTERP)
    return acc, m_i, l_i


@triton.jit
def _workspace_span(
    n_lo,
    n_hi,
    s0,
    cend,
    lo,
    qk,
    qs,
    state,
    ws,
    xs,
    KW: tl.constexpr,
    DP: tl.constexpr,
    PROD: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERP: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """``_workspace_tile`` over the tiles [n_lo, n_hi) (BLOCK_N each) into ``state`` (acc, max, sum); ``ws``: the
    key and value workspace bases, ``xs``: (row window starts, every row's, cap2) of the extras."""
    for n0 in range(n_lo, n_hi, BLOCK_N):
        state = _workspace_tile(
            n0, s0, cend, lo, qk, qs, state, ws, xs, KW, DP, PROD, MASKED, BLOCK_N, INTERP, SOFT_CAP, WINDOW
        )
    return state


@triton.jit
def _dense_part(
    k_base,
    v_base,
    skt,
    svt,
    t_start,
    n_tok,
    pos0,
    ring,
    RING: tl.constexpr,
    qpos,
    lo,
    qraw,
    acc,
    m_i,
    l_i,
    rk_ptr,
    rv_ptr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERP: tl.constexpr,
    cap2=1.0,
    SOFT_CAP: tl.constexpr = False,
):
    """Attend to uncompressed tokens [t_start, n_tok) whose positions lie in each row's exact window [lo, qpos]
    (``lo`` already raised to the row's sliding-window start):
    ring rows (RING: row t holds the position p >= pos0 with p % ring == t) or the chunk itself (position pos0 + t)."""
    j = tl.arange(0, DP)[None, :]
    for t0 in range(t_start, n_tok, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        if RING:
            pos = pos0 + ((t - pos0 % ring) % ring + ring) % ring
        else:
            pos = pos0 + t
        tmask = (t >= t_start) & (t < n_tok)
        tcol = t[:, None].to(tl.int64)
        ld = tmask[:, None] & (j < D)
        kt = tl.load(k_base + tcol * skt + j, mask=ld, other=0.0).to(rk_ptr.dtype.element_ty)  # as stored in the ring
        s = soft_cap(mma(qraw, tl.trans(kt), tl.zeros([qraw.shape[0], BLOCK_N], tl.float32), INTERP), cap2, SOFT_CAP)
        s = tl.where(tmask[None, :] & (pos[None, :] >= lo[:, None]) & (pos[None, :] <= qpos[:, None]), s, float("-inf"))
        m_i, alpha, p, l_i = online_softmax(s, m_i, l_i, 1)
        v = tl.load(v_base + tcol * svt + j, mask=ld, other=0.0).to(rv_ptr.dtype.element_ty)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], INTERP)
    return acc, m_i, l_i


@triton.jit
def _exact_aligned(
    rk_base,
    rv_base,
    srkt,
    srvt,
    k_base,
    v_base,
    skt,
    svt,
    clen,
    hist,
    ring,
    p_start,
    p_end,
    qpos,
    lo,
    qraw,
    acc,
    m_i,
    l_i,
    rk_ptr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERP: tl.constexpr,
    cap2=1.0,
    SOFT_CAP: tl.constexpr = False,
):
    """Reproducible mode's exact part: positions [p_start, p_end) in tiles aligned to multiples of BLOCK_N, each
    token taken from the ring (positions [clen, hist), column p % ring) or from the chunk (position hist + t), so a
    row meets the same tiles in the same order whatever chunk (or decode step) it arrives in."""
    j = tl.arange(0, DP)[None, :]
    for p0 in range(tl.maximum(p_start, 0) // BLOCK_N * BLOCK_N, p_end, BLOCK_N):
        pos = p0 + tl.arange(0, BLOCK_N)
        in_ring = (pos >= clen) & (pos < hist)
        in_chunk = (pos >= hist) & (pos < p_end)
        rcol = (pos % ring).to(tl.int64)[:, None]
        tcol = tl.maximum(pos - hist, 0).to(tl.int64)[:, None]
        ldr = in_ring[:, None] & (j < D)
        ldc = in_chunk[:, None] & (j < D)
        kr = tl.load(rk_base + rcol * srkt + j, mask=ldr, other=0.0)
        kc = tl.load(k_base + tcol * skt + j, mask=ldc, other=0.0).to(rk_ptr.dtype.element_ty)
        kt = tl.where(in_ring[:, None], kr, kc)
        s = soft_cap(mma(qraw, tl.trans(kt), tl.zeros([qraw.shape[0], BLOCK_N], tl.float32), INTERP), cap2, SOFT_CAP)
        ok = (in_ring | in_chunk)[None, :] & (pos[None, :] >= lo[:, None]) & (pos[None, :] <= qpos[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_i, alpha, p, l_i = online_softmax(s, m_i, l_i, 1)
        vr = tl.load(rv_base + rcol * srvt + j, mask=ldr, other=0.0)
        vc = tl.load(v_base + tcol * svt + j, mask=ldc, other=0.0).to(vr.dtype)
        v = tl.where(in_ring[:, None], vr, vc)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], INTERP)
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
    st_acc_ptr,  # fp32 [rows, DP]: running output between segments
    st_m_ptr,  # fp32 [rows]: running max
    st_l_ptr,  # fp32 [rows]: running sum
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
    # ---- strides (elements)
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_rkn,
    stride_rkh,
    stride_rkt,
    stride_rvn,
    stride_rvh,
    stride_rvt,
    stride_ob,
    stride_oh,
    stride_ot,
    # ---- scalars
    scale_log2,  # softmax scale * log2(e)
    ring,  # the recent window R
    cap2,  # soft cap * log2(e) (SOFT_CAP)
    window,  # sliding window W (WINDOW)
    # ---- compile time
    HKV: tl.constexpr,  # KV heads
    G: tl.constexpr,  # query heads per KV head
    QW: tl.constexpr,  # transformed query row width (D, or 2 D with S q)
    KW: tl.constexpr,  # workspace key row width (DP, or 2 DP for prod keys)
    D: tl.constexpr,  # head dim
    DP: tl.constexpr,  # head dim padded to a power of two
    PROD: tl.constexpr,  # prod keys: a second score product against S q
    KQ_BF16: tl.constexpr,  # raw bf16 keys: the query operand in bf16
    BLOCK_WINDOW: tl.constexpr,  # window rule: own R-token block (else the last R)
    LOAD_STATE: tl.constexpr,  # start from the previous segment's running state
    FINAL: tl.constexpr,  # last segment: the exact part and the output (else store the running state)
    ALIGNED: tl.constexpr,  # reproducible mode: the exact part in position-aligned tiles (``_exact_aligned``)
    BLOCK_M: tl.constexpr,  # rows (token, query head) per program
    BLOCK_N: tl.constexpr,  # tokens per tile
    INTERP: tl.constexpr,  # Triton's CPU interpreter
    SINKS: tl.constexpr = False,  # per-query-head sink logits in the final denominator (``attention.extras``)
    SOFT_CAP: tl.constexpr = False,  # scores soft-capped
    WINDOW: tl.constexpr = False,  # a sliding window: nothing before a row's window start is read
):
    """Flash attention of BLOCK_M rows over workspace segment [s0, s0 + seg); ``FINAL``: then the exact part and the
    output, else the running state is stored; ``LOAD_STATE``: start from the previous segment's state."""
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
    wlo = window_start(qpos, window, WINDOW)  # the sliding window's start of each row, of the first and last row
    wlo_first = window_start(hist + first_tok, window, WINDOW)
    wlo_last = window_start(hist + last_tok, window, WINDOW)
    KQ_T: tl.constexpr = tl.bfloat16 if KQ_BF16 else tl.float16

    # the transformed query (Pi q, and S q for prod keys), loaded once as tensor-core operands
    j = tl.arange(0, DP)[None, :]
    qmask = rmask[:, None] & (j < D)
    qk = tl.load(qt_ptr + qrow[:, None] * QW + j, mask=qmask, other=0.0).to(KQ_T)
    if PROD:
        qs = tl.load(qt_ptr + qrow[:, None] * QW + D + j, mask=qmask, other=0.0).to(tl.float16)
    else:
        qs = qk
    st_row = (pid_bh * tl.num_programs(1) + pid_m).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    if LOAD_STATE:
        acc = tl.load(st_acc_ptr + st_row[:, None] * DP + j)
        m_i = tl.load(st_m_ptr + st_row)
        l_i = tl.load(st_l_ptr + st_row)
    else:
        acc = tl.zeros([BLOCK_M, DP], tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)

    # ---- compressed tokens of this segment (history and, past the window, the chunk), dequantized in the
    # workspace: tiles every row reads whole, then the tiles at the window edge (masked)
    wbase = pid_bh.to(tl.int64) * seg
    wk_base = wk_ptr + wbase * KW
    wv_base = wv_ptr + wbase * DP
    cend = tl.minimum(tl.maximum(lo_last, 0), s0 + seg)
    cfull = tl.minimum(tl.maximum(lo_first, 0) // BLOCK_N * BLOCK_N, cend)
    state, ws, xs = (acc, m_i, l_i), (wk_base, wv_base), (wlo, 0, cap2)
    wfull = s0
    if WINDOW:  # tiles below the last row's window start, masked; none below the first row's is touched
        wmin = tl.maximum(wlo_first, 0)
        w0 = tl.maximum(s0, wmin // BLOCK_N * BLOCK_N)
        wfull = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(wlo_last, 0), BLOCK_N) * BLOCK_N, w0), cend)
        xs = (wlo, wmin, cap2)
        state = _workspace_span(
            w0, wfull, s0, cend, lo, qk, qs, state, ws, xs, KW, DP, PROD, True, BLOCK_N, INTERP, SOFT_CAP, WINDOW
        )
    state = _workspace_span(
        wfull, cfull, s0, cend, lo, qk, qs, state, ws, xs, KW, DP, PROD, False, BLOCK_N, INTERP, SOFT_CAP, WINDOW
    )
    c0 = tl.maximum(cfull, wfull)
    state = _workspace_span(
        c0, cend, s0, cend, lo, qk, qs, state, ws, xs, KW, DP, PROD, True, BLOCK_N, INTERP, SOFT_CAP, WINDOW
    )
    acc, m_i, l_i = state

    if FINAL:
        # ---- the exact window: ring rows, then the chunk itself (both uncompressed)
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
        if WINDOW:  # the exact part reads [max(lo, wlo), qpos]
            lo = tl.maximum(lo, wlo)
            lo_first = tl.maximum(lo_first, wlo_first)
        if ALIGNED:
            acc, m_i, l_i = _exact_aligned(
                rk_ptr + ridx * stride_rkn + h.to(tl.int64) * stride_rkh,
                rv_ptr + ridx * stride_rvn + h.to(tl.int64) * stride_rvh,
                stride_rkt,
                stride_rvt,
                k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh,
                v_ptr + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh,
                stride_kt,
                stride_vt,
                clen,
                hist,
                tl.maximum(ring, 1),
                lo_first,
                hist + last_tok + 1,
                qpos,
                lo,
                qraw,
                acc,
                m_i,
                l_i,
                rk_ptr,
                D,
                DP,
                BLOCK_N,
                INTERP,
                cap2,
                SOFT_CAP,
            )
        else:
            ring_rows = tl.where(lo_first < hist, rlen, 0)  # skip the ring once the window left it
            acc, m_i, l_i = _dense_part(
                rk_ptr + ridx * stride_rkn + h.to(tl.int64) * stride_rkh,
                rv_ptr + ridx * stride_rvn + h.to(tl.int64) * stride_rvh,
                stride_rkt,
                stride_rvt,
                0,
                ring_rows,
                clen,
                tl.maximum(ring, 1),
                True,
                qpos,
                lo,
                qraw,
                acc,
                m_i,
                l_i,
                rk_ptr,
                rv_ptr,
                D,
                DP,
                BLOCK_N,
                INTERP,
                cap2,
                SOFT_CAP,
            )
            t_start = tl.maximum(lo_first - hist, 0) // BLOCK_N * BLOCK_N
            acc, m_i, l_i = _dense_part(
                k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh,
                v_ptr + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh,
                stride_kt,
                stride_vt,
                t_start,
                last_tok + 1,
                hist,
                1,
                False,
                qpos,
                lo,
                qraw,
                acc,
                m_i,
                l_i,
                rk_ptr,
                rv_ptr,
                D,
                DP,
                BLOCK_N,
                INTERP,
                cap2,
                SOFT_CAP,
            )
        l_i = add_sink(l_i, m_i, sinks_ptr, hq, rmask, SINKS)
        inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        optr = (
            out_ptr
            + b.to(tl.int64) * stride_ob
            + hq[:, None].to(tl.int64) * stride_oh
            + tok[:, None].to(tl.int64) * stride_ot
            + j
        )
        tl.store(optr, (acc * inv[:, None]).to(out_ptr.dtype.element_ty), mask=qmask)
    else:
        tl.store(st_acc_ptr + st_row[:, None] * DP + j, acc)
        tl.store(st_m_ptr + st_row, m_i)
        tl.store(st_l_ptr + st_row, l_i)


BLOCK_N = 64
NUM_WARPS = 8  # 64-row warp groups: Triton emits wgmma on sm_90
NUM_STAGES = 3
SHARED_BYTES = 232448  # sm_90 shared memory per block (227 KB)
DEQUANT_TOKENS = 64  # tokens per dequantization program (4 warps); 32 above head_dim 128 (registers)
WORKSPACE_BYTES = PREFILL_WORKSPACE_BYTES  # fp16 workspace bound per call (format.py: the worker budget reads it too)


def default_block_m(head_dim: int) -> int:
    """Rows per program: 128 (two 64-row warp groups) up to head_dim 128, 64 beyond (the fp32 accumulator
    [BLOCK_M, D] must stay in registers)."""
    return 128 if head_dim <= 128 else 64


def fit_stages(
    block_m: int, block_n: int, key_width: int, dp: int, exact_bytes: int = 2, want: int = NUM_STAGES
) -> int:
    """Pipeline stages that fit in shared memory. Each loop holds one buffer per stage beside its query operand, and
    Triton's allocation on sm_90 is the larger loop's: the workspace loop stages * BLOCK_N * (KW + DP) * 2 +
    BLOCK_M * KW * 2 (fp16), the exact loops (ring, chunk) stages * BLOCK_N * 2 DP * e + BLOCK_M * DP * e with e the
    ring's element size (H200 call B: an fp32 ring at 3 stages asked for 256 KB)."""
    ws = (SHARED_BYTES - block_m * key_width * 2) // (block_n * (key_width + dp) * 2)
    exact = (SHARED_BYTES - block_m * dp * exact_bytes) // (block_n * 2 * dp * exact_bytes)
    return max(1, min(want, ws, exact))


def workspace_segment(
    batch: int, num_kv_heads: int, row_bytes: int, capacity: int, block: int, budget: int = WORKSPACE_BYTES
) -> int:
    """Tokens per workspace segment: all ``capacity`` tokens if they fit in ``budget`` bytes, else the most that fit
    (a multiple of ``block``, at least one block)."""
    fit = budget // max(1, batch * num_kv_heads * row_bytes) // block * block
    return max(block, min(fit, triton.cdiv(max(capacity, 1), block) * block))


@dataclass(frozen=True)
class PrefillTuning:
    """Launch knobs of ``chunked_prefill`` (results do not depend on them beyond float rounding; ``reproducible``
    fixes that rounding too)."""

    block_m: int | None = None  # rows (token, query head) per program; None: ``default_block_m``
    block_n: int = BLOCK_N  # tokens per tile
    num_warps: int = NUM_WARPS
    num_stages: int | None = None  # None: as many as fit in shared memory (``fit_stages``)
    workspace_tokens: int | None = None  # tokens per (sequence, KV head) dequantized at a time; None: from
    # ``WORKSPACE_BYTES`` (rounded to the tile sizes)
    reproducible: bool = False  # a row's result depends only on its position and the data, not on the chunk it
    # arrives in or the batch beside it: the exact part in position-aligned tiles and a fixed query-transform tile
    # (bitwise reproducible, not a speed knob; the vLLM backend's reproducible mode)


DEFAULT_TUNING = PrefillTuning()
_DEQUANT = FastLauncher(_dequant_kernel)
_PREFILL = FastLauncher(_prefill_kernel)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV) -> None:
    """Named errors for a chunk that does not fit ``kv``."""
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


def dequantize_segment(
    kv: PagedKV,
    codebook: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    s0: int,
    seg: int,
    t_len: int,
    ring: int,
    block_window: bool,
    tokens_per_program: int,
    token_major: bool,
    window: int = 0,
) -> None:
    """Decompress the compressed tokens [s0, s0 + seg) that a ``t_len``-token chunk reads into the workspace ``wk``,
    ``wv`` (``_dequant_kernel``; rows (sequence, KV head, token), or (sequence, token, KV head) if ``token_major``).
    ``window``: a sliding window W (0: none): tokens before the first chunk row's window start are not read."""
    hkv = kv.num_kv_heads
    spec, page = page_spec(kv.layout, kv.codec)
    klt = klt_constants(kv.codec, kv.pages.device)
    meta, levels, dec, mean, turns, klt_scale = klt["read"]
    consts = codec_constants(kv.codec, kv.pages.device)
    _DEQUANT(
        (kv.batch_size * hkv, seg // tokens_per_program),
        (
            kv.pages,
            kv.block_table,
            kv.compressed_lens,
            kv.recent_lens,
            codebook,
            consts["vcodebook"],
            consts["vpi"],
            meta,
            levels,
            dec,
            mean,
            turns,
            wk,
            wv,
            s0,
            seg,
            t_len,
            ring,
            kv.block_table.stride(0),
            kv.codec.qjl_scale,
            klt_scale,
            window,
        ),
        dict(
            HKV=hkv,
            KW=wk.shape[-1],
            BLOCK_WINDOW=block_window,
            WINDOW=window > 0,
            BLOCK_T=tokens_per_program,
            TOKEN_MAJOR=token_major,
            PAGE=page,
            KLT=klt["bundle"],
            INTERP=INTERPRET,
        ),
        (spec, klt.get("spec"), hkv, wk.shape[-1], block_window, tokens_per_program, token_major, window > 0),
        num_warps=4,
    )
    if s0 == 0 and kv.codec.has_sink:  # workspace row 0 is position 0: where it reads compressed, the sink is read
        sink, d = klt["sink16"], kv.layout.head_dim
        shape = (kv.batch_size, seg, hkv, -1) if token_major else (kv.batch_size, hkv, seg, -1)
        for w, constant in ((wk, sink[0]), (wv, sink[1])):
            w.view(shape).select(1 if token_major else 2, 0)[..., :d] = constant


def chunked_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKV,
    softmax_scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    max_tokens: int | None = None,
    tuning: PrefillTuning = DEFAULT_TUNING,
    extras: AttentionExtras = NO_EXTRAS,
) -> torch.Tensor:
    """Attention of q [B, Hq, T, D] over ``kv``'s history plus the chunk's own k, v [B, Hkv, T, D] (causal, window
    rule; ``kv.pages`` already hold the chunk's compressed tokens). ``max_tokens``: a host-side bound on every
    sequence's history + T (vLLM knows it), else the block table's capacity; it sizes the workspace and the segment
    count, so it must not be too small. ``tuning``: launch knobs (``PrefillTuning``). ``extras``: sinks, soft cap and
    sliding window (``attention.extras``; constexpr-gated). Both kernels launch through ``FastLauncher``."""
    _check_inputs(q, k, v, kv)
    extras.check(q.shape[1], q.device)
    bsz, hq, t_len, d = q.shape
    hkv = kv.num_kv_heads
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if out is None:
        out = torch.empty_like(q)
    if t_len == 0:
        return out
    spec, page = page_spec(kv.layout, kv.codec)
    consts = codec_constants(kv.codec, q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qt = query_transform(
        q.reshape(bsz * hq, t_len, d),
        consts["qmat"],
        scale * LOG2E,
        reproducible=tuning.reproducible,
        qmat16=consts["qmat16"],
    )
    g = hq // hkv
    rk, rv = kv.recent_k, kv.recent_v
    ring = rk.shape[2]  # the window R: positions older than exact_start(p) are read compressed
    if rk.shape[2] == 0 or rk.numel() == 0:  # no buffer storage: point at k, never read (recent_lens are 0)
        rk, rv = k, v
    block_window = kv.layout.fmt.block_window and ring > 0
    block_m, block_n = tuning.block_m or default_block_m(d), tuning.block_n
    dp, prod = spec.DP, spec.KEY_MODE == KEY_PROD
    raw_t = torch.bfloat16 if spec.RAW_BF16 else torch.float16
    kw = 2 * dp if prod else dp
    num_stages = tuning.num_stages or fit_stages(block_m, block_n, kw, dp, rk.element_size())
    # workspace segments: the pages hold at most block-table width x block size tokens per sequence (a host-side
    # bound, no sync); programs past a sequence's compressed range exit at once
    capacity = kv.block_table.shape[1] * spec.BS
    if max_tokens is not None:
        capacity = min(capacity, max(int(max_tokens), 1))
    dq_tokens = DEQUANT_TOKENS if dp <= 128 else DEQUANT_TOKENS // 2
    step = max(block_n, dq_tokens)
    seg = tuning.workspace_tokens or workspace_segment(bsz, hkv, 2 * (kw + dp), capacity, step)
    seg = triton.cdiv(seg, step) * step
    nseg = max(1, triton.cdiv(capacity, seg))
    wk = torch.empty(bsz * hkv, seg, kw, dtype=raw_t if spec.KEY_MODE == KEY_RAW else torch.float16, device=q.device)
    wv = torch.empty(bsz * hkv, seg, dp, dtype=raw_t if spec.VAL_MODE == VAL_RAW else torch.float16, device=q.device)
    grid = (bsz * hkv, triton.cdiv(t_len * g, block_m))
    if nseg > 1:  # the running (acc, max, sum) of every row between the segments' flash launches
        rows = grid[0] * grid[1] * block_m
        st_acc = torch.empty(rows, dp, dtype=torch.float32, device=q.device)
        st_m = torch.empty(rows, dtype=torch.float32, device=q.device)
        st_l = torch.empty_like(st_m)
    else:
        st_acc = st_m = st_l = out  # never read or written (FINAL, no LOAD_STATE)
    kq_bf16 = spec.KEY_MODE == KEY_RAW and spec.RAW_BF16
    sinks, cap2, window = extras_args(extras, out)
    flags_x = extras_flags(extras)
    for i in range(nseg):
        s0 = i * seg
        dequantize_segment(kv, consts["codebook"], wk, wv, s0, seg, t_len, ring, block_window, dq_tokens, False, window)
        flags = (i > 0, i == nseg - 1)  # LOAD_STATE, FINAL
        _PREFILL(
            grid,
            (
                qt,
                q,
                k,
                v,
                wk,
                wv,
                st_acc,
                st_m,
                st_l,
                kv.compressed_lens,
                rk,
                rv,
                kv.recent_lens,
                kv.recent_index,
                out,
                sinks,
                s0,
                seg,
                t_len,
                q.stride(0),
                q.stride(1),
                q.stride(2),
                k.stride(0),
                k.stride(1),
                k.stride(2),
                v.stride(0),
                v.stride(1),
                v.stride(2),
                rk.stride(0),
                rk.stride(1),
                rk.stride(2),
                rv.stride(0),
                rv.stride(1),
                rv.stride(2),
                out.stride(0),
                out.stride(1),
                out.stride(2),
                scale * LOG2E,
                ring,
                cap2,
                window,
            ),
            dict(
                HKV=hkv,
                G=g,
                QW=qt.shape[1],
                KW=kw,
                D=d,
                DP=dp,
                PROD=prod,
                KQ_BF16=kq_bf16,
                BLOCK_WINDOW=block_window,
                LOAD_STATE=flags[0],
                FINAL=flags[1],
                ALIGNED=tuning.reproducible,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                INTERP=INTERPRET,
                **flags_x,
            ),
            (
                hkv,
                g,
                qt.shape[1],
                kw,
                d,
                dp,
                prod,
                kq_bf16,
                block_window,
                *flags,
                tuning.reproducible,
                block_m,
                block_n,
                *flags_x.values(),
            ),
            num_warps=tuning.num_warps,
            num_stages=num_stages,
        )
    return out
