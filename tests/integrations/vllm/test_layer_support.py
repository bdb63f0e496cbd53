"""Which layers the vLLM plugin compresses, decided from each layer's features (no engine started).

``spec.stock_reason`` keeps on stock attention every layer the TurboQuant backend does not reproduce
exactly and every layer whose format stores keys and values exactly (nothing to compress), ``spec.refusal``
names what neither can serve, and ``spec.hybrid_page`` sizes a compressed page so that vLLM's hybrid KV-cache
groups (compressed full-attention layers beside stock sliding-window ones) share one page size without wasting
what compression saved.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from jetson_tq.config import load_config
from jetson_tq.errors import UnsupportedModelError
from jetson_tq.format import FP16_FORMAT, KVFormat, PagedLayout
from jetson_tq.integrations.vllm import decide, report, runtime, settings
from jetson_tq.integrations.vllm.spec import (
    EXACT_FORMAT_REASON,
    LayerFacts,
    describe_layers,
    hybrid_page,
    refusal,
    stock_reason,
    window_unit,
)

PLAIN = LayerFacts(name="model.layers.3.self_attn.attn", head_size=96, num_heads=32, num_kv_heads=32)


def test_plain_causal_attention_of_any_head_size_is_compressed():
    for head_size in (64, 80, 96, 128, 256):
        assert stock_reason(LayerFacts(name="x", head_size=head_size), max_model_len=4096) is None


@pytest.mark.parametrize(
    "change, words",
    [
        ({"attn_type": "encoder_only"}, "attn_type 'encoder_only'"),
        ({"attn_type": "encoder_decoder"}, "only decoder self-attention"),
        ({"non_causal": True}, "bidirectional"),
        ({"head_size_v": 64}, "value head size 64"),
        ({"alibi": True}, "alibi_slopes"),
        ({"extra": ("chunk_lookback",)}, "chunk_lookback"),
        ({"kv_sharing_target": "model.layers.1.self_attn.attn"}, "reads the KV cache of layer model.layers.1"),
        ({"own_backend": "FLEX_ATTENTION"}, "its own attention backend (FLEX_ATTENTION)"),
        ({"draft": True}, "speculative-decoding draft model"),
    ],
)
def test_each_feature_our_kernels_do_not_reproduce_keeps_the_layer_stock(change, words):
    why = stock_reason(LayerFacts(**{**PLAIN.__dict__, **change}), max_model_len=8192)
    assert why is not None and words in why, why


def test_a_draft_model_is_recognised_by_vllms_model_tag():
    """vLLM builds a speculative-decoding proposer (EAGLE / MTP head, draft model) under its own model tag: layers
    built then are marked ``draft`` (stock), the target model's are not."""
    pytest.importorskip("vllm")
    from vllm.compilation.backends import set_model_tag

    assert not decide._building_draft_model()
    for tag in decide.DRAFT_MODEL_TAGS:
        with set_model_tag(tag):
            assert decide._building_draft_model(), tag


def test_vision_tower_encoder_attention_is_found_and_never_ours():
    """A vision tower's ``MMEncoderAttention`` modules (no KV cache, no ``Attention`` layer) are listed for the
    start-up log; the plugin never gives them a backend."""
    pytest.importorskip("vllm")
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention import MMEncoderAttention

    with set_current_vllm_config(VllmConfig()):
        tower = torch.nn.ModuleList([MMEncoderAttention(2, 32, 32**-0.5) for _ in range(2)])
    model = torch.nn.ModuleDict({"visual": tower, "lm_head": torch.nn.Linear(4, 4)})
    assert report.encoder_attention_modules(model) == ["visual.0", "visual.1"]
    assert not any(runtime.is_ours(getattr(m, "impl", None)) for m in tower)


@pytest.mark.parametrize(
    "change", [{"sinks": True}, {"logits_soft_cap": 50.0}, {"sliding_window": 128}, {"sliding_window": 262144}]
)
def test_sinks_soft_cap_and_sliding_windows_of_any_length_are_compressed(change):
    """``attention.extras`` serves them on every path, in or outside an engine (no max_model_len needed)."""
    facts = LayerFacts(**{**PLAIN.__dict__, **change})
    assert stock_reason(facts, max_model_len=8192) is None
    assert stock_reason(facts, max_model_len=None) is None
    assert stock_reason(facts, 8192, FP16_FORMAT) == EXACT_FORMAT_REASON  # nothing to compress: stock, bit-exact


def test_a_format_that_stores_keys_and_values_exactly_keeps_the_layer_stock():
    """Nothing to compress: the layer stays on stock attention (bit-identical to vLLM without the plugin); a
    format that compresses keys or values alone is ours; a feature's reason comes first."""
    assert stock_reason(PLAIN, 8192, FP16_FORMAT) == EXACT_FORMAT_REASON
    assert stock_reason(PLAIN, 8192, KVFormat(key_mode="fp16", value_mode="fp16", recent_tokens=16)) is not None
    assert stock_reason(PLAIN, 8192, KVFormat()) is None
    assert stock_reason(PLAIN, 8192, KVFormat(key_mode="fp16", value_bits=8)) is None  # values compressed
    assert stock_reason(PLAIN, 8192, KVFormat(value_mode="fp16")) is None  # keys compressed
    alibi = LayerFacts(**{**PLAIN.__dict__, "alibi": True})
    assert "alibi_slopes" in stock_reason(alibi, 8192, FP16_FORMAT)


