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

This file holds the kernel and the ``CFG`` contract; its steps are ``@triton.jit`` helpers in modules of one job
each: ``decode_tiles`` (the query operands and the compressed tiles' keys and values), ``decode_klt`` (klt keys),
``decode_exact`` (the recent buffer and the multi-token form's exact rows) and ``decode_reduce`` (the output, the
split partials' merge and the second-launch ``_decode_reduce_kernel``). The host side, one job a module:
``decode_tuning`` (launch knobs ``DecodeTuning``, the split count), ``decode_args`` (the argument groups and the
printable ``DecodePlan`` that holds them, the workspaces and the layer's device constants), ``hybrid_decode_plan``
(``plan_decode``, and ``hybrid_decode``, which plans once per shape) and ``decode_launch`` (``run``): a plan is made
once per shape, ``run(plan, ...)`` only launches.

The kernel's runtime arguments come from the plan in groups, in this order (``decode_args._decode_args``):
  qt_ptr .. cnt_ptr         the call's tensors (query, pages, block table, lengths, recent buffer, output), the
                            layer's device constants (``DecodeConstants``) and the plan's workspaces (qt, po, plse,
                            cnt: made with the plan, so a launch allocates nothing and a CUDA graph can capture it)
  ints                      ``DecodeInts`` (one tuple): the strides the plan bakes in and the split sizes
  scalars                   ``DecodeScalars`` (one tuple): softmax and codebook scalars
  kn_ptr, vn_ptr,           the multi-token form's new tokens' k, v and ``DecodePlan.new_strides`` (one tuple;
  new_strides               CFG.NEW; q and zeros without): last, so the one-token kernel's parameters keep their offsets
  PAGE, CFG, KLT            ``DecodePlan.constexprs``: the three bundles
The kernel names the tuples' fields where it starts. Triton flattens a tuple argument into its fields in order, so the
compiled kernel's parameters are the same as with one parameter per field (each int specialized on its own).

Multi-token form (CFG.NEW, speculative verification rows): QN query tokens per sequence over its history (the
ring does not hold them yet) plus their own exact k, v; the QN * G (token, query head) pairs of a KV head are the
rows of the query tile, each under its own position's window rule (``_draft_bounds``): compressed positions
[lo, elo), exact ones [max(elo, lo), pos] from the ring and the new tokens (``_exact_rows``). Every such branch is
behind CFG.NEW, so the one-token kernel compiles as before.

Adding a per-layer constant (attention sinks, a logit soft cap, a sliding window, ...) touches four places, in the
kernel's argument order so that ``decode_args._decode_args`` stays a splice of the plan's groups:
  - a device tensor (e.g. the sink logits, fp32 [Hq]): a ``*_ptr`` parameter after ``vpi_ptr`` here and a field
    at the same place in ``decode_args.DecodeConstants`` (built in ``hybrid_decode_plan.plan_decode``);
  - a float (e.g. the soft cap): a name after ``cap2`` in the kernel's unpacking of ``scalars`` and the last field
    of ``DecodeScalars``;
  - an int (e.g. the window size in tokens): a name after ``ring`` in the kernel's unpacking of ``ints`` and the last
    field of ``DecodeInts``;
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
from ._tiles import K_KLT, V_MSE, online_softmax
from .decode_exact import _draft_bounds, _exact_rows, _recent_tokens, _row_offsets
from .decode_klt import _klt_query_operands, _klt_read_operands, _klt_scores
from .decode_reduce import _write_output
from .decode_tiles import (
    _empty_state,
    _key_operands,
    _key_scores,
    _rotate_query,
    _sign_operands,
    _tile_pages,
    _unrotate_values,
    _value_tile,
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
    # ---- ints and floats, one tuple each (Triton flattens them in order; their fields are named below)
    ints,  # ``DecodeInts``: stride_qb .. ring
    scalars,  # ``DecodeScalars``: scale_log2 .. cap2
    # ---- the multi-token form's new tokens (last: the one-token kernel's parameters keep their offsets and SASS)
    kn_ptr,  # [B, QN, HKV, D]: the new tokens' exact keys (CFG.NEW; the ring does not hold them yet)
    vn_ptr,  # [B, QN, HKV, D]: their values (same strides)
    new_strides,  # (stride_nb, stride_nt, stride_nh): their strides (``DecodePlan.new_strides``)
    # ---- compile time
    PAGE: tl.constexpr,  # ``PageSpec`` bundle: field offsets, widths, modes of one page
    CFG: tl.constexpr,  # ``DecodeConstexprs`` bundle: tile shapes and code paths of this plan
    KLT: tl.constexpr,  # ``KltSpec`` bundle (klt keys)
):
    (
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
    ) = ints
    (
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
    ) = scalars
    (
        stride_nb,  # the new tokens' strides: sequence, token, KV head
        stride_nt,
        stride_nh,
    ) = new_strides

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
    q = (q_ptr, stride_qb, stride_qh)
    tile = (b, h, g, gmask)  # the program's sequence, KV head, query-tile rows and their mask
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
            sink_k = (klt_sink_ptr, 0, PAGE.D, 0)  # one token per KV head: [2, HKV, D]
            sink_v = (klt_sink_ptr + CFG.HKV * PAGE.D, 0, PAGE.D, 0)
            state = (m_i, l_i, acc, zacc)
            m_i, l_i, acc, zacc = _recent_tokens(
                q, sink_k, sink_v, ridx_ptr, tile, vu, 0, 1, scale_log2, state, PAGE, CFG, 0, 1, wlo, cap2
            )

    # ---- recent (uncompressed) tokens [r0, r1) of this split: spread over the splits like the compressed ones
    # (one program taking the whole buffer made its split the last to finish: H200 B=1/1k, 13 -> 23 us at 16 a step)
    r0 = tl.maximum(start - cend, 0)
    r1 = tl.minimum(start + tps - cend, rlen)
    if CFG.NEW:  # the ring's rows [r0, r1), then the new tokens [t0, t1) of this split, each row under its masks
        rows = (q_ptr, _row_offsets(b, h, g, stride_qb, stride_qh, CFG), gmask)  # the query rows: pointer, offsets
        reads = (tl.maximum(elo, lo), pos)  # row r reads the exact positions [reads[0][r], reads[1][r]]
        if r1 > r0:
            ridx = tl.load(ridx_ptr + b).to(tl.int64)
            ring_rows = (
                rk_ptr + ridx * stride_rkn + h.to(tl.int64) * stride_rkh,
                rv_ptr + ridx * stride_rvn + h.to(tl.int64) * stride_rvh,
                stride_rkt,
                stride_rvt,
            )
            state = (m_i, l_i, acc, zacc)
            m_i, l_i, acc, zacc = _exact_rows(
                rows, reads, ring_rows, rk_ptr, r0, r1, clen, ring, vu, scale_log2, cap2, state, PAGE, CFG, True
            )
        t0 = tl.maximum(start - cend - rlen, 0)
        t1 = tl.minimum(start + tps - cend - rlen, CFG.QN)
        if t1 > t0:
            nbase = b.to(tl.int64) * stride_nb + h.to(tl.int64) * stride_nh
            new_rows = (kn_ptr + nbase, vn_ptr + nbase, stride_nt, stride_nt)
            state = (m_i, l_i, acc, zacc)
            m_i, l_i, acc, zacc = _exact_rows(
                rows, reads, new_rows, rk_ptr, t0, t1, clen + rlen, ring, vu, scale_log2, cap2, state, PAGE, CFG, False
            )
    elif r1 > r0:
        rk = (rk_ptr, stride_rkn, stride_rkh, stride_rkt)
        rv = (rv_ptr, stride_rvn, stride_rvh, stride_rvt)
        state = (m_i, l_i, acc, zacc)
        m_i, l_i, acc, zacc = _recent_tokens(
            q, rk, rv, ridx_ptr, tile, vu, r0, r1, scale_log2, state, PAGE, CFG, clen, ring, wlo, cap2
        )
    if CFG.SINKS:  # split 0 adds each query head's sink to its softmax sum (no value: the output is not touched)
        if CFG.NEW:
            l_i = add_sink(l_i, m_i, sinks_ptr, h * CFG.G + g % CFG.G, gmask & (split == 0), CFG.SINKS)
        else:
            l_i = add_sink(l_i, m_i, sinks_ptr, h * CFG.G + g, gmask & (split == 0), CFG.SINKS)
    outs = (out_ptr, po_ptr, plse_ptr, cnt_ptr)
    splits = (split, n_splits, group_size)
    _write_output(outs, (acc, zacc, m_i, l_i), pid_bh, tile, vu, ng, qrow, splits, (stride_ob, stride_oh), PAGE, CFG)
