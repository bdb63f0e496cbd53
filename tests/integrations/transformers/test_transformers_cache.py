"""TurboQuantCache in transformers 5.17: drop-in generate/forward for Llama and Qwen2, our attention only, named
errors."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from jetson_tq.codec.kv import KVCodec
from jetson_tq.config import TurboQuantConfig, config_from_dict
from jetson_tq.errors import ConfigError, ShapeError, UnsupportedModelError
from jetson_tq.format import FP16_FORMAT, KVFormat
from jetson_tq.integrations import transformers as tqt
from jetson_tq.integrations.transformers import TurboQuantCache

SMALL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=256,
    max_position_embeddings=1024,
)
RAW16 = KVFormat(key_mode="fp16", value_mode="fp16", recent_tokens=0)
TIGHT = KVFormat(
    key_mode="mse", key_bits=4, value_mode="group", value_bits=4, value_group=32, recent_tokens=8, window="sliding"
)  # the ring rule the assertions below spell out


def _model(kind: str = "llama", **extra):
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SMALL, **extra))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**SMALL, **extra))
    return model.eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_passthrough_format_matches_dynamic_cache(kind):
    model = _model(kind)
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        ref = model(ids).logits
        cache = TurboQuantCache(model, RAW16)
        assert model.config._attn_implementation == "turboquant"
        chunks = [model(ids[:, s : s + 16], past_key_values=cache).logits for s in range(0, 40, 16)]
    got = torch.cat(chunks, dim=1)
    assert torch.allclose(got, ref, atol=2e-3), (got - ref).abs().max()
    assert cache.get_seq_length() == 40


def test_load_from_takes_over_an_exact_prefill():
    """An exact prefill in a ``DynamicCache``, loaded into a passthrough cache: the next chunk reads the same
    history (logits of the whole sequence at once); a cache of another depth is refused by name."""
    model = _model()
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        ref = model(ids).logits[:, 32:]
        prefilled = DynamicCache(config=model.config)
        model(ids[:, :32], past_key_values=prefilled)
        cache = TurboQuantCache(model, RAW16).load_from(prefilled)
        assert cache.get_seq_length() == 32
        got = model(ids[:, 32:], past_key_values=cache).logits
    assert torch.allclose(got, ref, atol=2e-3), (got - ref).abs().max()
    with pytest.raises(ShapeError, match="expected 2 layers, got 3"):
        tqt.append_prefilled(prefilled, 2, cache.append)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_generate_drop_in_compresses_history_and_stays_close(kind):
    model = _model(kind)
    ids = torch.randint(0, 256, (1, 24))
    ref = model.generate(ids, max_new_tokens=30, do_sample=False, past_key_values=DynamicCache(config=model.config))
    cache = TurboQuantCache(model, TIGHT)
    out = model.generate(ids, max_new_tokens=30, do_sample=False, past_key_values=cache)
    assert out.shape == ref.shape
    store = cache.layers[0].store
    nc, nb = int(store.compressed_lens[0]), int(store.buffer_lens[0])
    assert (nc, nb) == (45, 8)  # 24 + 29 tokens stored, all compressed; the last 8 are read from the exact ring
    per_token = TIGHT.bytes_per_token(32)  # 38 B vs 128 B in fp16
    assert per_token * 2 < 2 * 32 * 2
    assert cache.used_bytes() == 3 * 2 * (53 * per_token + nb * 2 * 32 * 4)  # layers * heads * (all + fp32 ring)
    # 4-bit keys and values on a random model: the first generated tokens agree with the exact cache.
    assert torch.equal(out[0, 24:28], ref[0, 24:28])


def test_keys_are_never_dequantized(monkeypatch):
    """Scores over compressed tokens use the rotated query; a call to decode_keys would mean stock attention on
    dequantized keys."""
    model = _model()

    def forbidden(self, fields):
        raise AssertionError("decode_keys called: keys must be scored through the rotated query")

    calls = {"n": 0}
    real_scores = KVCodec.key_scores

    def counting(self, *a, **k):
        calls["n"] += 1
        return real_scores(self, *a, **k)

    monkeypatch.setattr(KVCodec, "decode_keys", forbidden)
    monkeypatch.setattr(KVCodec, "key_scores", counting)
    cache = TurboQuantCache(model, KVFormat(key_mode="prod", key_bits=3, recent_tokens=0))
    model.generate(torch.randint(0, 256, (1, 20)), max_new_tokens=6, do_sample=False, past_key_values=cache)
    assert calls["n"] >= 3 * 6


def test_padded_batch_matches_single_rows():
    model = _model()
    cfg = RAW16
    a, b = torch.randint(3, 256, (1, 30)), torch.randint(3, 256, (1, 22))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 8, dtype=torch.long), b], 1)])
    mask = torch.ones_like(ids)
    mask[1, :8] = 0
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        past_key_values=TurboQuantCache(model, cfg),
    )
    out_a = model.generate(a, max_new_tokens=8, do_sample=False, past_key_values=TurboQuantCache(model, cfg))
    out_b = model.generate(b, max_new_tokens=8, do_sample=False, past_key_values=TurboQuantCache(model, cfg))
    assert torch.equal(out[0, 30:], out_a[0, 30:])
    assert torch.equal(out[1, 30:], out_b[0, 22:])


def test_dynamic_cache_still_exact_after_switching_attention():
    model = _model()
    ids = torch.randint(0, 256, (1, 33))
    with torch.no_grad():
        ref = model(ids).logits
        tqt.enable_turboquant(model)
        dyn = DynamicCache(config=model.config)
        got = torch.cat([model(ids[:, s : s + 10], past_key_values=dyn).logits for s in range(0, 33, 10)], 1)
    assert torch.allclose(got, ref, atol=1e-4)


def test_per_layer_formats_from_config():
    model = _model()
    cfg = config_from_dict(
        {"keys": {"mode": "mse", "bits": 3}, "layers": {"keep_fp16_first": 1, "overrides": {2: {"keys": {"bits": 4}}}}}
    )
    cache = TurboQuantCache(model, cfg)
    assert cache.formats[0] == FP16_FORMAT
    assert cache.formats[1].key_bits == 3 and cache.formats[2].key_bits == 4
    assert cache.layers[1].seed != cache.layers[2].seed  # independent rotations per layer
    assert isinstance(TurboQuantCache(model, "k4v4").tq_config, TurboQuantConfig)


def test_named_errors():
    model = _model()
    with pytest.raises(UnsupportedModelError, match="soft-capping"):  # refused by its features, not its name
        TurboQuantCache(model.config.__class__.from_dict({**model.config.to_dict(), "attn_logit_softcapping": 50.0}))
    with pytest.raises(UnsupportedModelError, match="sliding"):
        TurboQuantCache(_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1))
    TurboQuantCache(model, KVFormat(value_group=64))  # head_dim 32 < group 64: one group of 32 (not refused)
    with pytest.raises(ConfigError):
        TurboQuantCache(model, 42)
    # A model left on SDPA cannot consume our compressed K/V: named error, not silent wrong attention.
    plain = _model()
    plain.set_attn_implementation("sdpa")
    with pytest.raises(UnsupportedModelError, match="turboquant"):
        plain(torch.randint(0, 256, (1, 8)), past_key_values=TurboQuantCache(plain, TIGHT, enable=False))
    with pytest.raises(UnsupportedModelError, match="beam"):
        model.generate(
            torch.randint(0, 256, (1, 8)),
            num_beams=2,
            max_new_tokens=3,
            do_sample=False,
            past_key_values=TurboQuantCache(model, TIGHT),
        )
