"""Fused hybrid decode, the end of a program and the split reduction (``@triton.jit`` code).

``_write_output`` writes the normalized output (one split) or this split's partial (output, log2-sum-exp). With
several splits the partials are merged either inside the decode launch (FUSED_REDUCE: ``_reduce_on_arrival``, the
last program of each group of splits to arrive merges them with ``_merge_partials``, two levels of arrival
counters) or by a second launch, ``_decode_reduce_kernel`` (one program per sequence and query head).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._tiles import TWO24, value_unit
from .decode_exact import _row_offsets


@triton.jit
def _write_output(
    outs,
    result,
    pid_bh,
    tile,
    vu,
    ng,
    qrow,
    splits,
    out_strides,
    PAGE: tl.constexpr,
    CFG: tl.constexpr,
):
    """The normalized output (one split) or this split's partial (output, log2-sum-exp), merged in the launch when
    FUSED_REDUCE. ``outs``: (output, split partial outputs, their log2-sum-exp, arrival counters) pointers;
    ``result``: the online softmax's (acc, zacc, m_i, l_i); ``tile``: the program's (sequence b, KV head h,
    query-tile rows g, their mask); ``splits``: (this split, splits, splits per first-level group); ``out_strides``:
    the output's sequence and head strides."""
    out_ptr, po_ptr, plse_ptr, _ = outs
    acc, zacc, m_i, l_i = result
    b, h, g, gmask = tile
    split, n_splits, _ = splits
    stride_ob, stride_oh = out_strides
    inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
    for c in tl.static_range(PAGE.VCH):
        for j in tl.static_range(CFG.VSC):
            col = c * PAGE.VCW + j * CFG.VSUB + vu
            omask = gmask[None, :] & (vu[:, None] < CFG.VSUB) & (col[:, None] < PAGE.D)
            o = acc[c * CFG.VSC + j]
            if CFG.FAST_V:
                grp = (c * PAGE.VCW + j * CFG.VSUB) // PAGE.GROUP
                zsum = tl.sum(tl.where(ng[:, None] == grp, zacc, 0.0), 0)
                u = value_unit(c, PAGE)
                o = o * (TWO24 / u) + zsum[None, :]
            o = o * inv[None, :]
            if CFG.SINGLE:
                if CFG.NEW:
                    optr = out_ptr + _row_offsets(b, h, g, stride_ob, stride_oh, CFG)[None, :] + col[:, None]
                else:
                    optr = (
                        out_ptr
                        + b.to(tl.int64) * stride_ob
                        + (h * CFG.G + g)[None, :].to(tl.int64) * stride_oh
                        + col[:, None]
                    )
                tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=omask)
            else:
                prow = qrow.to(tl.int64) * n_splits + split
                tl.store(po_ptr + prow[None, :] * PAGE.D + col[:, None], o, mask=omask)
    if not CFG.SINGLE:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
        tl.store(plse_ptr + qrow.to(tl.int64) * n_splits + split, lse, mask=gmask)
        if CFG.FUSED_REDUCE:
            _reduce_on_arrival(outs, pid_bh, tile, qrow, splits, out_strides, CFG.G, CFG.GP, PAGE.D, PAGE.DP, CFG.SPB)


@triton.jit
def _merge_partials(
    po_ptr,
    plse_ptr,
    qrow,
    gmask,
    first,
    step,
    count,
    n_splits,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    SPB: tl.constexpr,
):
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
        lse = tl.load(plse_ptr + slot, mask=smask[:, None] & gmask[None, :], other=float("-inf"), cache_modifier=".cg")
        x = tl.load(
            po_ptr + slot[:, :, None] * D + d[None, None, :],
            mask=(lse > float("-inf"))[:, :, None] & (d < D)[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
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
def _reduce_on_arrival(
    outs,
    pid_bh,
    tile,
    qrow,
    splits,
    out_strides,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    SPB: tl.constexpr,
):
    """The split reduction inside the decode launch, in two levels of arrival counters per (sequence, KV head):
    the last program of a group of ``group_size`` splits to finish merges the group's partials into the group's
    first slot; the last group to finish merges the group partials into the output. Each counter is set back to 0
    by the program that found itself last, so the next launch (or graph replay) starts from zeros. Arguments grouped
    as ``_write_output``'s."""
    out_ptr, po_ptr, plse_ptr, cnt_ptr = outs
    b, h, g, gmask = tile
    split, n_splits, group_size = splits
    stride_ob, stride_oh = out_strides
    n_groups = (n_splits + group_size - 1) // group_size
    grp = split // group_size
    in_grp = tl.minimum(group_size, n_splits - grp * group_size)
    cbase = cnt_ptr + pid_bh * (n_groups + 1)
    tl.debug_barrier()  # every thread's partial stores come before the release below (one arrival per program)
    arrived = tl.atomic_add(cbase + 1 + grp, 1, sem="acq_rel", scope="gpu")
    if arrived == in_grp - 1:
        tl.store(cbase + 1 + grp, 0)
        o, lsum, m = _merge_partials(
            po_ptr, plse_ptr, qrow, gmask, grp * group_size, 1, in_grp, n_splits, GP, D, DP, SPB
        )
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
                o, lsum, m = _merge_partials(
                    po_ptr, plse_ptr, qrow, gmask, 0, group_size, n_groups, n_splits, GP, D, DP, SPB
                )
                inv = tl.where(lsum > 0, 1.0 / lsum, 0.0)
                _store_heads(out_ptr, b, h, g, gmask, o * inv[:, None], stride_ob, stride_oh, G, D, DP)
        else:
            _store_heads(out_ptr, b, h, g, gmask, o * inv[:, None], stride_ob, stride_oh, G, D, DP)


@triton.jit
def _decode_reduce_kernel(
    po_ptr,  # fp32 [B * Hq * splits, D]: split partial outputs
    plse_ptr,  # fp32 [B * Hq * splits]: their log2-sum-exp
    out_ptr,  # [B, Hq, D]: output
    stride_ob,
    stride_oh,
    n_splits,  # splits per (sequence, KV head)
    HQ: tl.constexpr,  # query heads
    D: tl.constexpr,  # head dim
    DP: tl.constexpr,  # head dim padded to a power of two
    SP: tl.constexpr,
):  # splits padded to a power of two
    # One program per (sequence, query head): merge n_splits partial outputs by their log-sum-exp.
    row = tl.program_id(0)
    b = row // HQ
    hq = row % HQ
    s = tl.arange(0, SP)
    d = tl.arange(0, DP)
    lse = tl.load(plse_ptr + row.to(tl.int64) * n_splits + s, mask=s < n_splits, other=float("-inf"))
    mx = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - mx), 0.0)
    o = tl.load(
        po_ptr + (row.to(tl.int64) * n_splits + s)[:, None] * D + d[None, :],
        mask=(s[:, None] < n_splits) & (d[None, :] < D) & (lse[:, None] > float("-inf")),
        other=0.0,
    )
    tot = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(tot > 0, tot, 1.0)
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + hq.to(tl.int64) * stride_oh + d,
        res.to(out_ptr.dtype.element_ty),
        mask=d < D,
    )