@pytest.mark.parametrize(
    "config, stock_layers",
    [("fp16", set(range(6))), ("tests/data/vllm_policy.yaml", {0, 5}), ("mse_k4v3", set())],
)
def test_each_layer_is_decided_from_its_format_under_the_config(monkeypatch, config, stock_layers):
    """The per-layer decision of the ``Attention.__init__`` hook: the format the config gives each layer (the fp16
    preset, ``keep_fp16_first`` / ``keep_fp16_last`` layers) decides, not the preset's name."""
    path = config if not config.startswith("tests/") else str(Path(__file__).resolve().parents[3] / config)
    monkeypatch.setenv(settings.ENV_CONFIG, path)
    model_config = SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=6), max_model_len=4096)
    why = {}
    for i in range(6):
        facts = LayerFacts(name=f"model.layers.{i}.self_attn.attn", head_size=64, num_heads=4, num_kv_heads=2)
        why[i] = stock_reason(facts, 4096, decide.planned_format(facts, model_config))
    assert {i for i, w in why.items() if w is not None} == stock_layers, why
    assert all(w == EXACT_FORMAT_REASON for w in why.values() if w is not None), why
    assert settings.compresses(load_config(path)) is (stock_layers != set(range(6)))


def test_refused_only_what_neither_backend_serves():
    assert refusal(PLAIN) is None
    assert "kv_cache_dtype 'fp8'" in refusal(LayerFacts(**{**PLAIN.__dict__, "kv_cache_dtype": "fp8"}))
    sharing = LayerFacts(**{**PLAIN.__dict__, "kv_sharing_target": "model.layers.1.self_attn.attn"})
    assert refusal(sharing, compressed=set()) is None  # it shares a stock layer's cache: stock too
    assert "which is compressed" in refusal(sharing, compressed={"model.layers.1.self_attn.attn"})


def test_startup_summary_names_layers_and_reasons():
    names = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
    decisions = {n: (None if i % 2 else "sliding_window 64 < max_model_len 512") for i, n in enumerate(names)}
    text = describe_layers(decisions)
    assert text == "compressed 3 of 6 attention layers (1, 3, 5); stock 0, 2, 4: sliding_window 64 < max_model_len 512"
    assert describe_layers({n: None for n in names}) == "compressed 6 of 6 attention layers (0-5)"
    exact = describe_layers({n: EXACT_FORMAT_REASON for n in names})
    assert exact == "compressed 0 of 6 attention layers; stock 0-5: format stores keys and values exactly (fp16)"


@pytest.mark.parametrize(
    "head_dim, kv_heads, stock_block, elt", [(256, 4, 128, 2), (128, 8, 16, 2), (64, 3, 128, 4), (96, 32, 16, 2)]
)
def test_hybrid_page_fills_whole_stock_pages_with_little_padding(head_dim, kv_heads, stock_block, elt):
    """The compressed page equals m stock pages (vLLM's hybrid groups need one page size), its block holds the
    most tokens that fit, a multiple of the unit, and at most 10 % of it is padding when some m <= 4 allows."""
    fmt = KVFormat()
    stock_page = stock_block * kv_heads * 2 * head_dim * elt  # a stock sliding-window page (K and V)
    unit = window_unit(stock_block, fmt.recent_tokens)
    block, per_head = hybrid_page(fmt, head_dim, kv_heads, stock_page, unit)
    whole = kv_heads * per_head
    assert whole % stock_page == 0 and per_head % 16 == 0 and block % unit == 0
    packed = PagedLayout(fmt, head_dim, block).packed_bytes
    assert packed <= per_head < PagedLayout(fmt, head_dim, block + unit).packed_bytes
    assert 1 - packed / per_head <= 0.1
    layout = PagedLayout(fmt, head_dim, block, per_head)
    assert layout.page_bytes == per_head and layout.offsets() == PagedLayout(fmt, head_dim, block).offsets()
    # tokens per byte vs the stock page: what compression gained survives the padding
    assert (block / whole) / (stock_block / stock_page) > 0.9 * (2 * head_dim * elt) / fmt.bytes_per_token(head_dim)


def test_hybrid_page_names_what_cannot_fit():
    with pytest.raises(UnsupportedModelError, match="no block size fits"):
        hybrid_page(KVFormat(), 128, 8, stock_page=1024, unit=128, max_multiple=2)


def test_page_stride_is_checked():
    from jetson_tq.errors import FormatError

    packed = PagedLayout(KVFormat(), 128, 16).packed_bytes
    with pytest.raises(FormatError, match="page_stride"):
        PagedLayout(KVFormat(), 128, 16, packed - 16)
    with pytest.raises(FormatError, match="multiple of 16"):
        PagedLayout(KVFormat(), 128, 16, packed + 8)


def test_spec_page_follows_block_size_and_padding():
    """vLLM rescales a spec's block size to unify pages: the page must follow (packed, or padded) exactly."""
    pytest.importorskip("vllm")
    from dataclasses import replace

    from jetson_tq.integrations.vllm.spec import layout_of_spec, make_spec

    fmt = KVFormat()
    packed = make_spec(128, 4, 128, fmt, PagedLayout(fmt, 128, 128))
    assert packed.page_size_bytes == 4 * PagedLayout(fmt, 128, 128).page_bytes
    assert replace(packed, block_size=256).page_size_bytes == 2 * packed.page_size_bytes
    assert layout_of_spec(replace(packed, block_size=256), 128) == PagedLayout(fmt, 128, 256)
    stride = PagedLayout(fmt, 128, 128).packed_bytes + 256
    padded = make_spec(128, 4, 128, fmt, PagedLayout(fmt, 128, 128, stride))
    assert padded.page_size_bytes == 4 * stride and padded.page_size_padded is None
    assert layout_of_spec(replace(padded, block_size=384), 128) == PagedLayout(fmt, 128, 384, 3 * stride)
