"""Chunked prefill, step 1 on the device: decompress a history segment once into an fp16 workspace.

``_dequant_kernel`` writes, per (sequence, KV head), the compressed tokens [s0, s0 + seg) that any chunk row reads:
keys in the rotated domain with the norm folded in (``||k|| c[idx]``, or rotated back for a kernel that scores raw
queries; prod keys also ``qjl ||r|| signs``, scored against S q; klt keys the post-RoPE key), values ``code * scale
+ zero`` (mse values rotated back: ``||v|| Pi_v^T c[idx]``). ``prefill`` runs the flash loop over that workspace;
``prefill_plan`` sizes and launches both. ``_window_lo`` is the window rule (``format.exact_start``) both kernels
share.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._masking import window_start
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
    rope_cos_sin,
    run_bits,
    unrotate_rows,
    unrotate_rows16,
)


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
    kpi_hi_ptr,  # fp16 [D, D]: the key rotation Pi's high half (UNROTATE_KEYS)
    kpi_lo_ptr,  # fp16 [D, D]: and its low half, Pi - hi
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
    UNROTATE_KEYS: tl.constexpr,  # mse keys rotated back, ||k|| Pi^T c[idx] (scored against the raw query)
    PAGE: tl.constexpr,  # ``PageSpec`` bundle
    KLT: tl.constexpr,  # ``KltSpec`` bundle
    INTERP: tl.constexpr,
):
    """Compressed tokens [s0, s0 + seg) of one (sequence, KV head) that any chunk row reads (positions below the last
    row's window bound) -> workspace rows n - s0: key [KW] (fp16 ||k|| c[idx], with ``UNROTATE_KEYS`` the key
    itself, ||k|| Pi^T c[idx]; prod: then qjl ||r|| signs at DP; klt: the post-RoPE key),
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
            if UNROTATE_KEYS:  # stored a block of columns at a time, as mse values are
                UKW: tl.constexpr = _unrotate_width(DP)
                for u in tl.static_range(DP // UKW):
                    ku = unrotate_rows16(cent, kpi_hi_ptr, kpi_lo_ptr, u * UKW, UKW, D, DP) * knorm[:, None]
                    kcols = u * UKW + tl.arange(0, UKW)[None, :]
                    tl.store(wk_ptr + row * KW + kcols, ku.to(wk_ptr.dtype.element_ty), mask=nmask[:, None])
            else:
                kt = tl.where(j < D, cent * knorm[:, None], 0.0).to(tl.float16)
            if PAGE.KEY_MODE == K_PROD:  # qjl * ||r|| * signs as +-1, scored against S q
                rnorm = load_norms(base + PAGE.OFF_KRNORM, offn, nmask, PAGE.NORM_F32)
                sgn = (2 * run_bits(page + PAGE.OFF_KSGN + off * CH, tmask, j, CH, 1) - 1).to(tl.float32)
                ks = tl.where(j < D, sgn * (qjl_scale * rnorm)[:, None], 0.0)
                tl.store(kdst + DP, ks.to(wk_ptr.dtype.element_ty), mask=nmask[:, None])
        if PAGE.KEY_MODE == K_RAW or (PAGE.KEY_MODE != K_KLT and not UNROTATE_KEYS):
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
