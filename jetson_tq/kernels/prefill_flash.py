"""Chunked prefill through an external FlashAttention varlen kernel (vLLM's own FA2 / FA3) over the dequantized
history, for the block window (``format.exact_start``: a query at position p in block b = p // R reads [0, b R)
compressed and [b R, p] exactly).

Every prefill row of a step goes in one call (``flash_prefill_rows``: ragged chunks, concatenated rows, vLLM's
layout; ``flash_prefill`` is the [B, H, T, D] form). Each chunk is cut into one sub-sequence per R-token block it
touches (``prefill_flash_plan``: the host plan, built once per step). ``prefill.dequantize_segment`` writes the
history's compressed blocks into a token-major workspace that the kernel reads as a paged cache, keys rotated back
(so the raw queries score them, as they score the exact tokens), and, when that history fits one workspace segment:

- one causal varlen call: each block's exact tokens (the ring's part of a chunk's first block, then the chunk's rows)
  are copied into a workspace page of their own, and each sub-sequence's page table is its sequence's dequantized
  pages before its block, then that page; the mask from the bottom right gives each row its window split.

A longer history (several segments) takes two kinds of calls instead:

B. exact: each sub-sequence's queries against its own block's exact tokens (packed, causal from the bottom right);
A. compressed, per workspace segment: each sub-sequence's queries against the segment's part of the first b R tokens
   of its sequence's history, non-causal, and ``merge_states`` adds A's (output, log-sum-exp) into B's.

Same contract as ``attention.reference.paged_attention_prefill``; the Triton loop of ``prefill`` serves
what this does not (``flash_unsupported_reason``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from ..attention.extras import NO_EXTRAS, AttentionExtras
from ..attention.reference import VarlenAttention
from ..errors import ShapeError
from ..paged import PagedKV
from ._common import KEY_KLT, KEY_MSE, VAL_GROUP, VAL_MSE, codec_constants, page_spec
from .merge_states import merge_states
from .prefill_flash_plan import FlashPlan, OneCall, plan_flash_rows
from .prefill_plan import DEQUANT_TOKENS, _check_inputs, dequantize_segment


def flash_unsupported_reason(kv: PagedKV, dtype: torch.dtype, extras: AttentionExtras = NO_EXTRAS) -> str | None:
    """Why ``flash_prefill`` cannot serve a chunk of ``dtype`` over ``kv`` with ``extras`` (None: it can)."""
    if extras.any:
        return f"sinks, soft cap and sliding window are served by the Triton loop (got {extras})"
    spec, _ = page_spec(kv.layout, kv.codec)
    ring = kv.recent_k.shape[2]
    if dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention takes fp16 / bf16 queries, got {dtype}"
    if spec.KEY_MODE not in (KEY_MSE, KEY_KLT) or spec.VAL_MODE not in (VAL_GROUP, VAL_MSE):
        return "only mse or klt keys with group or mse values are dequantized into an fp16 workspace of one dtype"
    if not (kv.layout.fmt.block_window and ring > 0 and ring % 16 == 0):
        return f"needs the block window with a ring of a multiple of 16 tokens (got {kv.layout.fmt.window}, R={ring})"
    if kv.recent_k.dtype not in (torch.float16, torch.bfloat16):
        return f"the ring's {kv.recent_k.dtype} is no FlashAttention dtype"
    return None


def plan_for(
    kv: PagedKV, history: Sequence[int] | np.ndarray, query_start_loc: Sequence[int] | np.ndarray, **kw
) -> FlashPlan:
    """``plan_flash_rows`` for ``kv``'s shapes (ring, KV heads, workspace row width) on its device."""
    dp = page_spec(kv.layout, kv.codec)[0].DP
    return plan_flash_rows(history, query_start_loc, kv.recent_k.shape[2], kv.num_kv_heads, dp, kv.pages.device, **kw)


