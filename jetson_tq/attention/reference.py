"""Reference attention over a CompressedKVCache in plain PyTorch (fp32 accumulation, GQA, CPU or CUDA).

These signatures are the contract the Triton kernels implement:
- ``paged_attention_decode(q, kv)``: one new token per sequence over a ``PagedKV`` (compressed pages
  through a block table + an uncompressed recent buffer); ``attention_decode(q, cache)`` is the
  same over a ``CompressedKVCache`` (which already holds the token's K/V).
- ``paged_attention_prefill(q, k, v, kv)`` / ``attention_prefill(q, k, v, cache)``: a chunk of T
  tokens per sequence, causal inside the chunk, full over the history (the chunk is not in it yet).
Scores over compressed tokens use the transformed query (Pi q, S q); keys are never reconstructed.
"""

from __future__ import annotations

import math

import torch

from ..cache.compressed import CompressedKVCache
from ..cache.paged import PagedKV
from ..errors import ShapeError, expect_float, expect_same_device
from ..validate import check_attention_inputs, check_softmax_scale


def _group_query(q: torch.Tensor, cache: PagedKV) -> torch.Tensor:
    """[B, Hq, T, D] -> [B, Hkv, G, T, D] (float32)."""
    b, hq, t, d = q.shape
    if d != cache.head_dim:
        raise ShapeError(f"q: expected head dim {cache.head_dim}, got {d}")
    if b != cache.batch_size:
        raise ShapeError(f"q: expected batch {cache.batch_size}, got {b}")
    if hq % cache.num_kv_heads:
        raise ShapeError(f"q: {hq} query heads is not a multiple of {cache.num_kv_heads} KV heads")
    return q.float().reshape(b, cache.num_kv_heads, hq // cache.num_kv_heads, t, d)


def history_scores_and_values(qg: torch.Tensor, kv: PagedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """Unscaled scores [B, Hkv, G, T, N] of grouped queries against the history, and its values [B, Hkv, N, D].

    N = longest compressed part + longest recent buffer; positions past a sequence's own length get -inf.
    """
    codec = kv.codec
    comp_lens, rec_lens = kv.compressed_lens.long().to(qg.device), kv.recent_lens.long().to(qg.device)
    nc, nb = int(comp_lens.max()), int(rec_lens.max())
    fields = kv.gather_compressed(nc)
    q_rot, q_sketch = codec.transform_query(qg)
    expand = {name: t.unsqueeze(2) for name, t in fields.items()}  # broadcast over the G query heads
    s_comp = codec.key_scores(q_rot, q_sketch, expand)  # [B, Hkv, G, T, nc]
    rec_k = kv.recent_k[kv.recent_index.long(), :, :nb].float()
    rec_v = kv.recent_v[kv.recent_index.long(), :, :nb].float()
    s_buf = qg @ rec_k.unsqueeze(2).transpose(-1, -2)
    mask_c = torch.arange(nc, device=qg.device).unsqueeze(0) >= comp_lens.unsqueeze(1)  # [B, nc]
    mask_b = torch.arange(nb, device=qg.device).unsqueeze(0) >= rec_lens.unsqueeze(1)
    s_comp = s_comp.masked_fill(mask_c[:, None, None, None, :], float("-inf"))
    s_buf = s_buf.masked_fill(mask_b[:, None, None, None, :], float("-inf"))
    values = torch.cat([codec.decode_values(fields), rec_v], dim=2)
    return torch.cat([s_comp, s_buf], dim=-1), values


def _finish(scores: torch.Tensor, values: torch.Tensor, out_shape, dtype) -> torch.Tensor:
    probs = torch.softmax(scores, dim=-1)
    return (probs @ values.unsqueeze(2)).reshape(out_shape).to(dtype)


def paged_attention_decode(q: torch.Tensor, kv: PagedKV, softmax_scale: float | None = None) -> torch.Tensor:
    """Attention of one query token per sequence, q [B, Hq, D], over everything ``kv`` holds -> [B, Hq, D]."""
    expect_float("q", q)
    check_softmax_scale(softmax_scale)
    expect_same_device(q=q, pages=kv.pages)
    if q.dim() != 3:
        raise ShapeError(f"q: expected [B, Hq, D], got {tuple(q.shape)}")
    if bool(((kv.compressed_lens + kv.recent_lens) == 0).any()):
        raise ShapeError("attention_decode: a sequence has an empty cache; append its K/V first")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qg = _group_query(q.unsqueeze(2), kv)
    scores, values = history_scores_and_values(qg, kv)
    return _finish(scores * scale, values, q.shape, q.dtype)


def paged_attention_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV,
                            softmax_scale: float | None = None) -> torch.Tensor:
    """Attention of a chunk q [B, Hq, T, D] over the history in ``kv`` plus the chunk's own k, v [B, Hkv, T, D] (causal)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        expect_float(name, t)
        if t.dim() != 4:
            raise ShapeError(f"{name}: expected a 4-d tensor [B, H, T, D], got {tuple(t.shape)}")
    check_softmax_scale(softmax_scale)
    expect_same_device(q=q, k=k, v=v, pages=kv.pages)
    if k.shape != v.shape or k.shape[1] != kv.num_kv_heads or k.shape[2] != q.shape[2] or k.shape[0] != q.shape[0]:
        raise ShapeError(f"k, v: expected [{q.shape[0]}, {kv.num_kv_heads}, {q.shape[2]}, D], "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qg = _group_query(q, kv)
    t = q.shape[2]
    hist_scores, hist_values = history_scores_and_values(qg, kv)
    # The chunk goes through the buffer dtype, as it will be stored there.
    kc, vc = k.to(kv.recent_k.dtype).float(), v.to(kv.recent_v.dtype).float()
    own = qg @ kc.unsqueeze(2).transpose(-1, -2)  # [B, Hkv, G, T, T]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    own = own.masked_fill(causal, float("-inf"))
    scores = torch.cat([hist_scores, own], dim=-1) * scale
    values = torch.cat([hist_values, vc], dim=2)
    return _finish(scores, values, q.shape, q.dtype)


def attention_decode(q: torch.Tensor, cache: CompressedKVCache, softmax_scale: float | None = None) -> torch.Tensor:
    """Attention of one query token per sequence, q [B, Hq, D], over everything in ``cache`` -> [B, Hq, D]."""
    check_attention_inputs(q, cache, softmax_scale)
    return paged_attention_decode(q, cache.paged(), softmax_scale)


def attention_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: CompressedKVCache,
                      softmax_scale: float | None = None) -> torch.Tensor:
    """Attention of a chunk q [B, Hq, T, D] over the cache history plus the chunk's own k, v [B, Hkv, T, D] (causal)."""
    check_attention_inputs(q, cache, softmax_scale, ("k", k), ("v", v))
    return paged_attention_prefill(q, k, v, cache.paged(), softmax_scale)
