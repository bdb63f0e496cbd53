"""What this worker process remembers between vLLM's calls: its model runner (request ids for ring rows), the
request -> ring-row map every layer's builder shares, and which attention layers are ours.

Process-wide because vLLM builds one runner per worker process and gives neither the builders nor the impls a
handle on it; the runner hook records it here (``remember_runner``).
"""

from __future__ import annotations

import weakref

from .recent import RecentSlots

_RUNNER: weakref.ReferenceType | None = None
_SLOTS: RecentSlots | None = None


def current_runner():
    """The model runner of this worker process (None before its KV cache is initialized)."""
    return _RUNNER() if _RUNNER is not None else None


def remember_runner(runner) -> None:
    """Record ``runner`` as this worker's model runner (weakly: a finished engine's runner is not kept alive)."""
    global _RUNNER
    _RUNNER = weakref.ref(runner)


def recent_rows(vllm_config) -> int:
    """Rows of each recent-buffer pool (one per concurrently running request)."""
    return int(vllm_config.scheduler_config.max_num_seqs)


def recent_slots(vllm_config) -> RecentSlots:
    """The process-wide request -> ring-row map (shared by every layer's metadata builder)."""
    global _SLOTS
    if _SLOTS is None or _SLOTS.num_rows != recent_rows(vllm_config):
        _SLOTS = RecentSlots(recent_rows(vllm_config))
    return _SLOTS


def our_layers(vllm_config) -> dict:
    """Attention layers (name -> module) whose impl is jetson-tq's."""
    ctx = vllm_config.compilation_config.static_forward_context
    return {name: layer for name, layer in ctx.items() if is_ours(getattr(layer, "impl", None))}


def is_ours(impl) -> bool:
    """True for jetson-tq's attention impl (by its marker, so this module need not import the backend)."""
    return bool(getattr(impl, "is_jetson_tq", False))


def configure_all(vllm_config) -> dict:
    """Give every jetson-tq layer its format (idempotent); returns our layers."""
    layers = our_layers(vllm_config)
    for name, layer in layers.items():
        layer.impl.configure(name, vllm_config)
    return layers
