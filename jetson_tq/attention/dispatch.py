"""One entry point per operation that picks the Triton kernel or the PyTorch reference.

``backend``: "reference", "triton", or "auto" (default). "auto" uses ``JETSON_TQ_BACKEND`` when
set ("reference" / "triton"), else Triton for CUDA tensors and the reference on the CPU; it also
falls back to the reference for a format no kernel handles (``kernels._common.unsupported_reason``).
An explicit "triton" on CPU tensors needs ``TRITON_INTERPRET=1`` set before triton is imported.
Kernels are imported lazily, so CPU-only users never import Triton.
"""

from __future__ import annotations

import os

import torch

from ..cache.compressed import CompressedKVCache
from ..cache.paged import PagedKV, write_slots
from ..codec.kv import KVCodec
from ..errors import ConfigError, ShapeError, UnsupportedPlatformError
from ..format import PagedLayout
from ..validate import check_attention_inputs
from .reference import paged_attention_decode, paged_attention_prefill

BACKENDS = ("auto", "reference", "triton")
ENV_VAR = "JETSON_TQ_BACKEND"


def resolve_backend(backend: str, device: torch.device, layout: PagedLayout | None = None) -> str:
    """The concrete backend ("reference" or "triton") for tensors on ``device`` in ``layout``'s format."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        env = os.environ.get(ENV_VAR, "").strip().lower()
        if env and env not in ("reference", "triton"):
            raise ConfigError(f"{ENV_VAR}: expected 'reference' or 'triton', got {env!r}")
        backend = env or ("triton" if device.type == "cuda" else "reference")
        if backend == "triton" and layout is not None and _unsupported(layout):
            return "reference"
        return backend
    if backend == "triton" and layout is not None and _unsupported(layout):
        raise UnsupportedPlatformError(f"backend 'triton': {_unsupported(layout)}")
    return backend


def _unsupported(layout: PagedLayout) -> str | None:
    from ..kernels._common import unsupported_reason

    return unsupported_reason(layout)


def _as_paged(cache_or_kv: CompressedKVCache | PagedKV, need_tokens: bool) -> PagedKV:
    if isinstance(cache_or_kv, CompressedKVCache):
        if need_tokens and bool((cache_or_kv.lengths == 0).any()):  # host-side lengths: no device sync
            raise ShapeError("attention_decode: a sequence has an empty cache; append its K/V first")
        return cache_or_kv.paged()
    if isinstance(cache_or_kv, PagedKV):
        return cache_or_kv
    raise ShapeError(f"expected a CompressedKVCache or PagedKV, got {type(cache_or_kv).__name__}")


def decode(q: torch.Tensor, cache_or_kv: CompressedKVCache | PagedKV, softmax_scale: float | None = None,
           backend: str = "auto") -> torch.Tensor:
    """Attention of one query token per sequence, q [B, Hq, D], over a cache -> [B, Hq, D]."""
    check_attention_inputs(q, cache_or_kv, softmax_scale)
    kv = _as_paged(cache_or_kv, need_tokens=True)
    if resolve_backend(backend, q.device, kv.layout) == "triton":
        from ..kernels.hybrid_decode import hybrid_decode

        return hybrid_decode(q, kv, softmax_scale)
    return paged_attention_decode(q, kv, softmax_scale)


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_or_kv: CompressedKVCache | PagedKV,
            softmax_scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Attention of a chunk q [B, Hq, T, D] over the cache history plus its own k, v [B, Hkv, T, D] (causal)."""
    check_attention_inputs(q, cache_or_kv, softmax_scale, ("k", k), ("v", v))
    kv = _as_paged(cache_or_kv, need_tokens=False)
    if resolve_backend(backend, q.device, kv.layout) == "triton":
        from ..kernels.prefill import chunked_prefill

        return chunked_prefill(q, k, v, kv, softmax_scale)
    return paged_attention_prefill(q, k, v, kv, softmax_scale)


def write(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor, layout: PagedLayout,
          codec: KVCodec, backend: str = "auto") -> None:
    """Compress k, v [N, H, D] and store them at ``slots`` [N] of ``pages`` (slot < 0 skipped, as vLLM pads)."""
    if resolve_backend(backend, k.device, layout) == "triton":
        from ..kernels.compress_write import compress_write

        compress_write(k, v, slots, pages, layout, codec)
        return
    write_slots(pages, layout, slots, codec.encode(k, v))
