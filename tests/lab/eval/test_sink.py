"""``eval.sink.sink_spread``: position 0's key and value over different first tokens, on a tiny random Llama."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from jetson_tq.calibration.sink import sink_spread
from jetson_tq.models.tiny import make_tiny_llama

pytestmark = pytest.mark.slow  # a model forward per call


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return LlamaForCausalLM.from_pretrained(make_tiny_llama(tmp_path_factory.mktemp("tiny"), layers=2)).eval()


def test_one_first_token_is_a_constant_sink_and_different_ones_are_not(tiny):
    """The same first token N times: every layer's position-0 key and value equal their mean (spread 0, every
    layer constant); different first tokens spread in the first layer (its key is the token's own projection)."""
    window = torch.randint(3, 100, (64,), generator=torch.Generator().manual_seed(0))
    same = sink_spread(tiny, torch.full((5,), 7), window)
    heads = tiny.config.num_key_value_heads
    dim = tiny.config.hidden_size // tiny.config.num_attention_heads
    assert same.key.shape == same.value.shape == (2, heads, dim) and same.key_spread.shape == (2, heads)
    assert float(same.key_spread.max()) < 1e-5 and float(same.value_spread.max()) < 1e-5
    assert same.constant_layers(1e-3) == [0, 1]
    apart = sink_spread(tiny, torch.arange(3, 40), window)
    assert float(apart.key_spread[0].min()) > 0.05 and 0 not in apart.constant_layers(0.05)
    assert torch.isfinite(apart.key).all() and torch.isfinite(apart.value_spread).all()


def test_too_few_tokens_are_a_named_error(tiny):
    with pytest.raises(ValueError, match="sink_spread"):
        sink_spread(tiny, torch.tensor([5]), torch.arange(3, 20))
    with pytest.raises(ValueError, match="sink_spread"):
        sink_spread(tiny, torch.arange(3, 9), torch.tensor([4]))
