"""The three operations the backend needs, through jetson-tq's kernel dispatcher when it is available.

``jetson_tq.attention.dispatch`` (Triton on CUDA, reference on CPU) is imported lazily; while it is
absent, or when ``JETSON_TQ_BACKEND=reference``, the PyTorch reference functions run. The reference
path syncs with the host (it sizes tensors from lengths), so CUDA graphs are only declared when
the dispatcher's Triton path is in use (``graph_safe``).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from ...attention.reference import paged_attention_decode, paged_attention_prefill
from ...cache.paged import PagedKV, write_slots
from ...codec.kv import KVCodec
from ...errors import UnsupportedPlatformError
from ...format import PagedLayout
from .settings import ops_backend


@functools.lru_cache(maxsize=1)
def _dispatch() -> ModuleType | None:
    try:
        from ...attention import dispatch  # type: ignore[attr-defined]
    except ImportError:
        return None
    return dispatch


def kernels(device: torch.device) -> str:
    """'triton' or 'reference': what runs on ``device`` under JETSON_TQ_BACKEND."""
    choice = ops_backend()
    if choice == "reference":
        return "reference"
    usable = device.type == "cuda" and _dispatch() is not None
    if choice == "triton" and not usable:
        raise UnsupportedPlatformError(
            f"JETSON_TQ_BACKEND=triton needs CUDA and jetson_tq.attention.dispatch; got device {device}, "
            f"dispatch {'present' if _dispatch() is not None else 'missing'}")
    return "triton" if usable else "reference"


def graph_safe(device: torch.device) -> bool:
    """True when every op on ``device`` is free of host syncs (CUDA graphs can capture decode)."""
    return kernels(device) == "triton"


def write(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor, layout: PagedLayout,
          codec: KVCodec) -> None:
    """Compress k, v [N, H, D] into ``pages`` at vLLM slots (slot < 0 skipped)."""
    if kernels(k.device) == "triton":
        _dispatch().write(k, v, slots, pages, layout, codec)
        return
    write_slots(pages, layout, slots, codec.encode(k, v))


def decode(q: torch.Tensor, kv: PagedKV, scale: float) -> torch.Tensor:
    """One query token per sequence, q [B, Hq, D], over the pages + ring -> [B, Hq, D]."""
    if kernels(q.device) == "triton":
        return _dispatch().decode(q, kv, softmax_scale=scale)
    return paged_attention_decode(q, kv, softmax_scale=scale)


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV, scale: float) -> torch.Tensor:
    """A chunk q [B, Hq, T, D] over the history in ``kv`` plus its own k, v [B, Hkv, T, D] (causal)."""
    if kernels(q.device) == "triton":
        return _dispatch().prefill(q, k, v, kv, softmax_scale=scale)
    return paged_attention_prefill(q, k, v, kv, softmax_scale=scale)
