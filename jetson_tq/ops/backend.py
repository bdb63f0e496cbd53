"""The single Triton-vs-reference choice of the package.

``JETSON_TQ_BACKEND`` ("auto" | "reference" | "triton", default "auto") is read and validated once, here.
"auto" runs the Triton kernels for CUDA tensors and the PyTorch reference for CPU tensors, and falls back to
the reference for a format no kernel handles (``format.kernel_unsupported_reason``). "triton" on CPU tensors
needs ``TRITON_INTERPRET=1`` set before triton is imported (the interpreter CI uses).
"""

from __future__ import annotations

import functools
import os

import torch

from .. import env
from ..errors import ConfigError, UnsupportedPlatformError
from ..format import PagedLayout, kernel_unsupported_reason

ENV_VAR = env.BACKEND
BACKENDS: tuple[str, ...] = ("auto", "reference", "triton")


def _validate(value: object, origin: str) -> str:
    if not isinstance(value, str) or value.strip().lower() not in BACKENDS:
        raise ConfigError(f"{origin}: expected one of {BACKENDS}, got {value!r}")
    return value.strip().lower()


@functools.lru_cache(maxsize=1)
def configured() -> str:
    """The process-wide setting from ``JETSON_TQ_BACKEND`` (read once; ``configured.cache_clear()`` re-reads it)."""
    raw = env.read().kernel_backend
    return _validate(raw, ENV_VAR) if raw.strip() else "auto"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve(device: torch.device, layout: PagedLayout | None = None, backend: str | None = None) -> str:
    """The concrete backend, "triton" or "reference", for tensors on ``device`` in ``layout``'s format.

    ``backend`` overrides the process setting for one call (None = ``configured()``).
    """
    choice = configured() if backend is None else _validate(backend, "backend")
    reason = kernel_unsupported_reason(layout) if layout is not None else None
    if choice == "auto":
        return "triton" if device.type == "cuda" and reason is None else "reference"
    if choice == "triton":
        if reason is not None:
            raise UnsupportedPlatformError(f"backend 'triton': {reason}")
        if device.type != "cuda" and not _interpreting():
            raise UnsupportedPlatformError(
                f"backend 'triton' needs CUDA tensors (got {device}) or TRITON_INTERPRET=1 set before triton is "
                "imported; use backend 'auto' or 'reference' on the CPU"
            )
    return choice


def graph_safe(device: torch.device, layout: PagedLayout | None = None, backend: str | None = None) -> bool:
    """True when decode on ``device`` runs without host syncs, so a CUDA graph can capture it (the kernels)."""
    return device.type == "cuda" and resolve(device, layout, backend) == "triton"
