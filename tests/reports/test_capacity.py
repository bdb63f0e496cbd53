"""Capacity arithmetic against hand-computed values, per-layer formats, real-cache measurement, model YAMLs."""

from __future__ import annotations

import pytest

from jetson_tq.config import config_from_dict, load_config
from jetson_tq.errors import ConfigError
from jetson_tq.format import FP16_FORMAT
from jetson_tq.models.specs import load_model_spec, model_names, model_spec_from_dict
from jetson_tq.reports.capacity import (
    KVBudget,
    breakdown,
    buffer_bytes,
    bytes_per_token,
    capacity_report,
    layer_formats,
    measure_cache,
    measure_model,
    sequence_bytes,
)

QWEN = load_model_spec("qwen2.5-7b-instruct")
SMOL = load_model_spec("smollm2-135m-instruct")
BLOG = load_config("blog_k3v2")


# ------------------------------------------------------------------------------------------- hand-computed
def test_qwen_bytes_per_token_by_hand():
    # fp16: 28 layers x 4 KV heads x (K+V) 2 x 128 dims x 2 bytes.
    assert bytes_per_token([FP16_FORMAT] * 28, QWEN) == 28 * 4 * 2 * 128 * 2 == 57_344
    # blog_k3v2 at D=128, per token per head: key_idx 2b*128/8=32, key_signs 16, key_norm 2, key_rnorm 2,
    # val_codes 2b*128/8=32, val_scale 4 groups x 2=8, val_zero 8 -> 100 B; x 28 x 4 = 11,200.
    formats = layer_formats(BLOG, QWEN)
    assert bytes_per_token(formats, QWEN) == 100 * 112 == 11_200
    assert breakdown(formats, QWEN) == {"indices": 64 * 112, "signs": 16 * 112, "norms": 4 * 112, "scales": 16 * 112}


def test_smollm2_sequence_and_buffer_by_hand():
    # D=64 per token per head: 16 + 8 + 2 + 2 + 16 + 4 + 4 = 52 B; 30 layers x 3 KV heads = 90 layer-heads.
    formats = layer_formats(BLOG, SMOL)
    assert bytes_per_token(formats, SMOL) == 52 * 90 == 4_680
    # 8192 tokens: all compressed + an exact ring of 128 tokens x (K+V) x 64 x 2 B = 32,768 B per layer-head.
    assert sequence_bytes(formats, SMOL, 8192) == (8192 * 52 + 32_768) * 90 == 41_287_680
    assert buffer_bytes(formats, SMOL, 8192) == 32_768 * 90
    assert sequence_bytes([FP16_FORMAT] * 30, SMOL, 8192) == 8192 * 256 * 90 == 188_743_680
    # Short sequence: every token compressed and also exact (100 tokens of 52 + 256 B).
    assert sequence_bytes(formats, SMOL, 100) == 100 * (52 + 256) * 90


def test_report_at_the_writeup_budget():
    """Qwen2.5-7B, 51.6 GB of KV (what 0.9 M fp16 tokens take): fp16 899,832 tokens, blog_k3v2 4,607,142."""
    budget = KVBudget(51_600_000_000 + QWEN.weight_bytes, 1.0, QWEN.weight_bytes)
    rep = capacity_report(QWEN, BLOG, budget, 32768)
    assert rep["fp16"]["pool_tokens"] == 51_600_000_000 // 57_344 == 899_832
    assert rep["turboquant"]["pool_tokens"] == 51_600_000_000 // 11_200 == 4_607_142
    assert rep["multiplier_pool"] == pytest.approx(4_607_142 / 899_832)
    # Per sequence of 32k: fp16 32768 x 57,344 = 1,879,048,192 B -> 27 sequences.
    assert rep["fp16"]["sequence_bytes"] == 1_879_048_192 and rep["fp16"]["sequences_at_context"] == 27
    # blog_k3v2: (32768 x 100 + 128 x 512) x 112 = 374,341,632 B -> 137 sequences.
    assert rep["turboquant"]["sequence_bytes"] == (32768 * 100 + 128 * 512) * 112 == 374_341_632
    assert rep["turboquant"]["sequences_at_context"] == 51_600_000_000 // 374_341_632 == 137
    assert rep["freed_bytes_per_sequence"] == 1_879_048_192 - 374_341_632
    assert rep["freed_bytes_at_fp16_capacity"] == 27 * (1_879_048_192 - 374_341_632)
    # Sanity vs the reference write-up: ~0.9 M fp16 tokens, and at least its ~4.4x (ours is 5.12x: 512/100).
    assert 0.85e6 < rep["fp16"]["pool_tokens"] < 0.95e6
    assert rep["multiplier_pool"] >= 4.4 and rep["multiplier_at_context"] >= 4.4


def test_budget_arithmetic():
    b = KVBudget(128_000_000_000, 0.85, 15_231_233_024, 1_000_000_000)
    assert b.usable_bytes == 108_800_000_000
    assert b.kv_bytes == 108_800_000_000 - 15_231_233_024 - 1_000_000_000


def test_weights_that_do_not_fit():
    rep = capacity_report(QWEN, BLOG, KVBudget(8_000_000_000, 0.85, QWEN.weight_bytes), 4096)
    assert not rep["fits"] and rep["fp16"]["pool_tokens"] == 0 and rep["turboquant"]["pool_tokens"] == 0
    assert rep["multiplier_pool"] == pytest.approx(5.12)


