"""Comparison baselines for the fidelity harness: fp8-e4m3 KV and KIVI-style int4/int2 KV, simulated.

These are *not* TurboQuant: each stored token is quantized and immediately dequantized back to the
model dtype, and stock SDPA attends over it. That is exactly how much information the baseline
layout keeps, which is what fidelity measures. Bytes per token are counted from each baseline's own
layout (codes + fp16 scales/zeros), never from ``KVFormat``.

Buffer policy is the same as ``CompressedKVCache``: the most recent ``recent_tokens`` stay in full
precision; once ``recent_tokens + flush_chunk`` tokens are unquantized, the oldest full chunks are
quantized. Attention sees the stored history plus the current chunk exactly (as ours does), unless
the format says a chunk reads itself back from storage (``stored_chunk_limit``, vLLM's TurboQuant);
layers the format keeps uncompressed (``fp16_layer``) are stored exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from transformers.cache_utils import Cache, DynamicLayer

from jetson_tq.codec.values import GroupQuantizer
from jetson_tq.errors import FormatError, ShapeError
from jetson_tq.integrations.transformers import append_prefilled

FP8_E4M3_MAX = 448.0
FP16_BYTES = 2


@dataclass(frozen=True)
class SimulatedFormat:
    """A baseline KV layout: ``fp8`` (e4m3, per-tensor scale 1) or ``int`` (asymmetric b-bit groups of ``group``).

    ``key_axis`` for ``int``: ``token`` groups ``group`` channels of one token (per-token, like values);
    ``channel`` groups ``group`` consecutive tokens of one channel (KIVI's per-channel keys).
    """

    kind: str = "int"
    bits: int = 4
    group: int = 32
    key_axis: str = "token"
    recent_tokens: int = 128
    flush_chunk: int = 64
    stored_chunk_limit: int = 0  # a chunk of <= this many tokens after some history attends to itself stored

    def __post_init__(self) -> None:
        if self.kind not in ("fp8", "int"):
            raise FormatError(f"kind: expected 'fp8' or 'int', got {self.kind!r}")
        if self.key_axis not in ("token", "channel"):
            raise FormatError(f"key_axis: expected 'token' or 'channel', got {self.key_axis!r}")
        if self.kind == "int" and not 1 <= self.bits <= 8:
            raise FormatError(f"bits: expected 1..8, got {self.bits}")
        if self.kind == "int" and self.key_axis == "channel" and self.flush_chunk % self.group:
            raise FormatError(
                f"flush_chunk {self.flush_chunk} must be a multiple of the token group {self.group} "
                "for per-channel keys"
            )

    def key_bytes_per_token(self, head_dim: int) -> float:
        """Key bytes per token per KV head: codes + fp16 scale and zero per group (amortized over tokens for channel
        groups)."""
        if self.kind == "fp8":
            return float(head_dim)
        codes = head_dim * self.bits / 8
        return codes + 2 * FP16_BYTES * head_dim / self.group  # per-token: D/g groups; per-channel: D groups / g tokens

    def value_bytes_per_token(self, head_dim: int) -> float:
        if self.kind == "fp8":
            return float(head_dim)
        return head_dim * self.bits / 8 + 2 * FP16_BYTES * head_dim / self.group

    def bytes_per_token(self, head_dim: int) -> float:
        """Stored bytes of one token of one KV head (keys + values), the baseline's own layout."""
        return self.key_bytes_per_token(head_dim) + self.value_bytes_per_token(head_dim)

    def fp16_layer(self, layer: int, num_layers: int) -> bool:
        """True for a layer this format leaves uncompressed (none here)."""
        return False

    def layer_bytes_per_token(self, layer: int, num_layers: int, head_dim: int) -> float:
        """Stored bytes per token per KV head of one layer (fp16 for layers left uncompressed)."""
        return (
            float(2 * FP16_BYTES * head_dim) if self.fp16_layer(layer, num_layers) else self.bytes_per_token(head_dim)
        )

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) [..., T, D] after being stored in this layout and read back."""
        if self.kind == "fp8":
            return fp8_e4m3_roundtrip(k), fp8_e4m3_roundtrip(v)
        if self.key_axis == "channel":
            kq = int_group_roundtrip(k.transpose(-1, -2), self.bits, self.group).transpose(-1, -2)
        else:
            kq = int_group_roundtrip(k, self.bits, self.group)
        return kq, int_group_roundtrip(v, self.bits, self.group)


def fp8_e4m3_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """Round to float8 e4m3 (saturating at +-448, per-tensor scale 1 as vLLM's uncalibrated fp8 KV) and back."""
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def int_group_roundtrip(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """b-bit asymmetric min/max quantization in groups of ``group`` along the last dim, fp16 scale/zero, and back."""
    q = GroupQuantizer(x.shape[-1], bits, group)
    return q.dequantize(q.quantize(x)).to(x.dtype)


class SimulatedLayer(DynamicLayer):
    """A DynamicLayer whose tokens older than the recent buffer are replaced by their quantize-dequantize image."""

    def __init__(self, fmt: SimulatedFormat, exact: bool = False) -> None:
        super().__init__()
        self.fmt, self.exact = fmt, exact
        self.n_quantized = 0

    def _store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        super().update(k, v)
        if self.exact:
            return
        keys, values = cast(torch.Tensor, self.keys), cast(torch.Tensor, self.values)  # filled by the update above
        keep, chunk = self.fmt.recent_tokens, self.fmt.flush_chunk
        pending = keys.shape[-2] - self.n_quantized
        if pending < keep + chunk:
            return
        n = ((pending - keep) // chunk) * chunk
        s = slice(self.n_quantized, self.n_quantized + n)
        keys[..., s, :], values[..., s, :] = self.fmt.roundtrip(keys[..., s, :], values[..., s, :])
        self.n_quantized += n

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """History in its stored (partly quantized) state plus the new chunk (exact, or stored if the format says
        so)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        stored_k, stored_v = cast(torch.Tensor, self.keys), cast(torch.Tensor, self.values)  # initialized above
        if stored_k.numel() and key_states.shape[-2] <= self.fmt.stored_chunk_limit:
            self._store(key_states, value_states)
            return self.keys, self.values
        keys = torch.cat([stored_k, key_states], dim=-2)
        values = torch.cat([stored_v, value_states], dim=-2)
        self._store(key_states, value_states)
        return keys, values

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store precomputed K/V (e.g. after a shared exact prefill)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._store(key_states, value_states)

    def crop(self, tokens_to_remove: int) -> None:
        raise ShapeError("SimulatedLayer does not support crop")


class SimulatedQuantCache(Cache):
    """A transformers Cache of ``SimulatedLayer``s, one per decoder layer (works with any attention implementation)."""

    def __init__(self, fmt: SimulatedFormat, num_layers: int) -> None:
        super().__init__(layers=[SimulatedLayer(fmt, exact=fmt.fp16_layer(i, num_layers)) for i in range(num_layers)])
        self.fmt = fmt

    def append(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cast(SimulatedLayer, self.layers[layer_idx]).append(key_states, value_states)  # built in __init__

    def load_from(self, cache: Cache) -> SimulatedQuantCache:
        """Quantize every layer of another cache (e.g. a DynamicCache after an exact prefill) into this one."""
        append_prefilled(cache, len(self.layers), self.append)
        return self
