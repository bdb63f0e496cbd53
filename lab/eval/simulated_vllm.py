"""vLLM 0.26.0's built-in TurboQuant KV formats (``--kv-cache-dtype turboquant_*``), re-implemented for comparison.

Read from vLLM 0.26.0's source (``model_executor/layers/quantization/turboquant/{config,centroids}.py``,
``v1/attention/ops/triton_turboquant_{store,decode}.py``, ``v1/attention/backends/turboquant_attn.py``,
``engine/arg_utils.py``), per token and KV head, slot = ``[key | value]`` rounded up to an even size:

- keys, ``key_bits`` 8: float8 e4m3 (``e4nv`` on Hopper), no scale, D bytes, not rotated;
- keys, ``key_bits`` 3 or 4: ``n = ||k||`` (fp16), ``y = (k / (n + 1e-8)) H`` with H the plain
  Sylvester Hadamard matrix / sqrt(D) (no random signs, shared by all layers), each coordinate
  bucketized against the midpoints of the Lloyd-Max centroids of N(0, 1/D);
  ``ceil(D*b/8) + 2`` bytes. Decoded as ``n * c[idx] H``; with ``norm_correction`` (the ``_nc``
  presets) ``c[idx]`` is first renormalized to unit length;
- values: ``value_bits`` 3 or 4 uniform over the whole head (one group of D), ``scale = (max-min)/(2^b-1)``
  (>= 1e-8) and ``min`` used in fp32 to quantize, stored and applied in fp16; ``ceil(D*b/8) + 4`` bytes;
- the first 2 and last 2 decoder layers of a dense model stay in the model dtype (``get_boundary_skip_layers``,
  applied to every turboquant preset); no recent buffer: every token is compressed when written,
  and continuation chunks of <= 128 tokens and decode steps read the current chunk back compressed too
  (only a request's first prefill chunk attends exactly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from jetson_tq.errors import FormatError
from jetson_tq.format import is_power_of_two

from .simulated_caches import SimulatedFormat, fp8_e4m3_roundtrip

#: The presets of vLLM 0.26.0 (``TQ_PRESETS``): key bits (8 = fp8), value bits, norm correction.
VLLM_PRESETS: dict[str, tuple[int, int, bool]] = {
    "turboquant_k8v4": (8, 4, False),
    "turboquant_4bit_nc": (4, 4, True),
    "turboquant_k3v4_nc": (3, 4, True),
    "turboquant_3bit_nc": (3, 3, True),
}
BOUNDARY_LAYERS = 2  # first and last layers vLLM leaves uncompressed
CONTINUATION_DECODE_THRESHOLD = 128  # chunks up to this length read themselves from the compressed cache


def slot_bytes(head_dim: int, key_bits: int, value_bits: int) -> int:
    """Bytes of one vLLM TurboQuant slot (one token, one KV head, keys + values, rounded up to even)."""
    key = head_dim if key_bits == 8 else math.ceil(head_dim * key_bits / 8) + 2
    s = key + math.ceil(head_dim * value_bits / 8) + 4
    return s + s % 2


@lru_cache(maxsize=8)
def sylvester_hadamard(dim: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of a power-of-two ``dim`` (symmetric: its own inverse)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(dim)).float()


@lru_cache(maxsize=16)
def gaussian_lloyd_max(dim: int, bits: int) -> torch.Tensor:
    """Sorted Lloyd-Max centroids of N(0, 1/dim) computed as vLLM's ``solve_lloyd_max`` does, float32 [2^bits].

    Same numerics, so the same indices: start from 2^bits points spread over +-3.5 sigma, outer cell
    edges at +-10.5 sigma, conditional means by the trapezoid rule with 200 intervals per cell, at
    most 200 iterations, stop at a 1e-10 move. (These differ from the exact Gaussian centroids by
    up to 2e-4 at D=64, enough to flip some indices, hence not the exact ones.)
    """
    sigma, n = 1.0 / math.sqrt(dim), 1 << bits
    lo, hi = -3.5 * sigma, 3.5 * sigma
    c = np.array([lo + (hi - lo) * (i + 0.5) / n for i in range(n)])
    t = np.linspace(0.0, 1.0, 201)
    w = np.full(201, 1.0)
    w[0] = w[-1] = 0.5

    def cells(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        edges = np.concatenate([[lo * 3], (c[:-1] + c[1:]) / 2, [hi * 3]])
        x = edges[:-1, None] + (edges[1:] - edges[:-1])[:, None] * t[None, :]
        pdf = np.exp(-x * x / (2 * sigma * sigma)) / math.sqrt(2 * math.pi * sigma * sigma)
        h = (edges[1:] - edges[:-1]) / 200
        return (x * pdf * w).sum(1) * h, (pdf * w).sum(1) * h

    for _ in range(200):
        num, den = cells(c)
        new = np.where(den > 1e-15, num / np.where(den > 1e-15, den, 1.0), c)
        if np.abs(new - c).max() < 1e-10:
            break
        c = new
    return torch.tensor(c, dtype=torch.float32)


def mse_key_roundtrip(k: torch.Tensor, bits: int, norm_correction: bool) -> torch.Tensor:
    """vLLM's MSE key quantization and dequantization of k [..., D] (keys back in the original space)."""
    d = k.shape[-1]
    if not is_power_of_two(d):
        raise FormatError(f"vLLM TurboQuant simulation: expected a power-of-two head dim, got {d}")
    h = sylvester_hadamard(d)
    c = gaussian_lloyd_max(d, bits)
    kf = k.float()
    norm = kf.norm(dim=-1, keepdim=True)
    y = (kf / (norm + 1e-8)) @ h
    yq = c[torch.bucketize(y, (c[1:] + c[:-1]) / 2, right=True)]
    if norm_correction:
        yq = yq / torch.sqrt((yq * yq).sum(-1, keepdim=True) + 1e-16)
    return (norm.half().float() * (yq @ h)).to(k.dtype)


