"""The public attention entry points over a ``CompressedKVCache`` (``jetson_tq.attention_decode`` and friends).

They run through ``ops`` — the Triton kernels for CUDA tensors, the PyTorch reference on the CPU — over the
cache's persistent paged view (lengths on the device), so a decode call adds no host sync and can be captured
in a CUDA graph.
"""

from __future__ import annotations

import torch

from . import ops
from .cache.compressed import CompressedKVCache
from .errors import ShapeError
from .paged import PagedKV
from .validate import check_attention_inputs, check_attention_mask, check_attention_output


def _view(cache: CompressedKVCache | PagedKV, name: str) -> PagedKV:
    if isinstance(cache, CompressedKVCache):
        return cache.paged()
    if isinstance(cache, PagedKV):
        return cache
    raise ShapeError(f"{name}: expected a CompressedKVCache or PagedKV as cache, got {type(cache).__name__}")


def _check_query(q: torch.Tensor, rank: int, name: str) -> None:
    want = "[B, Hq, D]" if rank == 3 else "[B, Hq, T, D]"
    if q.dim() != rank:
        raise ShapeError(f"{name}: expected q {want}, got {tuple(q.shape)}")
    if q.shape[1] < 1:
        raise ShapeError(f"{name}: expected q {want} with at least one query head, got {tuple(q.shape)}")


def attention_decode(
    q: torch.Tensor, cache: CompressedKVCache | PagedKV, softmax_scale: float | None = None, backend: str | None = None
) -> torch.Tensor:
    """Attention of one query token per sequence, q [B, Hq, D], over everything in ``cache`` -> [B, Hq, D].

    A sequence with nothing cached is an error on the host-checked eager path and zeros inside a CUDA graph.
    """
    check_attention_inputs(q, cache, softmax_scale)
    _check_query(q, 3, "attention_decode")
    if (
        isinstance(cache, CompressedKVCache)
        and not (q.is_cuda and torch.cuda.is_current_stream_capturing())
        and cache.has_empty_sequence()
    ):
        raise ShapeError("attention_decode: a sequence has an empty cache; append its K/V first")
    out = ops.decode(q, _view(cache, "attention_decode"), softmax_scale, backend)
    check_attention_output("attention_decode", out, q, cache, softmax_scale)
    return out


def attention_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: CompressedKVCache | PagedKV,
    softmax_scale: float | None = None,
    backend: str | None = None,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill a chunk: attention of q [B, Hq, T, D] over the cache history plus the chunk's own k, v [B, Hkv, T, D]
    (causal), and — for a ``CompressedKVCache`` — append the chunk to the cache.

    Positions older than ``fmt.exact_start(p)`` (p + 1 - R, or p's own R-token block) are read compressed and the
    rest exactly, as in decode, so the result does not depend on the chunk size. A ``PagedKV`` must already hold the
    chunk in its pages (vLLM's contract). With validation on the kernel path the chunk's checks run inside its
    compress-on-write launch and the call never waits for the GPU: the commit is skipped on the device when the
    checks refused the chunk (nothing kept), and the named error is raised by this call when the device's record has
    already reached the host, else by the next call on the cache or ``cache.check()`` (as for ``append``).
    """
    check_attention_inputs(q, cache, softmax_scale, ("k", k), ("v", v))
    _check_query(q, 4, "attention_prefill")
    if attn_mask is not None:
        check_attention_mask(attn_mask, q, cache)
    if not isinstance(cache, CompressedKVCache):
        out = ops.prefill(q, k, v, _view(cache, "attention_prefill"), softmax_scale, backend, attn_mask)
        check_attention_output("attention_prefill", out, q, cache, softmax_scale)
        return out
    max_tokens = cache.max_tokens(k.shape[2])  # host mirror: sizes the kernel's workspace to the history, no sync
    cache.stage(k, v, check=False)  # a refused chunk is named below, after the attention launch (no GPU bubble)
    out = ops.prefill(q, k, v, cache.paged(), softmax_scale, backend, attn_mask, max_tokens=max_tokens)
    cache.raise_store_fault(wait=False)  # a refused chunk's named error when its record is on the host (no wait)
    check_attention_output("attention_prefill", out, q, cache, softmax_scale)  # before the chunk is kept
    cache.commit(k, v)  # skipped on the device when the write's checks refused the chunk
    return out


def turboquant_scores(Q, K_idx, qjl_signs, gamma, Pi, S_mat, codebook, backend: str | None = None) -> torch.Tensor:
    """Raw TurboQuant_prod scores [B, S] in fp32 (the Triton kernel for CUDA inputs; see ``codec.scores``)."""
    return ops.scores(Q, K_idx, qjl_signs, gamma, Pi, S_mat, codebook, backend)