def flash_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKV,
    history: Sequence[int],
    varlen: VarlenAttention,
    softmax_scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    workspace_tokens: int | None = None,
    extras: AttentionExtras = NO_EXTRAS,
) -> torch.Tensor:
    """Attention of q [B, Hq, T, D] over ``kv``'s history plus the chunk's own k, v [B, Hkv, T, D] (the pages already
    hold the chunk), like ``prefill.chunked_prefill``, with ``varlen`` doing the attention. ``history``: each
    sequence's history length on the host (compressed_lens + recent_lens, which vLLM knows without a sync).
    ``extras``: none served here (``flash_unsupported_reason``; ``ops.prefill`` sends them to the Triton loop)."""
    _check_inputs(q, k, v, kv)
    bsz, hq, t_len, d = q.shape
    if len(history) != bsz or min(history, default=0) < 0:
        raise ShapeError(f"history: expected {bsz} lengths >= 0, got {list(history)}")
    reason = flash_unsupported_reason(kv, q.dtype, extras)
    if reason:
        raise ShapeError(f"flash_prefill: {reason}")
    out = torch.empty_like(q) if out is None else out
    if t_len == 0:
        return out
    plan = plan_for(kv, history, np.arange(bsz + 1) * t_len, workspace_tokens=workspace_tokens)
    tok = [x.transpose(1, 2).reshape(bsz * t_len, -1, d) for x in (q, k, v)]  # rows b * T + t (views for vLLM's)
    o = flash_prefill_rows(tok[0], tok[1], tok[2], kv, plan, varlen, softmax_scale)
    out.copy_(o.view(bsz, t_len, hq, d).transpose(1, 2))
    return out


