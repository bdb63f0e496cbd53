"""The two measurement levers of issue 22 on random data: an exact attention sink in the cpu-decoded path, and
centered K/V (a per-head offset every stored key and value moves by, which leaves attention unchanged)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from jetson_tq.errors import ConfigError
from jetson_tq.format import KVFormat
from jetson_tq.integrations.transformers import TurboQuantLayer
from lab.eval.decoded_history import register as register_decoded

register_decoded()  # the lab's backend="cpu-decoded" (a CPU scoring path these tests compare), explicitly

FMT = KVFormat(key_bits=3, value_bits=3, value_group=32, recent_tokens=16, window="block")


def _kv(t: int, h: int = 2, d: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, h, t, d, generator=g), torch.randn(1, h, t, d, generator=g)


def _run(layer: TurboQuantLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    outs = []
    for s in range(0, k.shape[2], chunk):
        pending, _ = layer.update(k[:, :, s : s + chunk], v[:, :, s : s + chunk])
        outs.append(layer.attend(q[:, :, s : s + chunk], pending.key, pending.value, None, 1 / math.sqrt(k.shape[-1])))
    return torch.cat(outs, 2)


def test_sink_positions_are_read_exactly():
    k, v = _kv(64)
    layer = TurboQuantLayer(FMT, 0, 1, "cpu-decoded", sink_tokens=2)
    _run(layer, torch.randn(1, 4, 64, 32), k, v)
    hist = layer.decoded
    assert torch.allclose(hist.keys[:, :, :2], hist.transform_exact_keys(k[:, :, :2]), atol=1e-3)
    assert torch.allclose(hist.values[:, :, :2], v[:, :, :2], atol=1e-3)
    plain = TurboQuantLayer(FMT, 0, 1, "cpu-decoded")
    _run(plain, torch.randn(1, 4, 64, 32), k, v)
    assert torch.allclose(hist.keys[:, :, 2:], plain.decoded.keys[:, :, 2:])  # the rest is untouched
    assert not torch.allclose(plain.decoded.values[:, :, :2], v[:, :, :2], atol=1e-3)


def test_sinks_need_the_cpu_decoded_backend():
    with pytest.raises(ConfigError, match="cpu-decoded"):
        TurboQuantLayer(FMT, 0, 1, "reference", sink_tokens=1)


@pytest.mark.parametrize("backend", ["reference", "cpu-decoded"])
def test_centering_leaves_attention_unchanged_up_to_quantization(backend):
    k, v = _kv(48, seed=1)
    q = torch.randn(1, 4, 48, 32)
    offset = (torch.randn(2, 32) * 3, torch.randn(2, 32) * 3)
    fine = FMT.with_(key_bits=8, value_bits=8)
    centered = _run(
        TurboQuantLayer(fine, 0, 1, backend, center=offset),
        q,
        k + offset[0][None, :, None],
        v + offset[1][None, :, None],
    )
    exact = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert (centered - (exact + offset[1].repeat_interleave(2, 0)[None, :, None])).abs().max() < 0.05