def uniform_value_roundtrip(v: torch.Tensor, bits: int) -> torch.Tensor:
    """vLLM's per-token uniform value quantization over the whole head (fp32 to quantize, fp16 scale/min to decode)."""
    vf = v.float()
    lo, hi = vf.amin(-1, keepdim=True), vf.amax(-1, keepdim=True)
    top = (1 << bits) - 1
    scale = ((hi - lo) / top).clamp_min(1e-8)
    q = torch.floor((vf - lo) / scale + 0.5).clamp(0, top)
    return (q * scale.half().float() + lo.half().float()).to(v.dtype)


@dataclass(frozen=True)
class VLLMTurboQuantFormat(SimulatedFormat):
    """One of vLLM 0.26's ``turboquant_*`` KV cache dtypes, with its boundary layers and read-back policy."""

    kind: str = "vllm"
    preset: str = "turboquant_4bit_nc"
    boundary_layers: int = BOUNDARY_LAYERS
    recent_tokens: int = 0
    flush_chunk: int = 1
    stored_chunk_limit: int = CONTINUATION_DECODE_THRESHOLD

    def __post_init__(self) -> None:
        if self.preset not in VLLM_PRESETS:
            raise FormatError(f"preset: expected one of {tuple(VLLM_PRESETS)}, got {self.preset!r}")

    @property
    def key_bits(self) -> int:
        return VLLM_PRESETS[self.preset][0]

    @property
    def value_bits(self) -> int:
        return VLLM_PRESETS[self.preset][1]

    def key_bytes_per_token(self, head_dim: int) -> float:
        return float(head_dim if self.key_bits == 8 else math.ceil(head_dim * self.key_bits / 8) + 2)

    def value_bytes_per_token(self, head_dim: int) -> float:
        return float(math.ceil(head_dim * self.value_bits / 8) + 4)

    def bytes_per_token(self, head_dim: int) -> float:
        """vLLM's slot size (keys + values, rounded up to even) for one token of one KV head."""
        return float(slot_bytes(head_dim, self.key_bits, self.value_bits))

    def fp16_layer(self, layer: int, num_layers: int) -> bool:
        """The first and last ``boundary_layers`` layers (at most half the model) stay uncompressed, as in vLLM."""
        n = min(self.boundary_layers, num_layers // 2)
        return layer < n or layer >= num_layers - n

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key_bits, value_bits, norm_correction = VLLM_PRESETS[self.preset]
        kq = fp8_e4m3_roundtrip(k) if key_bits == 8 else mse_key_roundtrip(k, key_bits, norm_correction)
        return kq, uniform_value_roundtrip(v, value_bits)