def flash_prefill_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKV,
    plan: FlashPlan,
    varlen: VarlenAttention,
    softmax_scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a step's ragged chunks: q [N, Hq, D], k, v [N, Hkv, D] (rows of sequence b: ``plan``'s
    query_start_loc range; ``kv`` holds the n sequences, its pages already the chunks) -> out [N, Hq, D]. With
    ``plan.one_call`` (the history fits one workspace segment) the dequantization, the exact tokens' copy into
    their blocks' pages and one causal varlen call; else part B, then part A per workspace segment and its merge.
    The caller checks ``flash_unsupported_reason``."""
    n_rows, hq, d = q.shape
    hkv = kv.num_kv_heads
    if k.shape != (n_rows, hkv, d) or v.shape != k.shape or plan.rows != n_rows or plan.sequences != kv.batch_size:
        raise ShapeError(
            f"flash_prefill_rows: expected q [{plan.rows}, Hq, {kv.head_dim}], k, v [{plan.rows}, {hkv}, "
            f"{kv.head_dim}] over {plan.sequences} sequences; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)} and {kv.batch_size}"
        )
    if n_rows == 0:
        return torch.empty_like(q) if out is None else out
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if plan.one_call is not None:
        o = _one_call(q, k, v, kv, plan, plan.one_call, varlen, scale)
    else:
        o = _exact_then_segments(q, k, v, kv, plan, varlen, scale)
    if out is None:
        return o
    out.copy_(o)
    return out


def _workspace(
    kv: PagedKV, plan: FlashPlan, dtype: torch.dtype, exact_pages: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token-major workspace (keys, values [tokens, Hkv, DP] in the queries' dtype: one segment of every
    sequence, then ``exact_pages`` R-token pages) and its paged views [pages, R, Hkv, D] that FlashAttention reads."""
    dp, ring, hkv = page_spec(kv.layout, kv.codec)[0].DP, plan.ring, kv.num_kv_heads
    tokens = plan.sequences * plan.seg + exact_pages * ring
    wk = torch.empty(tokens, hkv, dp, dtype=dtype, device=kv.pages.device)
    wv = torch.empty_like(wk)
    pk, pv = (w.view(tokens // ring, ring, hkv, dp)[..., : kv.head_dim] for w in (wk, wv))
    return wk, wv, pk, pv


def _dequantize(kv: PagedKV, plan: FlashPlan, wk: torch.Tensor, wv: torch.Tensor, s0: int) -> None:
    """Every sequence's compressed tokens [s0, s0 + seg) below its last row's block into the workspace's first
    sequences x seg tokens, keys rotated back (scored against the raw query, as the exact tokens are)."""
    seg = plan.seg
    consts = codec_constants(kv.codec, kv.pages.device)
    # the dequantizer reads each sequence's positions below its last row's block start: with T = 1 it takes that
    # row's position from compressed_lens + recent_lens, so one launch serves chunks of any lengths
    last_row = replace(kv, compressed_lens=plan.last, recent_lens=plan.zeros)
    n = plan.sequences * seg
    dequantize_segment(
        last_row,
        consts["codebook"],
        wk[:n],
        wv[:n],
        s0,
        seg,
        1,
        plan.ring,
        True,
        DEQUANT_TOKENS,
        True,
        unrotate_keys=True,
    )


def _ring_tokens(kv: PagedKV, plan: FlashPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring's tokens of each sequence's first block (``plan.ring_seq``, ``plan.ring_col``): keys, values
    [ring tokens, Hkv, D]."""
    rows = kv.recent_index.long().index_select(0, plan.ring_seq)  # two index tensors around ':': [n, H, D]
    return kv.recent_k[rows, :, plan.ring_col], kv.recent_v[rows, :, plan.ring_col]


def _one_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKV,
    plan: FlashPlan,
    one: OneCall,
    varlen: VarlenAttention,
    scale: float,
) -> torch.Tensor:
    """Both parts in one causal call (``OneCall``): the dequantized history, each block's exact tokens in its own
    page after it (the chunk's rows, the ring's tokens of each sequence's first block), then FlashAttention with
    each sub-sequence's page table."""
    wk, wv, pk, pv = _workspace(kv, plan, q.dtype, one.pages - one.base)
    _dequantize(kv, plan, wk, wv, 0)
    d = kv.head_dim
    wk[one.row_dst, :, :d] = k.to(wk.dtype)
    wv[one.row_dst, :, :d] = v.to(wv.dtype)
    if one.ring_dst.numel():
        rk, rv = _ring_tokens(kv, plan)
        wk[one.ring_dst, :, :d] = rk.to(wk.dtype)
        wv[one.ring_dst, :, :d] = rv.to(wv.dtype)
    o, _ = varlen(q, pk, pv, plan.cu_q, plan.max_q, one.max_k, scale, True, seqused_k=one.used, block_table=one.table)
    return o


def _exact_then_segments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKV,
    plan: FlashPlan,
    varlen: VarlenAttention,
    scale: float,
) -> torch.Tensor:
    """Part B (each row against its block's exact tokens, causal), then part A per workspace segment of the
    dequantized history (non-causal) merged into it: a history longer than one segment, or none at all."""
    hkv, d = kv.num_kv_heads, kv.head_dim
    if plan.keys_are_rows and k.is_contiguous() and v.is_contiguous():
        kx, vx = k, v  # no ring tokens (every history a whole number of blocks): the chunk rows as they are
    else:
        kx = k.new_empty(plan.exact_keys, hkv, d)
        vx = v.new_empty(plan.exact_keys, hkv, d)
        kx.index_copy_(0, plan.key_rows, k)
        vx.index_copy_(0, plan.key_rows, v)
    if plan.ring_dst.numel():
        rk, rv = _ring_tokens(kv, plan)
        kx[plan.ring_dst] = rk.to(k.dtype)
        vx[plan.ring_dst] = rv.to(v.dtype)
    o, lse = varlen(q, kx, vx, plan.cu_q, plan.max_q, plan.max_k, scale, True, cu_seqlens_k=plan.cu_k)
    if plan.segments:
        wk, wv, pk, pv = _workspace(kv, plan, q.dtype, 0)
        for part in plan.segments:
            _dequantize(kv, plan, wk, wv, part.s0)
            qa = q[part.row_span[0] : part.row_span[1]] if part.row_span else q.index_select(0, part.rows)
            oa, la = varlen(
                qa,
                pk,
                pv,
                part.cu_q,
                part.max_q,
                part.max_k,
                scale,
                False,
                seqused_k=part.used,
                block_table=part.table,
            )
            merge_states(o, lse, oa, la.contiguous(), part.rows)
    return o
