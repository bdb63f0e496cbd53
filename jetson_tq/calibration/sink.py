"""How constant a model's attention sink is: position 0's key and value over many different first tokens.

Where a layer's position-0 key and value are the same vector whatever the token (the sink's massive activation), a
calibration can hold them per layer and a reader can take position 0 from there, with nothing stored per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .capture import capture_attention


@dataclass(frozen=True)
class SinkSpread:
    """Per layer and KV head: position 0's mean key and value over the first tokens tried [L, H, D], and the largest
    distance of any of them from that mean relative to a typical key's / value's norm [L, H]."""

    key: torch.Tensor
    value: torch.Tensor
    key_spread: torch.Tensor
    value_spread: torch.Tensor

    def constant_layers(self, tolerance: float) -> list[int]:
        """Layers whose every head's position-0 key and value stay within ``tolerance`` of their means."""
        worst = torch.maximum(self.key_spread, self.value_spread).amax(1)
        return [i for i, w in enumerate(worst.tolist()) if w <= tolerance]


#: A layer whose position-0 key and value stay within this share of a typical key's / value's norm over the first
#: tokens tried holds a constant sink (SmolLM2: layers 12-28 within 0.5-2 %, the others 7-200 %; docs/fidelity.md).
SINK_TOLERANCE = 0.02


def sink_first_tokens(ids: torch.Tensor, special_ids: list[int], count: int = 100, seed: int = 0) -> torch.Tensor:
    """The first tokens a sink is measured over: ``count`` drawn (``seed``) from the calibration token ids (any
    shape) and the tokenizer's special tokens [count + specials]."""
    flat = ids.reshape(-1).cpu()
    drawn = flat[torch.randint(0, flat.numel(), (count,), generator=torch.Generator().manual_seed(seed))]
    return torch.cat([drawn, torch.tensor(sorted(set(special_ids)), dtype=flat.dtype)])


@torch.no_grad()
def sink_spread(model, first_tokens: torch.Tensor, window: torch.Tensor) -> SinkSpread:
    """Position 0's key and value for each token of ``first_tokens`` [N] (one forward of two tokens each: position 0
    alone decides them), against the mean key / value norm over positions 1.. of a real token ``window`` [T]."""
    if first_tokens.ndim != 1 or first_tokens.numel() < 2 or window.ndim != 1 or window.numel() < 2:
        raise ValueError("sink_spread: expected >= 2 first tokens [N] and a window of >= 2 tokens [T]")
    firsts = capture_attention(model, torch.stack([first_tokens, first_tokens], 1))
    typical = capture_attention(model, window[None])
    keys, values, key_spread, value_spread = [], [], [], []
    for cap, ref in zip(firsts, typical):
        k0, v0 = cap.k[:, :, 0].double(), cap.v[:, :, 0].double()  # [N, H, D]
        k_norm = ref.k[0, :, 1:].double().norm(dim=-1).mean(-1)  # [H]
        v_norm = ref.v[0, :, 1:].double().norm(dim=-1).mean(-1)
        keys.append(k0.mean(0))
        values.append(v0.mean(0))
        key_spread.append((k0 - k0.mean(0)).norm(dim=-1).amax(0) / k_norm)
        value_spread.append((v0 - v0.mean(0)).norm(dim=-1).amax(0) / v_norm)
    return SinkSpread(*(torch.stack(x).float().cpu() for x in (keys, values, key_spread, value_spread)))
