"""Chunked prefill through an external FlashAttention varlen kernel (vLLM's own FA2 / FA3) over the dequantized
history, for the block window (``format.exact_start``: a query at position p in block b = p // R reads [0, b R)
compressed and [b R, p] exactly).

The chunk is cut into one sub-sequence per R-token block it touches, and two varlen calls cover every row:

A. compressed: each sub-sequence's rotated queries Pi q against the first b R tokens of its sequence's dequantized
   history (``prefill.dequantize_segment`` writes a token-major workspace that the kernel reads as a paged cache,
   every sub-sequence of a sequence sharing its pages; keys stay rotated, so no key is reconstructed), non-causal;
B. exact: each sub-sequence's raw queries against its own block's exact tokens (the ring's part of the first block,
   then the chunk's rows; packed, causal from the bottom right);

then ``merge_states`` adds A's (output, log-sum-exp) into B's. A history longer than the workspace runs A once per
segment. Same contract as ``attention.reference.paged_attention_prefill``; the Triton loop of ``prefill`` serves
what this does not (``flash_unsupported_reason``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import triton

from ..attention.extras import NO_EXTRAS, AttentionExtras
from ..attention.reference import VarlenAttention
from ..errors import ShapeError
from ..paged import PagedKV
from ._common import KEY_KLT, KEY_MSE, VAL_GROUP, VAL_MSE, codec_constants, page_spec
from .merge_states import merge_states
from .prefill_plan import DEQUANT_TOKENS, WORKSPACE_BYTES, _check_inputs, dequantize_segment, workspace_segment
from .query_transform import query_transform


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


def _blocks(hist: int, t_len: int, ring: int) -> list[tuple[int, int, int]]:
    """(block start b R, first chunk row, end chunk row) of each R-token block the chunk [hist, hist + T) touches."""
    first, last = hist // ring, (hist + t_len - 1) // ring
    return [
        (j * ring, max(hist, j * ring) - hist, min(hist + t_len, (j + 1) * ring) - hist) for j in range(first, last + 1)
    ]


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
    reason = flash_unsupported_reason(kv, q.dtype, extras)
    if reason:
        raise ShapeError(f"flash_prefill: {reason}")
    bsz, hq, t_len, d = q.shape
    if len(history) != bsz or min(history, default=0) < 0:
        raise ShapeError(f"history: expected {bsz} lengths >= 0, got {list(history)}")
    out = torch.empty_like(q) if out is None else out
    if t_len == 0:
        return out
    dev, hkv, ring = q.device, kv.num_kv_heads, kv.recent_k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qtok = q.transpose(1, 2).reshape(bsz * t_len, hq, d)  # token-major rows b * T + t (a view for vLLM's layout)
    blocks = [_blocks(int(s), t_len, ring) for s in history]

    # ---- the host plan of both parts, sent to the device in one pinned copy (a pageable copy waits for the stream)
    top = max(bl[-1][0] for bl in blocks)  # the last block start: every compressed key any row reads lies below it
    page = ring
    step = page * DEQUANT_TOKENS // math.gcd(page, DEQUANT_TOKENS)
    dp = page_spec(kv.layout, kv.codec)[0].DP
    seg = triton.cdiv(workspace_tokens or workspace_segment(bsz, hkv, 4 * dp, max(top, 1), step, WORKSPACE_BYTES), step)
    seg *= step
    cu_q, cu_k = [0], [0]
    for b, s in enumerate(history):
        for j, (_, r0, r1) in enumerate(blocks[b]):
            cu_q.append(b * t_len + r1)
            cu_k.append(cu_k[-1] + (r1 - r0) + (int(s) % ring if j == 0 else 0))
    host: list[list[int]] = [cu_q, cu_k]
    segments = []  # (s0, sub-sequences, rows) of part A per workspace segment
    for s0 in range(0, top, seg):
        subs = [(b, r0, r1, min(start, s0 + seg) - s0) for b in range(bsz) for start, r0, r1 in blocks[b] if start > s0]
        rows = [b * t_len + r for b, r0, r1, _ in subs for r in range(r0, r1)]
        cu = [0, *np.cumsum([r1 - r0 for _, r0, r1, _ in subs]).tolist()]
        segments.append((s0, subs, len(host)))
        host += [cu, [u for *_, u in subs], [b for b, *_ in subs], rows]
    sizes = [len(x) for x in host]
    pad = [-n % 4 for n in sizes]  # every part 16-byte aligned (Triton specializes the merge on its pointers)
    packed = torch.from_numpy(
        np.concatenate([np.pad(np.asarray(x, dtype=np.int32), (0, p)) for x, p in zip(host, pad)])
    )
    packed = packed.pin_memory() if dev.type == "cuda" else packed
    dev_parts = [
        x[:n] for x, n in zip(packed.to(dev, non_blocking=True).split([n + p for n, p in zip(sizes, pad)]), sizes)
    ]

    # ---- B: exact part, every row (own block: the ring's first-block tokens, then the chunk's rows), causal
    keys: list[torch.Tensor] = []
    vals: list[torch.Tensor] = []
    for b, s in enumerate(history):
        r = int(s) % ring  # ring tokens of the first block: positions [s - r, s) at columns [0, r)
        if r:
            row = kv.recent_index[b : b + 1].long()  # the sequence's ring row, gathered on the device (no sync)
            keys.append(kv.recent_k.index_select(0, row)[0, :, :r].transpose(0, 1).to(k.dtype))
            vals.append(kv.recent_v.index_select(0, row)[0, :, :r].transpose(0, 1).to(v.dtype))
        keys.append(k[b].transpose(0, 1))
        vals.append(v[b].transpose(0, 1))
    kx, vx = torch.cat(keys), torch.cat(vals)
    max_q = max(r1 - r0 for bl in blocks for _, r0, r1 in bl)
    max_k = int(np.diff(cu_k).max())
    o, lse = varlen(qtok, kx, vx, dev_parts[0], max_q, max_k, scale, True, cu_seqlens_k=dev_parts[1])

    # ---- A: compressed part, segment by segment of the dequantized history
    if segments:
        consts = codec_constants(kv.codec, dev)
        qrot = query_transform(qtok, consts["qmat"], 1.0, qmat16=consts["qmat16"]).view(bsz * t_len, hq, d)
        qrot = qrot.to(torch.float16)
        wk = torch.empty(bsz, seg, hkv, dp, dtype=torch.float16, device=dev)
        wv = torch.empty_like(wk)
        pk = wk.view(bsz * seg // page, page, hkv, dp)[..., :d]
        pv = wv.view(bsz * seg // page, page, hkv, dp)[..., :d]
        pages_of = torch.arange(seg // page, dtype=torch.int32, device=dev)
        for s0, subs, at in segments:
            dequantize_segment(kv, consts["codebook"], wk, wv, s0, seg, t_len, ring, True, DEQUANT_TOKENS, True)
            cu, used, seq, rows = dev_parts[at : at + 4]
            table = seq[:, None] * (seg // page) + pages_of  # every sub-sequence reads its own sequence's pages
            oa, la = varlen(
                qrot.index_select(0, rows),
                pk,
                pv,
                cu,
                max(r1 - r0 for _, r0, r1, _ in subs),
                max(u for *_, u in subs),
                scale,
                False,
                seqused_k=used,
                block_table=table,
            )
            merge_states(o, lse, oa, la.contiguous(), rows)
    out.copy_(o.view(bsz, t_len, hq, d).transpose(1, 2))
    return out
