"""Per-layer masking and softmax extras a model's attention layer may carry, in one frozen spec.

``AttentionExtras`` is the one interface the vLLM impl, ``ops``, the PyTorch reference and the Triton kernels
share for them; the semantics are vLLM's FlashAttention / Triton backends' (``triton_unified_attention``):

- ``sinks`` [Hq] (learned per query head, gpt-oss): a logit in the scaled-score domain added to the softmax
  denominator only, with no value: out = sum_j e^{s_j} v_j / (e^{sink} + sum_j e^{s_j}). It is neither scaled nor
  soft-capped.
- ``soft_cap`` c (Gemma 2): each scaled score s = scale * <q, k> becomes c * tanh(s / c) before the softmax.
- ``sliding_window`` W (vLLM's ``sliding_window``, window_size = (W - 1, 0)): a query at position p reads positions
  [p - W + 1, p] only (W tokens, itself included). Inside it the format's exact window (``format.exact_start``)
  still applies: positions below exact_start(p) are read compressed. Positions before the window are never read
  (vLLM's sliding-window manager frees their blocks; their block-table entries then point at a null block).

``NO_EXTRAS`` (every field None) is plain causal attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ShapeError


@dataclass(frozen=True, eq=False)
class AttentionExtras:
    """Sinks, logit soft cap and sliding window of one attention layer (None: the layer has no such feature)."""

    sinks: torch.Tensor | None = None  # [num query heads] logits (any float dtype; read as fp32)
    soft_cap: float | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.soft_cap is not None and not (math.isfinite(self.soft_cap) and self.soft_cap > 0):
            raise ShapeError(f"soft_cap: expected a finite number > 0 or None, got {self.soft_cap!r}")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ShapeError(f"sliding_window: expected an int >= 1 or None, got {w!r}")
        s = self.sinks
        if s is not None and (not isinstance(s, torch.Tensor) or s.dim() != 1 or not s.is_floating_point()):
            got = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
            raise ShapeError(f"sinks: expected a 1-d float tensor [num query heads], got {got}")

    @property
    def any(self) -> bool:
        """True when some feature is set (the plain causal path serves the rest)."""
        return self.sinks is not None or self.soft_cap is not None or self.sliding_window is not None

    def check(self, num_heads: int, device: torch.device) -> None:
        """ShapeError unless the sinks fit ``num_heads`` query heads on ``device``."""
        if self.sinks is not None:
            if self.sinks.shape[0] != num_heads:
                raise ShapeError(f"sinks: expected [{num_heads}] (one per query head), got {tuple(self.sinks.shape)}")
            if self.sinks.device != device:
                raise ShapeError(f"sinks: expected on {device}, got {self.sinks.device}")

    def window_start(self, pos):
        """First position a query at ``pos`` may read (pos - W + 1; 0 without a window; may be < 0). Elementwise on
        ints, NumPy arrays and tensors."""
        if self.sliding_window is None:
            return pos * 0
        return pos - (self.sliding_window - 1)

    def cap(self, scores: torch.Tensor) -> torch.Tensor:
        """Soft-capped scaled scores (unchanged without a cap)."""
        if self.soft_cap is None:
            return scores
        return self.soft_cap * torch.tanh(scores / self.soft_cap)

    def __repr__(self) -> str:
        sinks = None if self.sinks is None else f"[{self.sinks.shape[0]}] {self.sinks.dtype}"
        return f"AttentionExtras(sinks={sinks}, soft_cap={self.soft_cap}, sliding_window={self.sliding_window})"


NO_EXTRAS = AttentionExtras()