def test_fp16_kept_layers_count_at_fp16_size():
    cfg = config_from_dict(
        {
            "keys": {"mode": "prod", "bits": 3},
            "values": {"mode": "group", "bits": 2, "group_size": 32},
            "layers": {"keep_fp16_first": 2, "keep_fp16_last": 2},
        },
        name="keep2",
    )
    formats = layer_formats(cfg, QWEN)
    assert formats[:2] == [FP16_FORMAT] * 2 and formats[-2:] == [FP16_FORMAT] * 2
    assert bytes_per_token(formats, QWEN) == 4 * 512 * 4 + 24 * 100 * 4 == 17_792
    rep = capacity_report(QWEN, cfg, KVBudget(10**10, 1.0, 0), 4096)
    assert [g["layers"] for g in rep["layers"]] == [[0, 1], [2, 25], [26, 27]]
    assert rep["multiplier_pool"] == pytest.approx(57_344 / 17_792, rel=1e-4)
    assert breakdown(formats, QWEN)["fp16"] == 4 * 512 * 4


def test_per_layer_override():
    cfg = config_from_dict({"layers": {"overrides": {0: {"keys": {"bits": 4}, "values": {"bits": 4}}}}})
    # the default is mse_k4v3 (64 + 2 + 48 + 4 + 4 = 122 B); layer 0 at 4-bit values: 64 + 2 + 64 + 4 + 4 = 138 B;
    # x 4 heads.
    assert bytes_per_token(layer_formats(cfg, QWEN), QWEN) == (138 + 27 * 122) * 4


def test_config_that_does_not_fit_the_model():
    cfg = config_from_dict({"values": {"mode": "group", "bits": 2, "group_size": 128}})
    assert [f.value_group_for(SMOL.head_dim) for f in layer_formats(cfg, SMOL)] == [64] * SMOL.num_layers
    odd = model_spec_from_dict({**SMOL.to_dict(), "name": "d131", "head_dim": 131})  # prime > 128: groups of 1
    with pytest.raises(ConfigError, match="layer 0: value_group 128 does not divide head_dim 131"):
        layer_formats(cfg, odd)


# ------------------------------------------------------------------------------------------- measured
def test_measured_cache_matches_formula_exactly_for_compressed_formats():
    m = measure_cache(BLOG.default, 4, 128, 1024)
    # 1024 tokens, all compressed; the last 128 are read from the exact ring (allocated whole: 128 tokens).
    assert (m["compressed_tokens"], m["buffered_tokens"]) == (896, 128)
    assert m["formula_bytes"] == (1024 * 100 + 128 * 512) * 4 == m["storage_bytes"]
    assert m["used_bytes"] == (1024 * 100 + 128 * 512) * 4
    assert m["ok"] and m["allocator_bytes"] is None


def test_measured_fp16_passthrough_within_margin():
    m = measure_cache(FP16_FORMAT, 3, 64, 1000)
    # 1000 tokens fill 63 pages of 16 (8 slots of slack); the passthrough format keeps no ring.
    assert m["storage_bytes"] - m["formula_bytes"] == 8 * 256 * 3
    assert m["ok"] and m["margin_bytes"] >= 8 * 256 * 3


def test_measure_model_with_mixed_layers():
    cfg = config_from_dict({"layers": {"keep_fp16_first": 1, "keep_fp16_last": 1}}, name="keep1")
    meas = measure_model(cfg, SMOL, 512)
    assert sorted(m["layers"] for m in meas["per_format"]) == [2, 28]
    assert meas["ok"] and abs(meas["rel_diff"]) < 0.01
    assert meas["formula_bytes"] == sequence_bytes(layer_formats(cfg, SMOL), SMOL, 512)


def test_measure_detects_a_mismatch(monkeypatch):
    """If the cache allocated more than the format says, the check fails (it is not a tautology)."""
    from jetson_tq.cache.compressed import CompressedKVCache

    real = CompressedKVCache.nbytes
    monkeypatch.setattr(CompressedKVCache, "nbytes", lambda self: int(real(self) * 1.05))
    assert not measure_cache(BLOG.default, 2, 64, 512)["ok"]


@pytest.mark.gpu
def test_measured_on_cuda_allocator():
    m = measure_cache(BLOG.default, 8, 128, 32768, device="cuda")
    assert m["allocator_bytes"] is not None and m["ok"], m


# ------------------------------------------------------------------------------------------- model YAMLs
@pytest.mark.parametrize("name", model_names())
def test_model_yaml_consistent(name):
    spec = load_model_spec(name)
    assert spec.num_attention_heads % spec.num_kv_heads == 0
    assert spec.estimated_parameters() * 2 == spec.weight_bytes  # bf16 weights = 2 B per parameter
    BLOG.check_model(spec.num_layers, spec.head_dim)


def test_shipped_models():
    assert {"qwen2.5-7b-instruct", "llama-3.1-8b-instruct", "smollm2-135m-instruct"} <= set(model_names())
    assert (QWEN.num_layers, QWEN.num_kv_heads, QWEN.head_dim) == (28, 4, 128)
    assert (SMOL.num_layers, SMOL.num_kv_heads, SMOL.head_dim) == (30, 3, 64)


def test_model_yaml_errors(tmp_path):
    good = load_model_spec("smollm2-135m-instruct").to_dict()
    with pytest.raises(ConfigError, match="unknown key"):
        model_spec_from_dict({**good, "layers": 3})
    with pytest.raises(ConfigError, match="missing key"):
        model_spec_from_dict({k: v for k, v in good.items() if k != "head_dim"})
    with pytest.raises(ConfigError, match="num_kv_heads"):
        model_spec_from_dict({**good, "num_kv_heads": 0})
    with pytest.raises(ConfigError, match="not a multiple"):
        model_spec_from_dict({**good, "num_kv_heads": 2})
    with pytest.raises(ConfigError, match="no model"):
        load_model_spec("gpt-17")
    path = tmp_path / "m.yaml"
    path.write_text("name: m\nnum_layers: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_model_spec(path)
