"""Fused hybrid decode, the device side: one query token per sequence over compressed pages AND the recent buffer.

One program = one (sequence, KV head, split). It walks its share of the compressed tokens through
the block table (vLLM 0.26 layout: slot = block * block_size + offset), BLOCK_N tokens per tile,
scoring every tile for all G query heads of the KV head at once (GQA: the tile is loaded once):

    score = ||k|| <Pi q, c[idx]> + sqrt(pi/2)/D ||r|| <S q, signs>      (keys never rebuilt)
    value = code * scale + zero                                         (per group of coordinates)
    value = Pi_v^T sum_n p_n ||v_n|| c[idx_n]                           (mse values: summed rotated, turned back once)

with (Pi q, S q) computed once per query (scaled by softmax_scale*log2 e): inside this launch for mse
keys under a randomized Hadamard rotation (a Walsh-Hadamard transform of q in registers), else by
``query_transform``. Affine key codebooks (uniform grids; 1-2 bit Lloyd-Max) are scored from the index
bits read as fp16 operand planes; 4-bit Lloyd-Max ones through byte permutes in inline PTX
(``nibble_centroids``), other codebooks (and the CPU interpreter) through a warp-shuffle lookup per coordinate.
Packed fields are read chunk by chunk (see ``_tiles``): a chunk of codes is a shift and a mask of
a loaded (BLOCK_N, bytes) tile and feeds ``tl.dot`` directly. The splits cut the sequence's compressed
tokens followed by its uncompressed recent-buffer tokens, so a program may attend to both, in one online
softmax. With several splits each program writes a partial (output, log-sum-exp) and ``_decode_reduce_kernel``
merges them in a second launch; with ``FUSED_REDUCE`` the last program of each (sequence, KV head) to finish
merges them instead (``_reduce_on_arrival``: arrival counters, two levels), one launch per call.

The kernel reads as its steps: ``_rotate_query`` (FUSE_Q), ``_key_operands``, ``_sign_operands``, ``_empty_state``,
then per tile ``_tile_pages`` -> ``_key_scores`` -> ``online_softmax`` -> ``_value_tile``, then
``_unrotate_values`` (mse values), ``_recent_tokens`` and ``_write_output``. Compile-time facts come in three
bundles: ``PAGE`` (``format.PageSpec``), ``CFG`` (``DecodeConstexprs``, below) and ``KLT`` (``_common.KltSpec``).

This file holds the ``@triton.jit`` code and the ``CFG`` contract only. The host side (launch knobs
``DecodeTuning``, the split count, the printable ``DecodePlan`` that owns the workspaces and the layer's device
constants, ``run``) is ``hybrid_decode_plan``: a plan is made once per shape, ``run(plan, ...)`` only launches.

The kernel's runtime arguments come from the plan in groups, in this order (``hybrid_decode_plan._decode_args``):
  qt_ptr .. cnt_ptr         the call's tensors (query, pages, block table, lengths, recent buffer, output), the
                            layer's device constants (``DecodeConstants``) and the plan's workspaces (qt, po, plse,
                            cnt: made with the plan, so a launch allocates nothing and a CUDA graph can capture it)
  stride_qb .. group_size   ``DecodeInts``: the strides the plan bakes in and the split sizes
  scale_log2 .. klt_scale   ``DecodeScalars``: softmax and codebook scalars
  kn_ptr .. stride_nh       the multi-token form's new tokens' k, v and ``DecodePlan.new_strides`` (CFG.NEW; q and
                            zeros without): last, so the one-token kernel's parameters keep their offsets
  PAGE, CFG, KLT            ``DecodePlan.constexprs``: the three bundles

Multi-token form (CFG.NEW, speculative verification rows): QN query tokens per sequence over its history (the
ring does not hold them yet) plus their own exact k, v; the QN * G (token, query head) pairs of a KV head are the
rows of the query tile, each under its own position's window rule (``_draft_bounds``): compressed positions
[lo, elo), exact ones [max(elo, lo), pos] from the ring and the new tokens (``_exact_rows``). Every such branch is
behind CFG.NEW, so the one-token kernel compiles as before.

Adding a per-layer constant (attention sinks, a logit soft cap, a sliding window, ...) touches four places, in the
kernel's argument order so that ``hybrid_decode_plan._decode_args`` stays a flat splice of the plan's groups:
  - a device tensor (e.g. the sink logits, fp32 [Hq]): a ``*_ptr`` parameter after ``vpi_ptr`` here and a field
    at the same place in ``hybrid_decode_plan.DecodeConstants`` (built in ``decode_constants``);
  - a float (e.g. the soft cap): a parameter after ``klt_scale`` here and the last field of ``DecodeScalars``;
  - an int (e.g. the window size in tokens): a parameter after ``group_size`` here and the last field of
    ``DecodeInts``;
  - a code path switch (e.g. HAS_SINKS, SOFT_CAP, WINDOW): a field of ``DecodeConstexprs`` (read as ``CFG.NAME``),
    set in ``hybrid_decode_plan.plan_decode``, so formats without it compile exactly as before.

Where such a feature acts in the kernel: a per-token mask (a sliding window's lower edge) where ``_tile_pages``
makes ``nmask`` and ``_recent_tokens`` makes ``tmask``; a score transform (a soft cap) right after ``_key_scores`` /
``_klt_scores`` and in ``_recent_tokens`` before ``online_softmax``; a sink's logit into the online-softmax state
``(m_i, l_i, acc, zacc)`` before ``_write_output`` (it adds to the sum l_i, not to the output). Helpers take the
bundles whole, so a new constexpr needs no new helper parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import triton
import triton.language as tl

from ._masking import add_sink, soft_cap, window_start
from ._tiles import (
    K_KLT,
    K_PROD,
    K_RAW,
    TWO24,
    V_MSE,
    V_RAW,
    centroid_lookup,
    chunk_codes,
    folded_value_tile,
    fwht_rows,
    klt_keys,
    klt_levels,
    klt_levels16,
    klt_operands,
    load_norms,
    mma,
    nibble_centroids,
    online_softmax,
    rope_cos_sin,
    subnormal16,
    value_unit,
)


@dataclass(frozen=True)
class DecodeConstexprs:
    """What one decode plan fixes at compile time besides the page (``PageSpec``): the kernel's ``CFG`` bundle."""

    HKV: int  # KV heads
    G: int  # query heads per KV head
    GP: int  # G padded to a power of two (the MMA N dimension)
    QW: int  # row width of the transformed query: D (Pi q) or 2 D (Pi q, S q)
    KCWP: int  # key chunk width padded to a power of two >= 16
    CHP: int  # CH (coordinates per 1-bit plane) padded likewise: the QJL sign planes
    VSUB: int  # coordinates per value sub-chunk (a chunk cut at value-group edges, ``value_subchunks``)
    VSUBP: int  # VSUB padded to a power of two >= 16
    VSC: int  # value sub-chunks per chunk
    NGP: int  # value groups padded to a power of two >= 16
    LOG2D: int  # log2(D): the Walsh-Hadamard stages of FUSE_Q
    BLOCK_N: int  # compressed tokens per tile
    BLOCK_R: int  # recent-buffer tokens per step
    SPB: int  # split partials merged per step (FUSED_REDUCE)
    FAST_K: bool  # keys scored from index bit planes (affine codebook, ``fast_key_planes``)
    K_HIGH: bool  # ... plus the (k >> 1) plane (2-bit Lloyd-Max)
    LUT_PRMT: bool  # 4-bit centroids by byte permutes in inline PTX (``nibble_centroids``)
    KLUT: str = field(repr=False)  # that PTX ("" when unused)
    FAST_V: bool  # value scale folded into P, codes read as subnormal planes, zero points summed apart
    FUSE_Q: bool  # the query rotation runs inside this launch (``fused_query``)
    SINGLE: bool  # one split: the program writes the output itself
    FUSED_REDUCE: bool  # several splits merged inside this launch (arrival counters)
    INTERP: bool  # Triton's CPU interpreter (``mma`` converts operands to fp32 there)
    SINKS: bool = False  # per-query-head sink logits in the softmax denominator (``attention.extras``)
    SOFT_CAP: bool = False  # scores soft-capped: cap * tanh(s / cap)
    WINDOW: bool = False  # a sliding window: positions before L - W are never read
    NEW: bool = False  # multi-token form: QN query tokens per sequence over the history, their own k, v apart
    QN: int = 1  # query tokens per sequence (NEW; speculative verification rows, ``_draft_bounds``)
    XR: int = 0  # NEW: the exact ring's capacity R (the window rule per query position; 0: no ring)
    BLOCKW: bool = False  # NEW: block windows (a query reads its own R-token block exactly)


