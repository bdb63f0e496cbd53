"""SmartMix calibration pieces: capture, the chunked attention it measures, the knapsack, and the YAML it writes."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from jetson_tq import attention_prefill
from jetson_tq.cache.compressed import CompressedKVCache
from jetson_tq.config import config_from_dict
from jetson_tq.format import KVFormat
from lab.eval import smartmix as S

BASE = KVFormat(key_mode="mse", key_bits=4, value_bits=3, value_group=32, recent_tokens=16)


def _model():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg).eval()


def test_compressed_counts_follow_the_cache():
    cache = CompressedKVCache(BASE, 1, 32, dtype=torch.float32)
    counts = []
    for _ in range(7):
        counts.append(int(cache.compressed_lens[0]))
        cache.append(torch.randn(1, 1, 10, 32), torch.randn(1, 1, 10, 32))
    assert S.compressed_counts(BASE, 70, 10) == counts and counts[-1] > 0


def test_chunked_attention_is_what_the_cache_serves():
    gen = torch.Generator().manual_seed(3)
    t, d, chunk = 60, 32, 12
    cap = S.LayerCapture(
        q=torch.randn(1, 4, t, d, generator=gen),
        k=torch.randn(1, 2, t, d, generator=gen),
        v=torch.randn(1, 2, t, d, generator=gen),
        h=torch.ones(1, t, 8),
    )
    exact = S.chunked_attention(cap, None, chunk, 0.2)
    ref = torch.nn.functional.scaled_dot_product_attention(
        cap.q, cap.k.repeat_interleave(2, 1), cap.v.repeat_interleave(2, 1), is_causal=True, scale=0.2
    )
    assert torch.allclose(exact, ref.transpose(1, 2).reshape(1, t, -1), atol=1e-5)
    got = S.chunked_attention(cap, BASE, chunk, 0.2)
    cache = CompressedKVCache(BASE, 2, d, dtype=torch.float32)
    want = []
    for s in range(0, t, chunk):
        sl = slice(s, s + chunk)
        want.append(attention_prefill(cap.q[:, :, sl], cap.k[:, :, sl], cap.v[:, :, sl], cache, softmax_scale=0.2))
    want = torch.cat(want, 2).transpose(1, 2).reshape(1, t, -1)
    assert ((got - want).norm() / want.norm()) < 1e-4
    assert ((got - exact).norm() / exact.norm()) > 1e-3  # history really was compressed


def test_capture_and_layer_errors_on_a_small_model():
    model = _model()
    ids = torch.randint(0, 256, (2, 48))
    with torch.no_grad():
        before = model(ids).logits
    caps = S.capture(model, ids)
    assert len(caps) == 3 and caps[0].q.shape == (2, 4, 48, 32) and caps[0].k.shape == (2, 2, 48, 32)
    assert caps[1].h.shape == (2, 48, 64)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)  # attention implementation restored
    cands = {"k2v2": BASE.with_(key_bits=2, value_bits=2), "k4v3": BASE, "k6v6": BASE.with_(key_bits=6, value_bits=6)}
    errs = S.layer_errors(model, caps, cands, chunk=16)
    for row in errs:
        assert row["k2v2"] > row["k4v3"] > row["k6v6"] > 0


def test_allocate_is_the_exact_optimum():
    gen = torch.Generator().manual_seed(5)
    cost = {"a": 2, "b": 3, "c": 5}
    errors = [{k: float(torch.rand(1, generator=gen)) / cost[k] for k in cost} for _ in range(5)]
    budget = 17
    brute = min(
        (p for p in itertools.product(cost, repeat=5) if sum(cost[x] for x in p) <= budget),
        key=lambda p: sum(e[x] for e, x in zip(errors, p)),
    )
    picks = S.allocate(errors, cost, budget)
    assert sum(e[x] for e, x in zip(errors, picks)) == pytest.approx(sum(e[x] for e, x in zip(errors, brute)))
    assert sum(cost[x] for x in picks) <= budget
    with pytest.raises(ValueError, match="budget"):
        S.allocate(errors, cost, 9)


def test_config_round_trip():
    cands = {"k3v2": BASE.with_(key_bits=3, value_bits=2), "k4v3": BASE, "k5v4": BASE.with_(key_bits=5, value_bits=4)}
    picks = ["k4v3", "k3v2", "k4v3", "k5v4"]
    cfg = config_from_dict(S.to_config("mix", "test", picks, cands))
    assert cfg.default == BASE and [cfg.format_for_layer(i, 4) for i in range(4)] == [cands[p] for p in picks]


@pytest.mark.slow  # > 10 s on 2 cores
def test_layer_kl_and_weighting():
    model = _model()
    ids = torch.randint(0, 256, (1, 64))
    kl = S.layer_kl(model, ids, BASE.with_(key_bits=2, value_bits=2, recent_tokens=8), chunk=16, backend="reference")
    assert len(kl) == 3 and all(x > 0 for x in kl)
    fp16 = S.layer_kl(model, ids, BASE.with_(key_mode="fp16", value_mode="fp16"), chunk=16, backend="reference")
    assert all(f < 1e-6 and f < x / 100 for f, x in zip(fp16, kl))  # fp16 rounding of an fp32 model's K/V only
    w = S.weight_errors([{"a": 2.0, "b": 1.0}, {"a": 4.0, "b": 1.0}], [0.5, 0.1], "a")
    assert w == [{"a": 0.5, "b": 0.25}, {"a": 0.1, "b": 0.025}]


def test_shipped_smollm2_mix_loads_at_the_defaults_bytes():
    from jetson_tq.config import load_config
    from jetson_tq.models.specs import load_model_spec
    from jetson_tq.reports.capacity import bytes_per_token, layer_formats

    smol = load_model_spec("smollm2-135m-instruct")
    mix = load_config("configs/per_layer/smartmix_smollm2-135m.yaml")
    formats = layer_formats(mix, smol)
    assert len(set(formats)) > 1 and bytes_per_token(formats, smol) == bytes_per_token(
        layer_formats(load_config("mse_k4v3"), smol), smol
    )
