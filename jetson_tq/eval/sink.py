"""How constant a model's attention sink is: position 0's key and value over many different first tokens.

Where a layer's position-0 key and value are the same vector whatever the token (the sink's massive activation), a
calibration can hold them per layer and a reader can take position 0 from there, with nothing stored per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.compressed import CompressedKVCache
from .decoded_history import DecodedHistory
from .smartmix import capture


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
    flat = ids.reshape(-1)
    drawn = flat[torch.randint(0, flat.numel(), (count,), generator=torch.Generator().manual_seed(seed))]
    return torch.cat([drawn, torch.tensor(sorted(set(special_ids)), dtype=flat.dtype)])


@torch.no_grad()
def sink_spread(model, first_tokens: torch.Tensor, window: torch.Tensor) -> SinkSpread:
    """Position 0's key and value for each token of ``first_tokens`` [N] (one forward of two tokens each: position 0
    alone decides them), against the mean key / value norm over positions 1.. of a real token ``window`` [T]."""
    if first_tokens.ndim != 1 or first_tokens.numel() < 2 or window.ndim != 1 or window.numel() < 2:
        raise ValueError("sink_spread: expected >= 2 first tokens [N] and a window of >= 2 tokens [T]")
    firsts = capture(model, torch.stack([first_tokens, first_tokens], 1))
    typical = capture(model, window[None])
    keys, values, key_spread, value_spread = [], [], [], []
    for cap, ref in zip(firsts, typical):
        k0, v0 = cap.k[:, :, 0].double(), cap.v[:, :, 0].double()  # [N, H, D]
        k_norm = ref.k[0, :, 1:].double().norm(dim=-1).mean(-1)  # [H]
        v_norm = ref.v[0, :, 1:].double().norm(dim=-1).mean(-1)
        keys.append(k0.mean(0))
        values.append(v0.mean(0))
        key_spread.append((k0 - k0.mean(0)).norm(dim=-1).amax(0) / k_norm)
        value_spread.append((v0 - v0.mean(0)).norm(dim=-1).amax(0) / v_norm)
    return SinkSpread(*(torch.stack(x).float() for x in (keys, values, key_spread, value_spread)))


class ConstantSinkHistory(DecodedHistory):
    """A ``cpu-decoded`` history whose sink positions read a calibrated per-layer key and value [H, D] (the same for
    every sequence) instead of each sequence's own position 0: what a storage-free sink would serve."""

    def __init__(
        self,
        store: CompressedKVCache,
        sink_tokens: int,
        center: torch.Tensor | None,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        if center is not None:
            raise ValueError("ConstantSinkHistory: a centered cache's sink is not a calibrated constant")
        if sink_tokens != 1 or key.shape != (store.num_kv_heads, store.head_dim) or value.shape != key.shape:
            raise ValueError(
                f"ConstantSinkHistory: one sink position and [H, D] = [{store.num_kv_heads}, {store.head_dim}] "
                f"constants, got {sink_tokens} positions, key {tuple(key.shape)}, value {tuple(value.shape)}"
            )
        super().__init__(store, sink_tokens)
        self.constant_key, self.constant_value = key, value

    def note_exact(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Position 0 of the next tokens k, v [B, H, T, D] reads the layer's constants (the tokens are not read)."""
        if self.sink_k is not None or int(self.store.lengths[0]) != 0:
            return
        shape = (k.shape[0], self.store.num_kv_heads, 1, self.store.head_dim)
        self.sink_k = self.constant_key.to(self.store.device, self.store.dtype)[None, :, None].expand(shape)
        self.sink_v = self.constant_value.to(self.store.device, self.store.dtype)[None, :, None].expand(shape)