@triton.jit
def _hybrid_decode_kernel(
    # ---- pointers
    qt_ptr,  # fp32 [B * Hq, QW]: transformed query rows (Pi q, S q) * scale * log2(e); written here if FUSE_Q
    q_ptr,  # [B, Hq, D]: the query (scores the recent buffer; FUSE_Q rotates it)
    pages_ptr,  # uint8 [blocks, HKV, PB]: the compressed pages
    bt_ptr,  # int32 [B, table width]: block table
    clen_ptr,  # int32 [B]: compressed tokens per sequence
    rk_ptr,  # [rows, HKV, R, D]: recent-buffer keys
    rv_ptr,  # [rows, HKV, R, D]: recent-buffer values
    rlen_ptr,  # int32 [B]: recent tokens per sequence
    ridx_ptr,  # int32 [B]: recent-buffer row of each sequence
    cb_ptr,  # fp32 [>= 4]: key codebook (the centroid lookup)
    klt_meta_ptr,  # klt keys (``_common.klt_constants``' read arguments): code bit offsets and widths
    klt_lv_ptr,  # level tables, or cubic levels' coefficients (KLT.CUBIC)
    klt_dec_ptr,  # decode matrix
    klt_mean_ptr,  # mean
    klt_turns_ptr,  # RoPE frequencies
    klt_sink_ptr,  # fp32 [2, HKV, D]: the calibrated sink's key and value (KLT.SINK)
    hs_ptr,  # fp32 [D]: signs of the randomized Hadamard rotation (FUSE_Q)
    vcb_ptr,  # fp32 [>= 4]: value codebook (mse values)
    vpi_ptr,  # fp32 [D, D]: the value rotation Pi_v (mse values)
    sinks_ptr,  # fp32 [Hq]: sink logits (CFG.SINKS)
    out_ptr,  # [B, Hq, D]: output ([B * QN, Hq, D] rows when CFG.NEW)
    po_ptr,  # fp32 [B * Hq * splits, D]: split partial outputs (several splits)
    plse_ptr,  # fp32 [B * Hq * splits]: split partial log2-sum-exp
    cnt_ptr,  # int32: arrival counters (FUSED_REDUCE)
    # ---- strides (elements; page bytes in bytes)
    stride_qb,
    stride_qh,
    stride_bt,
    page_bytes,
    stride_rkn,
    stride_rkh,
    stride_rkt,
    stride_rvn,
    stride_rvh,
    stride_rvt,
    stride_ob,
    stride_oh,
    # ---- split sizes
    tokens_per_split,  # the smallest split (a BLOCK_N multiple)
    n_splits,  # splits per (sequence, KV head)
    group_size,  # splits per first-level group of the in-launch merge
    window,  # the sliding window W in tokens (CFG.WINDOW)
    ring,  # the recent buffer's capacity R: token p sits in row p % R (CFG.WINDOW)
    # ---- scalars
    scale_log2,  # softmax scale * log2(e) (the recent buffer's raw-query scores)
    qt_scale,  # the same / sqrt(D): the fused rotation's scale (Pi = H diag(signs) / sqrt(D))
    qjl_scale,  # sqrt(pi / 2) / D: the QJL estimator's factor
    k_alpha,  # affine key codebook c[k] = alpha + beta k + gamma (k >> 1)
    k_beta,
    k_gamma,
    zero_rt,  # 0.0 at run time: keeps ``acc + dot(a, b, 0)`` from being folded into one dot
    klt_scale,  # klt keys: RoPE's attention scaling
    cap2,  # soft cap * log2(e) (CFG.SOFT_CAP)
    # ---- the multi-token form's new tokens (last: the one-token kernel's parameters keep their offsets and SASS)
    kn_ptr,  # [B, QN, HKV, D]: the new tokens' exact keys (CFG.NEW; the ring does not hold them yet)
    vn_ptr,  # [B, QN, HKV, D]: their values (same strides)
    stride_nb,  # their strides: sequence, token, KV head
    stride_nt,
    stride_nh,
    # ---- compile time
    PAGE: tl.constexpr,  # ``PageSpec`` bundle: field offsets, widths, modes of one page
    CFG: tl.constexpr,  # ``DecodeConstexprs`` bundle: tile shapes and code paths of this plan
    KLT: tl.constexpr,  # ``KltSpec`` bundle (klt keys)
):
    # One program = one (sequence, KV head, split). Tiles are kept transposed: scores sT [tokens, GP query heads] =
    # codes [tokens, chunk] @ q^T, so packed bytes load as (tokens, bytes) rows and feed the tensor cores as they are.
    pid_bh, split = tl.program_id(0), tl.program_id(1)
    b = pid_bh // CFG.HKV
    h = pid_bh % CFG.HKV
    clen = tl.load(clen_ptr + b)
    rlen = tl.load(rlen_ptr + b)
    g = tl.arange(0, CFG.GP)
    if CFG.NEW:  # rows = (query token g // G, query head g % G) pairs, each a flat query row of its own
        gmask = g < CFG.QN * CFG.G
        qrow = ((b * CFG.QN + g // CFG.G) * CFG.HKV + h) * CFG.G + g % CFG.G
    else:
        gmask = g < CFG.G
        qrow = b * (CFG.HKV * CFG.G) + h * CFG.G + g  # flat query-head rows of this KV head
    if CFG.FUSE_Q:
        _rotate_query(q_ptr, hs_ptr, qt_ptr, b, h, g, gmask, qrow, stride_qb, stride_qh, qt_scale, PAGE, CFG)
    # the transformed query as tensor-core operands, loaded once; index vectors along the tiles' coordinate axes
    # are made once here too (the steps share them)
    kc = tl.arange(0, CFG.KCWP)  # columns of a key chunk
    if PAGE.KEY_MODE == K_KLT:  # the raw query's parts; the transform, read once
        qk = _klt_query_operands(qt_ptr, qrow, gmask, klt_scale, CFG, KLT)
        qh = ()
        kadd = tl.zeros([CFG.GP], tl.float32)
        kops = _klt_read_operands(h, klt_meta_ptr, klt_lv_ptr, klt_dec_ptr, klt_mean_ptr, klt_turns_ptr, PAGE, CFG, KLT)
    else:
        qk, qh, kadd = _key_operands(qt_ptr, qrow, gmask, kc, k_alpha, k_beta, k_gamma, PAGE, CFG)
        kops = ()
    sc = tl.arange(0, CFG.CHP)  # columns of a sign plane
    qs, ssub = _sign_operands(qt_ptr, qrow, gmask, sc, PAGE, CFG)
    vu = tl.arange(0, CFG.VSUBP)  # columns of a value sub-chunk
    ng = tl.arange(0, CFG.NGP)  # value groups
    zacc, acc, m_i, l_t = _empty_state(PAGE, CFG)  # (this order: it is the loop-carried values' order)

    # ---- this split's share of the sequence's tokens, compressed ones first, then the recent buffer's:
    # virtual tokens [start, start + tps) of [0, clen + rlen); compressed [start, end), BLOCK_N per tile.
    # The split size follows this sequence's own length (at least tokens_per_split, a BLOCK_N multiple), not the
    # block table's capacity: under vLLM the table spans max_model_len, and capacity-sized splits left most
    # programs of an 8k sequence idle in a 128k table
    # with a sliding window the splits share the tokens from the window's first tile on (the query sits at
    # clen + rlen - 1 and reads positions >= wlo; nothing before is loaded: vLLM may have freed those blocks)
    if CFG.NEW:  # per row: compressed positions [lo, elo), exact [max(elo, lo), pos]; the new tokens after the ring
        pos, elo, lo, cend, wlo = _draft_bounds(clen, clen + rlen, g, window, CFG)
        vlen = cend + rlen + CFG.QN
    else:
        wlo = window_start(clen + rlen - 1, window, CFG.WINDOW)
        cend = clen
        vlen = clen + rlen
    base = tl.maximum(wlo, 0) // CFG.BLOCK_N * CFG.BLOCK_N
    tps = tl.maximum(tokens_per_split, tl.cdiv(vlen - base, n_splits * CFG.BLOCK_N) * CFG.BLOCK_N)
    start = base + split * tps
    end = tl.minimum(start + tps, cend)
    head_off = h.to(tl.int64) * page_bytes
    for n0 in range(start, end, CFG.BLOCK_N):
        page, off, nmask = _tile_pages(pages_ptr, bt_ptr, b, n0, end, head_off, stride_bt, page_bytes, PAGE, CFG)
        if KLT.SINK:  # position 0 is read from the calibrated sink below
            nmask = nmask & (n0 + tl.arange(0, CFG.BLOCK_N) > 0)
        if CFG.WINDOW:
            nmask = nmask & (n0 + tl.arange(0, CFG.BLOCK_N) >= wlo)
        if PAGE.KEY_MODE == K_KLT:
            s = _klt_scores(page, off, nmask, n0, qk, kops, PAGE, CFG, KLT)
        else:
            s = _key_scores(page, off, nmask, kc, sc, qk, qh, kadd, qs, ssub, cb_ptr, qjl_scale, PAGE, CFG)
        if CFG.NEW:  # each row reads its own compressed positions [lo, elo)
            npos = (n0 + tl.arange(0, CFG.BLOCK_N))[:, None]
            rmask = nmask[:, None] & (npos < elo[None, :]) & (npos >= lo[None, :])
            s = tl.where(rmask, soft_cap(s, cap2, CFG.SOFT_CAP), float("-inf"))
        else:
            s = tl.where(nmask[:, None], soft_cap(s, cap2, CFG.SOFT_CAP), float("-inf"))
        # the running sum stays a [BLOCK_N, GP] tile (one FFMA per element) and is reduced over tokens once, after
        # the loop, instead of a shuffle reduction per tile
        m_i, alpha, p, l_t = online_softmax(s, m_i, l_t, 0, False)
        acc, zacc = _value_tile(page, off, nmask, vu, ng, p, alpha, acc, zacc, zero_rt, vcb_ptr, PAGE, CFG)
    l_i = tl.sum(l_t, 0)
    if PAGE.VAL_MODE == V_MSE:  # the compressed part's sums back in the original domain, where the recent tokens add
        acc = _unrotate_values(acc, vpi_ptr, vu, PAGE, CFG)
    if KLT.SINK:  # compressed position 0 (split 0 holds it): the calibrated sink, one exact token of every sequence
        if (split == 0) & (clen > 0) & (wlo <= 0):
            m_i, l_i, acc, zacc = _recent_tokens(
                q_ptr,
                klt_sink_ptr,
                klt_sink_ptr + CFG.HKV * PAGE.D,
                ridx_ptr,
                b,
                h,
                g,
                gmask,
                vu,
                0,
                1,
                stride_qb,
                stride_qh,
                0,
                PAGE.D,
                0,
                0,
                PAGE.D,
                0,
                scale_log2,
                (m_i, l_i, acc, zacc),
                PAGE,
                CFG,
                0,
                1,
                wlo,
                cap2,
            )

    # ---- recent (uncompressed) tokens [r0, r1) of this split: spread over the splits like the compressed ones
    # (one program taking the whole buffer made its split the last to finish: H200 B=1/1k, 13 -> 23 us at 16 a step)
    r0 = tl.maximum(start - cend, 0)
    r1 = tl.minimum(start + tps - cend, rlen)
    if CFG.NEW:  # the ring's rows [r0, r1), then the new tokens [t0, t1) of this split, each row under its masks
        qoff = _row_offsets(b, h, g, stride_qb, stride_qh, CFG)
        xlo = tl.maximum(elo, lo)
        if r1 > r0:
            ridx = tl.load(ridx_ptr + b).to(tl.int64)
            m_i, l_i, acc, zacc = _exact_rows(
                q_ptr,
                qoff,
                rk_ptr + ridx * stride_rkn + h.to(tl.int64) * stride_rkh,
                rv_ptr + ridx * stride_rvn + h.to(tl.int64) * stride_rvh,
                rk_ptr,
                r0,
                r1,
                stride_rkt,
                stride_rvt,
                clen,
                ring,
                xlo,
                pos,
                gmask,
                vu,
                scale_log2,
                cap2,
                (m_i, l_i, acc, zacc),
                PAGE,
                CFG,
                True,
            )
        t0 = tl.maximum(start - cend - rlen, 0)
        t1 = tl.minimum(start + tps - cend - rlen, CFG.QN)
        if t1 > t0:
            nbase = b.to(tl.int64) * stride_nb + h.to(tl.int64) * stride_nh
            m_i, l_i, acc, zacc = _exact_rows(
                q_ptr,
                qoff,
                kn_ptr + nbase,
                vn_ptr + nbase,
                rk_ptr,
                t0,
                t1,
                stride_nt,
                stride_nt,
                clen + rlen,
                ring,
                xlo,
                pos,
                gmask,
                vu,
                scale_log2,
                cap2,
                (m_i, l_i, acc, zacc),
                PAGE,
                CFG,
                False,
            )
    elif r1 > r0:
        m_i, l_i, acc, zacc = _recent_tokens(
            q_ptr,
            rk_ptr,
            rv_ptr,
            ridx_ptr,
            b,
            h,
            g,
            gmask,
            vu,
            r0,
            r1,
            stride_qb,
            stride_qh,
            stride_rkn,
            stride_rkh,
            stride_rkt,
            stride_rvn,
            stride_rvh,
            stride_rvt,
            scale_log2,
            (m_i, l_i, acc, zacc),
            PAGE,
            CFG,
            clen,
            ring,
            wlo,
            cap2,
        )
    if CFG.SINKS:  # split 0 adds each query head's sink to its softmax sum (no value: the output is not touched)
        if CFG.NEW:
            l_i = add_sink(l_i, m_i, sinks_ptr, h * CFG.G + g % CFG.G, gmask & (split == 0), CFG.SINKS)
        else:
            l_i = add_sink(l_i, m_i, sinks_ptr, h * CFG.G + g, gmask & (split == 0), CFG.SINKS)
    _write_output(
        out_ptr,
        po_ptr,
        plse_ptr,
        cnt_ptr,
        acc,
        zacc,
        m_i,
        l_i,
        pid_bh,
        b,
        h,
        g,
        gmask,
        vu,
        ng,
        qrow,
        split,
        n_splits,
        group_size,
        stride_ob,
        stride_oh,
        PAGE,
        CFG,
    )


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
def _klt_query_operands(qt_ptr, qrow, gmask, scale, CFG: tl.constexpr, KLT: tl.constexpr):
    """klt keys: the query's rotary first halves and second halves times RoPE's attention ``scale`` (fp32 [RHP, GP]:
    ``_klt_scores`` turns them by each tile's base angle) and its unrotated channels as an fp16 B operand [RRP, GP]."""
    ia = tl.arange(0, KLT.RHP)
    ir = tl.arange(0, KLT.RRP)
    rows = qt_ptr + qrow[None, :] * CFG.QW
    qa = tl.load(rows + ia[:, None], mask=gmask[None, :] & (ia[:, None] < KLT.RH), other=0.0)
    qb = tl.load(rows + KLT.RH + ia[:, None], mask=gmask[None, :] & (ia[:, None] < KLT.RH), other=0.0)
    qr = tl.load(rows + 2 * KLT.RH + ir[:, None], mask=gmask[None, :] & (ir[:, None] < KLT.RR), other=0.0)
    return qa * scale, qb * scale, qr.to(tl.float16)


@triton.jit
def _klt_read_operands(
    h, meta_ptr, lv_ptr, dec_ptr, mean_ptr, turns_ptr, PAGE: tl.constexpr, CFG: tl.constexpr, KLT: tl.constexpr
):
    """klt keys: this KV head's code-reading and decoding bundles (``klt_operands``), the RoPE frequencies [RHP] and
    cos, sin [RHP, BLOCK_N] of the angle offsets t theta of a tile's tokens t from its first, made once per program:
    every tile's keys turn by them, its base angle goes to the query (``_klt_scores``)."""
    turns = tl.load(turns_ptr + tl.arange(0, KLT.RHP))
    ct, st = rope_cos_sin(tl.arange(0, CFG.BLOCK_N)[None, :], turns[:, None])
    cops, dops = klt_operands(h, meta_ptr, lv_ptr, dec_ptr, mean_ptr, PAGE, KLT, KLT.CUBIC)
    return cops, dops, turns, ct, st


@triton.jit
def _klt_scores(page, off, nmask, n0, qk, kops, PAGE: tl.constexpr, CFG: tl.constexpr, KLT: tl.constexpr):
    """Log2-domain scores [BLOCK_N, GP] of one tile of klt keys (positions n0 + t): q . R_(n0 + t) k =
    (R_n0^T q) . (R_t k), so the keys are decoded and turned by their offsets t from the tile's start alone
    (``klt_levels``, ``klt_keys`` with the program's cos, sin tiles) and the query by the tile's base angle n0, then
    three products with the query's parts."""
    cops, dops, turns, ct, st = kops
    if KLT.CUBIC:  # fp16 levels of v = c - 2^(w-1) (``_common.klt_constants``' decode_read)
        z = klt_levels16(page + PAGE.OFF_KCODE + off * PAGE.KCB, nmask, cops, PAGE, KLT, CFG.INTERP)
    else:
        z = klt_levels(page + PAGE.OFF_KCODE + off * PAGE.KCB, nmask, cops, PAGE, KLT, CFG.INTERP)
    ka, kb, kr = klt_keys(z, ct, st, dops, KLT, CFG.INTERP)
    cb, sb = rope_cos_sin(n0 + tl.zeros([KLT.RHP], tl.int32), turns)
    qa = (qk[0] * cb[:, None] + qk[1] * sb[:, None]).to(tl.float16)
    qb = (qk[1] * cb[:, None] - qk[0] * sb[:, None]).to(tl.float16)
    s = mma(tl.trans(ka.to(tl.float16)), qa, tl.zeros([CFG.BLOCK_N, CFG.GP], tl.float32), CFG.INTERP)
    s = mma(tl.trans(kb.to(tl.float16)), qb, s, CFG.INTERP)
    if KLT.RR > 0:
        s = mma(tl.trans(kr.to(tl.float16)), qk[2], s, CFG.INTERP)
    return s


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
                    tile = folded_value_tile(
                        xvs[j],
                        vptr,
                        vmask,
                        w,
                        zero_rt,
                        c,
                        PAGE.CH,
                        PAGE.VCW,
                        PAGE.VB,
                        PAGE.VW0,
                        PAGE.VW1,
                        PAGE.VW2,
                        CFG.INTERP,
                    )
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


@triton.jit
def _recent_tokens(
    q_ptr,
    rk_ptr,
    rv_ptr,
    ridx_ptr,
    b,
    h,
    g,
    gmask,
    vu,
    r0,
    r1,
    stride_qb,
    stride_qh,
    stride_rkn,
    stride_rkh,
    stride_rkt,
    stride_rvn,
    stride_rvh,
    stride_rvt,
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
    before ``wlo`` are masked, under CFG.SOFT_CAP scores capped (``cap2``, log2 domain)."""
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
                    pv = pv * (value_unit(c, PAGE.CH, PAGE.VCW, PAGE.VB, PAGE.VW0, PAGE.VW1, PAGE.VW2) / TWO24)
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
    q_ptr,
    qoff,
    k_base,
    v_base,
    ring_ptr,
    t0,
    t1,
    stride_kt,
    stride_vt,
    pos0,
    ring,
    xlo,
    xhi,
    gmask,
    vu,
    scale_log2,
    cap2,
    state,
    PAGE: tl.constexpr,
    CFG: tl.constexpr,
    RING: tl.constexpr,
):
    """CFG.NEW: exact tokens t in [t0, t1) at ``k_base`` / ``v_base`` + t * stride into the online softmax
    ``state`` -> the new state, row r (query offsets ``qoff``) reading those whose position lies in [xlo[r], xhi[r]].
    RING: ring rows (position pos0 + (t - pos0) mod ``ring``), else the new tokens (position pos0 + t), cast to the
    ring's dtype (``ring_ptr``'s) as the ring would store them."""
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
                    pv = pv * (value_unit(c, PAGE.CH, PAGE.VCW, PAGE.VB, PAGE.VW0, PAGE.VW1, PAGE.VW2) / TWO24)
                new_acc = new_acc + (acc[c * CFG.VSC + j] * alpha[None, :] + pv,)
        acc = new_acc
    return m_i, l_i, acc, zacc


@triton.jit
def _write_output(
    out_ptr,
    po_ptr,
    plse_ptr,
    cnt_ptr,
    acc,
    zacc,
    m_i,
    l_i,
    pid_bh,
    b,
    h,
    g,
    gmask,
    vu,
    ng,
    qrow,
    split,
    n_splits,
    group_size,
    stride_ob,
    stride_oh,
    PAGE: tl.constexpr,
    CFG: tl.constexpr,
):
    """The normalized output (one split) or this split's partial (output, log2-sum-exp), merged in the launch when
    FUSED_REDUCE."""
    inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
    for c in tl.static_range(PAGE.VCH):
        for j in tl.static_range(CFG.VSC):
            col = c * PAGE.VCW + j * CFG.VSUB + vu
            omask = gmask[None, :] & (vu[:, None] < CFG.VSUB) & (col[:, None] < PAGE.D)
            o = acc[c * CFG.VSC + j]
            if CFG.FAST_V:
                grp = (c * PAGE.VCW + j * CFG.VSUB) // PAGE.GROUP
                zsum = tl.sum(tl.where(ng[:, None] == grp, zacc, 0.0), 0)
                u = value_unit(c, PAGE.CH, PAGE.VCW, PAGE.VB, PAGE.VW0, PAGE.VW1, PAGE.VW2)
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
            _reduce_on_arrival(
                po_ptr,
                plse_ptr,
                cnt_ptr,
                out_ptr,
                pid_bh,
                b,
                h,
                split,
                n_splits,
                group_size,
                qrow,
                g,
                gmask,
                stride_ob,
                stride_oh,
                CFG.G,
                CFG.GP,
                PAGE.D,
                PAGE.DP,
                CFG.SPB,
            )


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
    po_ptr,
    plse_ptr,
    cnt_ptr,
    out_ptr,
    pid_bh,
    b,
    h,
    split,
    n_splits,
    group_size,
    qrow,
    g,
    gmask,
    stride_ob,
    stride_oh,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    SPB: tl.constexpr,
):
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
