"""RoPE read back from the (cos, sin) tables a layer receives, in the dtype the model runs in."""

from __future__ import annotations

import pytest
import torch

from jetson_tq.calibration.capture import rotary_from_tables
from jetson_tq.errors import UnsupportedModelError


def _tables(freq: torch.Tensor, t: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(t, dtype=torch.float64)[:, None] * freq.double()[None]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tables_in_the_model_dtype_give_the_models_own_frequencies(dtype) -> None:
    """A bf16 model on the GPU hands its layers bf16 tables (cos rounded to ~4e-3): still its RoPE, exactly its
    inv_freq buffer (llama3-scaled frequencies down to ~1e-5)."""
    half = 64
    freq = 1.0 / (500000.0 ** (torch.arange(half, dtype=torch.float64) * 2 / (2 * half)))
    freq[half // 2 :] /= 8.0  # llama3-style scaled low frequencies
    cos, sin = _tables(freq, 1024, dtype)
    rotary = rotary_from_tables(cos, sin, [freq], 128)
    assert torch.equal(rotary.inv_freq.double(), freq.float().double())


def test_tables_of_another_kind_are_refused_in_any_dtype() -> None:
    """Position-dependent scaling (dynamic RoPE) is not a static frequency set, bf16 or not."""
    half = 32
    freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) / half))
    cos, sin = _tables(freq, 512, torch.float64)
    ramp = torch.linspace(1.0, 0.7, 512, dtype=torch.float64)[:, None]
    with pytest.raises(UnsupportedModelError, match="static frequency set"):
        rotary_from_tables((cos * ramp).to(torch.bfloat16), (sin * ramp).to(torch.bfloat16), [], 64)
