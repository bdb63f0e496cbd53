"""The run-7 chunked-prefill kernel (jetson_tq/kernels/prefill.py at 2ba6ef7), kept only to time it beside its
replacement in run 8 (``bench_prefill.py --variants '[{"impl": "run7"}]'``); delete after.

Chunked prefill: a chunk of T query tokens per sequence over the compressed tokens, the recent ring
and (causally) the chunk's own fp16 keys/values, in one flash-attention pass, under decode's window rule
(``format.exact_start``, mirrored by ``_window_lo``): a query at position p reads positions older than
p + 1 - R (sliding) or than its own R-token block p - p % R (BLOCK_WINDOW) compressed (history and chunk
alike: the pages already hold the chunk) and the rest exactly.

One program = BLOCK_M query rows of one (sequence, KV head); a row is a (token, query head) pair,
so the G query heads of a KV head share every loaded tile (GQA). Each compressed tile of BLOCK_N
tokens is dequantized once per program into whole fp16 [BLOCK_N, D] key and value tiles in registers
(codebook values of the rotated key, codes * scale + zero of the value) and multiplied on the tensor
cores against all BLOCK_M rows at once — one product for the scores and one for the values, as in a
plain fp16 flash-attention loop; the history is never decompressed into memory. (Decode's bit-plane
products pay per row; with 128 rows per tile the per-tile dequantization is the cheaper side.)
Same contract as ``attention.reference.paged_attention_prefill``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from jetson_tq.paged import PagedKV
from jetson_tq.errors import DTypeError, ShapeError, expect_same_device
from jetson_tq.kernels._common import INTERPRET, cuda_or_interpreter, codec_constants
from jetson_tq.kernels._tiles import K_PROD, K_RAW, V_RAW, centroid_lookup, field_tile, mma, online_softmax, run_bits
from jetson_tq.kernels.hybrid_decode import LOG2E, _spec
from jetson_tq.kernels.query_transform import query_transform


@triton.jit
def _window_lo(pos, ring, BLOCK_WINDOW: tl.constexpr):
    """First position a query at ``pos`` reads exactly (``format.exact_start``; ring >= 1 under BLOCK_WINDOW)."""
    if BLOCK_WINDOW:
        return pos - pos % ring
    return pos + 1 - ring


@triton.jit
def _compressed_tile(n0, cend, lo, qk, qs, acc, m_i, l_i, pages_ptr, bt_row, head_off, cb_ptr, qjl_scale,
                     HKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, CH: tl.constexpr, BS: tl.constexpr,
                     PB: tl.constexpr, KEY_MODE: tl.constexpr, KB: tl.constexpr, KW0: tl.constexpr,
                     KW1: tl.constexpr, KW2: tl.constexpr, OFF_KIDX: tl.constexpr, OFF_KSGN: tl.constexpr,
                     OFF_KNORM: tl.constexpr, OFF_KRNORM: tl.constexpr, OFF_KRAW: tl.constexpr,
                     NORM_F32: tl.constexpr, VAL_MODE: tl.constexpr, VW0: tl.constexpr, VW1: tl.constexpr,
                     VW2: tl.constexpr, VB: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
                     OFF_VCODES: tl.constexpr, OFF_VSCALE: tl.constexpr, OFF_VZERO: tl.constexpr,
                     OFF_VRAW: tl.constexpr, RAW_BF16: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
                     INTERP: tl.constexpr):
    """One flash step over compressed tokens [n0, n0 + BLOCK_N): dequantize the key and value tiles once
    ([BLOCK_N, DP], coordinates contiguous), score every row, update (acc, m_i, l_i). ``MASKED``: the tile
    may reach past ``cend`` or past a row's window start ``lo`` (otherwise every row reads all of it)."""
    RAW_T: tl.constexpr = tl.bfloat16 if RAW_BF16 else tl.float16
    n = n0 + tl.arange(0, BLOCK_N)
    j = tl.arange(0, DP)[None, :]
    if MASKED:
        nmask = n < cend
    else:
        nmask = n >= 0
    blk = tl.load(bt_row + n // BS, mask=nmask, other=0)
    base = pages_ptr + (blk.to(tl.int64) * (HKV * PB) + head_off)  # [BLOCK_N] page of each token
    offn = n % BS
    page = base[:, None]
    off = offn[:, None]
    tmask = nmask[:, None] & (j < D)
    if KEY_MODE == K_RAW:
        kt = tl.load((page + OFF_KRAW + off * (2 * D)).to(tl.pointer_type(RAW_T)) + j, mask=tmask, other=0.0)
        s = mma(qk, tl.trans(kt), tl.zeros([qk.shape[0], BLOCK_N], tl.float32), INTERP)
    else:
        code = field_tile(page + OFF_KIDX + off * (CH * KB), tmask, j, CH, KW0, KW1, KW2)
        kt = centroid_lookup(code, cb_ptr, KB, 1)  # [BLOCK_N, DP] fp16: the rotated unit key
        s = mma(qk, tl.trans(kt), tl.zeros([qk.shape[0], BLOCK_N], tl.float32), INTERP)
        if NORM_F32:
            knorm = tl.load((base + OFF_KNORM + offn * 4).to(tl.pointer_type(tl.float32)), mask=nmask, other=0.0)
        else:
            knorm = tl.load((base + OFF_KNORM + offn * 2).to(tl.pointer_type(tl.float16)), mask=nmask, other=0.0).to(tl.float32)
        s = s * knorm[None, :]
        if KEY_MODE == K_PROD:  # + qjl * ||r|| <S q, signs>, signs as a +-1 tile
            sgn = (2 * run_bits(page + OFF_KSGN + off * CH, tmask, j, CH, 1) - 1).to(tl.float16)
            sq = mma(qs, tl.trans(sgn), tl.zeros([qk.shape[0], BLOCK_N], tl.float32), INTERP)
            if NORM_F32:
                rnorm = tl.load((base + OFF_KRNORM + offn * 4).to(tl.pointer_type(tl.float32)), mask=nmask, other=0.0)
            else:
                rnorm = tl.load((base + OFF_KRNORM + offn * 2).to(tl.pointer_type(tl.float16)), mask=nmask,
                                other=0.0).to(tl.float32)
            s = s + sq * (qjl_scale * rnorm)[None, :]
    if MASKED:
        s = tl.where(nmask[None, :] & (n[None, :] < lo[:, None]), s, float("-inf"))
    m_i, alpha, p, l_i = online_softmax(s, m_i, l_i, 1)
    if VAL_MODE == V_RAW:
        vt = tl.load((page + OFF_VRAW + off * (2 * D)).to(tl.pointer_type(RAW_T)) + j, mask=tmask, other=0.0)
        acc = mma(p.to(RAW_T), vt, acc * alpha[:, None], INTERP)
    else:
        code = field_tile(page + OFF_VCODES + off * (CH * VB), tmask, j, CH, VW0, VW1, VW2)
        srow = (page + OFF_VSCALE + off * (2 * NG)).to(tl.pointer_type(tl.float16))
        zrow = (page + OFF_VZERO + off * (2 * NG)).to(tl.pointer_type(tl.float16))
        rmask = nmask[:, None]
        vs = tl.load(srow, mask=rmask, other=0.0).to(tl.float32)
        vz = tl.load(zrow, mask=rmask, other=0.0).to(tl.float32)
        for g in tl.static_range(1, NG):  # per-token scale / zero of each coordinate's group
            sel = (j // GROUP) == g
            vs = tl.where(sel, tl.load(srow + g, mask=rmask, other=0.0).to(tl.float32), vs)
            vz = tl.where(sel, tl.load(zrow + g, mask=rmask, other=0.0).to(tl.float32), vz)
        vt = (code.to(tl.float32) * vs + vz).to(tl.float16)
        acc = mma(p.to(tl.float16), vt, acc * alpha[:, None], INTERP)
    return acc, m_i, l_i


@triton.jit
def _dense_part(k_base, v_base, skt, svt, t_start, n_tok, pos0, ring, RING: tl.constexpr, qpos, lo, qraw, acc,
                m_i, l_i, rk_ptr, rv_ptr, D: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr,
                INTERP: tl.constexpr):
    """Attend to uncompressed tokens [t_start, n_tok) whose positions lie in each row's exact window [lo, qpos]:
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
        s = mma(qraw, tl.trans(kt), tl.zeros([qraw.shape[0], BLOCK_N], tl.float32), INTERP)
        s = tl.where(tmask[None, :] & (pos[None, :] >= lo[:, None]) & (pos[None, :] <= qpos[:, None]), s, float("-inf"))
        m_i, alpha, p, l_i = online_softmax(s, m_i, l_i, 1)
        v = tl.load(v_base + tcol * svt + j, mask=ld, other=0.0).to(rv_ptr.dtype.element_ty)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], INTERP)
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(
        qt_ptr, q_ptr, k_ptr, v_ptr, pages_ptr, bt_ptr, clen_ptr, rk_ptr, rv_ptr, rlen_ptr, ridx_ptr, cb_ptr,
        out_ptr, T, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
        stride_vb, stride_vh, stride_vt, stride_bt,
        stride_rkn, stride_rkh, stride_rkt, stride_rvn, stride_rvh, stride_rvt,
        stride_ob, stride_oh, stride_ot, scale_log2, qjl_scale, ring,
        HKV: tl.constexpr, G: tl.constexpr, QW: tl.constexpr,
        D: tl.constexpr, DP: tl.constexpr, CH: tl.constexpr, BS: tl.constexpr, PB: tl.constexpr,
        KEY_MODE: tl.constexpr, KB: tl.constexpr, KW0: tl.constexpr, KW1: tl.constexpr, KW2: tl.constexpr,
        KCW: tl.constexpr, KCH: tl.constexpr, OFF_KIDX: tl.constexpr, OFF_KSGN: tl.constexpr,
        OFF_KNORM: tl.constexpr, OFF_KRNORM: tl.constexpr, OFF_KRAW: tl.constexpr, NORM_F32: tl.constexpr,
        VAL_MODE: tl.constexpr, VB: tl.constexpr, VW0: tl.constexpr, VW1: tl.constexpr, VW2: tl.constexpr,
        VCW: tl.constexpr, VCH: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
        OFF_VCODES: tl.constexpr, OFF_VSCALE: tl.constexpr, OFF_VZERO: tl.constexpr, OFF_VRAW: tl.constexpr,
        RAW_BF16: tl.constexpr, BLOCK_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        INTERP: tl.constexpr):
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
    KQ_T: tl.constexpr = RAW_T if KEY_MODE == K_RAW else tl.float16

    # the transformed query (Pi q, and S q for prod keys), loaded once as tensor-core operands
    j = tl.arange(0, DP)[None, :]
    qmask = rmask[:, None] & (j < D)
    qk = tl.load(qt_ptr + qrow[:, None] * QW + j, mask=qmask, other=0.0).to(KQ_T)
    if KEY_MODE == K_PROD:
        qs = tl.load(qt_ptr + qrow[:, None] * QW + D + j, mask=qmask, other=0.0).to(tl.float16)
    else:
        qs = qk
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)

    # ---- compressed tokens (history and, past the window, the chunk: the pages hold both): tiles every row reads
    # whole, then the tiles at the window edge (masked)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    head_off = h.to(tl.int64) * PB
    cend = tl.maximum(lo_last, 0)
    cfull = tl.maximum(lo_first, 0) // BLOCK_N * BLOCK_N
    for n0 in range(0, cfull, BLOCK_N):
        acc, m_i, l_i = _compressed_tile(
            n0, cend, lo, qk, qs, acc, m_i, l_i, pages_ptr, bt_row, head_off, cb_ptr, qjl_scale, HKV, D, DP, CH, BS,
            PB, KEY_MODE, KB, KW0, KW1, KW2, OFF_KIDX, OFF_KSGN, OFF_KNORM, OFF_KRNORM, OFF_KRAW, NORM_F32, VAL_MODE,
            VW0, VW1, VW2, VB, GROUP, NG, OFF_VCODES, OFF_VSCALE, OFF_VZERO, OFF_VRAW, RAW_BF16, False, BLOCK_N, INTERP)
    for n0 in range(cfull, cend, BLOCK_N):
        acc, m_i, l_i = _compressed_tile(
            n0, cend, lo, qk, qs, acc, m_i, l_i, pages_ptr, bt_row, head_off, cb_ptr, qjl_scale, HKV, D, DP, CH, BS,
            PB, KEY_MODE, KB, KW0, KW1, KW2, OFF_KIDX, OFF_KSGN, OFF_KNORM, OFF_KRNORM, OFF_KRAW, NORM_F32, VAL_MODE,
            VW0, VW1, VW2, VB, GROUP, NG, OFF_VCODES, OFF_VSCALE, OFF_VZERO, OFF_VRAW, RAW_BF16, True, BLOCK_N, INTERP)

    # ---- the exact window: ring rows, then the chunk itself (both uncompressed)
    qraw = (tl.load(q_ptr + b.to(tl.int64) * stride_qb + hq[:, None].to(tl.int64) * stride_qh
                    + tok[:, None].to(tl.int64) * stride_qt + j, mask=qmask, other=0.0).to(tl.float32) * scale_log2
            ).to(rk_ptr.dtype.element_ty)
    ridx = tl.load(ridx_ptr + b).to(tl.int64)
    ring_rows = tl.where(lo_first < hist, rlen, 0)  # skip the ring once the window left it
    acc, m_i, l_i = _dense_part(rk_ptr + ridx * stride_rkn + h.to(tl.int64) * stride_rkh,
                                rv_ptr + ridx * stride_rvn + h.to(tl.int64) * stride_rvh,
                                stride_rkt, stride_rvt, 0, ring_rows, clen, tl.maximum(ring, 1), True, qpos, lo,
                                qraw, acc, m_i, l_i, rk_ptr, rv_ptr, D, DP, BLOCK_N, INTERP)
    t_start = tl.maximum(lo_first - hist, 0) // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _dense_part(k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh,
                                v_ptr + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh,
                                stride_kt, stride_vt, t_start, last_tok + 1, hist, 1, False, qpos, lo,
                                qraw, acc, m_i, l_i, rk_ptr, rv_ptr, D, DP, BLOCK_N, INTERP)

    inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
    optr = (out_ptr + b.to(tl.int64) * stride_ob + hq[:, None].to(tl.int64) * stride_oh
            + tok[:, None].to(tl.int64) * stride_ot + j)
    tl.store(optr, (acc * inv[:, None]).to(out_ptr.dtype.element_ty), mask=qmask)


BLOCK_N = 64  # H200 run 7: 32 was 20 % slower (11.5 vs 9.5 ms, chunk 2048 over 32k, 32/8)
NUM_WARPS = 8  # 64-row warp groups: Triton emits wgmma on sm_90
NUM_STAGES = 1  # H200 run 7: 8.0 / 8.4 ms vs 9.5 / 9.5 ms with 2 stages (32/8, 28/4); 3 stages 9.6 ms


def default_block_m(head_dim: int) -> int:
    """Rows per program: 128 (two 64-row warp groups) up to head_dim 128, 64 beyond (the fp32 accumulator
    [BLOCK_M, D] must stay in registers)."""
    return 128 if head_dim <= 128 else 64


def chunked_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV,
                    softmax_scale: float | None = None, *, out: torch.Tensor | None = None,
                    block_m: int | None = None, block_n: int = BLOCK_N, num_warps: int = NUM_WARPS,
                    num_stages: int = NUM_STAGES) -> torch.Tensor:
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
    block_m = block_m or default_block_m(d)
    grid = (bsz * hkv, triton.cdiv(t_len * g, block_m))
    _prefill_kernel[grid](
        qt, q, k, v, kv.pages, kv.block_table, kv.compressed_lens, rk, rv, kv.recent_lens, kv.recent_index,
        consts["codebook"], out, t_len, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), kv.block_table.stride(0),
        rk.stride(0), rk.stride(1), rk.stride(2), rv.stride(0), rv.stride(1), rv.stride(2),
        out.stride(0), out.stride(1), out.stride(2), scale * LOG2E, kv.codec.qjl_scale, ring,
        HKV=hkv, G=g, QW=qt.shape[1], **spec_kw, BLOCK_WINDOW=kv.layout.fmt.block_window and ring > 0,
        BLOCK_M=block_m, BLOCK_N=block_n, INTERP=INTERPRET, num_warps=num_warps, num_stages=num_stages)
    return out
