"""The calibration cache: identity, bad entries (stale, corrupt, truncated, another model, another head dim) read as
named errors or recalibrated cleanly, never served; ``auto``'s fallback with one log line; ``auto`` from a
checkpoint directory (the vLLM plugin's path)."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from jetson_tq.calibration import auto
from jetson_tq.calibration.keys import Recipe
from jetson_tq.calibration.store import (
    StaleCalibrationError,
    checkpoint_identity,
    entry_meta,
    model_identity,
    read_entry,
)
from jetson_tq.codec.klt import load_transforms, save_transforms
from jetson_tq.config import FALLBACK_PRESET
from jetson_tq.errors import ConfigError
from jetson_tq.integrations.transformers import TurboQuantCache
from tests.calibration.families import tiny_model

pytestmark = pytest.mark.slow  # calibrations of tiny models (~2-4 s each on 2 cores)

SHORT = Recipe(windows=1, window_len=256)  # what the cache's checks need, at a fraction of the auto recipe's cost


def _calls(monkeypatch) -> list:
    """Count calibrations (the driver's calls) from now on."""
    calls: list = []
    real = auto.calibrate_model

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(auto, "calibrate_model", counted)
    return calls


def test_identity_is_the_same_from_the_model_and_its_checkpoint_and_differs_between_models(tmp_path):
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    a.save_pretrained(tmp_path / "a")
    assert model_identity(a) == model_identity(a.to(torch.float64).to(torch.float32))
    assert checkpoint_identity(tmp_path / "a").weights == model_identity(a).weights
    assert checkpoint_identity(tmp_path / "a").config == model_identity(a).config
    assert model_identity(a).weights != model_identity(b).weights
    assert model_identity(a).config != model_identity(tiny_model("qwen2")).config


def test_bad_entries_are_recalibrated_never_served(tokenizer, calibration_dir, monkeypatch, caplog):
    model = tiny_model("qwen3")
    calls = _calls(monkeypatch)
    path = auto.calibrate_entry(model, tokenizer, SHORT, progress=None)
    assert len(calls) == 1 and path.is_file()
    good = path.read_bytes()
    assert auto.calibrate_entry(model, tokenizer, SHORT, progress=None) == path and len(calls) == 1  # cached

    for damage in ("truncated", "corrupt", "stale version", "another model", "empty"):
        if damage == "truncated":
            path.write_bytes(good[: len(good) // 2])
        elif damage == "corrupt":
            path.write_bytes(b"\x00not a torch file" * 64)
        elif damage == "empty":
            path.write_bytes(b"")
        else:
            layers, meta = load_transforms(path)
            if damage == "stale version":
                meta["calibration_version"] = -1
            else:
                meta["weights_digest"] = "0" * 64
            save_transforms(path, layers, meta)
        notes: list[str] = []
        assert auto.calibrate_entry(model, tokenizer, SHORT, progress=notes.append) == path
        assert notes and notes[0].startswith("recalibrating:"), (damage, notes[:1])
        read_entry(path, _meta(model, path))  # valid again
    assert len(calls) == 6  # one calibration, then one per damaged file


def _meta(model, path) -> dict:
    layers, meta = load_transforms(path)
    return {k: meta[k] for k in entry_meta(model_identity(model), meta["recipe"], 0, 0, 0) if k in meta}


def test_an_entry_for_another_head_dim_or_model_is_a_named_error(tokenizer, tmp_path):
    model = tiny_model("llama")
    path = auto.calibrate_entry(model, tokenizer, SHORT, progress=None)
    meta = _meta(model, path)
    with pytest.raises(StaleCalibrationError, match="head_dim"):
        read_entry(path, dict(meta, head_dim=64))
    with pytest.raises(StaleCalibrationError, match="weights_digest"):
        read_entry(path, dict(meta, weights_digest=model_identity(tiny_model("llama", seed=3)).weights))
    with pytest.raises(StaleCalibrationError, match="not found"):
        read_entry(tmp_path / "missing.pt", meta)
    # the same file named explicitly for a model of another head dim: TurboQuantCache refuses it by name
    other = tiny_model("phi3")  # head dim 24
    cfg = auto.entry_config(path, SHORT, "llama")
    with pytest.raises(ConfigError, match="layers|KV heads"):
        TurboQuantCache(other, cfg)


def test_a_model_that_cannot_be_calibrated_falls_back_with_one_log_line(tokenizer, caplog):
    model = tiny_model("llama")
    with caplog.at_level(logging.WARNING, logger="jetson_tq.calibration"):
        cache = TurboQuantCache(model, "auto", backend="reference")  # no tokenizer: not saved anywhere
    assert cache.tq_config.name == FALLBACK_PRESET
    lines = [r for r in caplog.records if r.name == "jetson_tq.calibration"]
    assert len(lines) == 1 and "serving mse_k4v3" in lines[0].getMessage() and "tokenizer" in lines[0].getMessage()
    ids = torch.randint(3, 500, (1, 40))
    with torch.no_grad():
        assert torch.isfinite(model(ids, past_key_values=cache).logits).all()


def test_checkpoint_directory_auto_calibrates_once_and_falls_back_by_name(tokenizer, tmp_path, caplog, monkeypatch):
    model = tiny_model("mistral")
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    calls = _calls(monkeypatch)
    first = auto.config_for_checkpoint(tmp_path / "m", progress=None)
    assert first.endswith(".yaml") and len(calls) == 1
    assert auto.config_for_checkpoint(tmp_path / "m", progress=None) == first and len(calls) == 1
    from jetson_tq.config import load_config

    cfg = load_config(first)
    assert cfg.needs_key_transform and load_transforms(cfg.key_transform)[1]["head_dim"] == 32

    shutil.copytree(tmp_path / "m", tmp_path / "noweights", ignore=shutil.ignore_patterns("*.safetensors"))
    cases = {
        "dummy": (tmp_path / "m", "dummy"),
        "no weights": (tmp_path / "noweights", "auto"),
        "no directory": (tmp_path / "absent", "auto"),
    }
    for why, (where, load_format) in cases.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jetson_tq.calibration"):
            assert auto.config_for_checkpoint(where, load_format=load_format, progress=None) == FALLBACK_PRESET
        lines = [r.getMessage() for r in caplog.records if r.name == "jetson_tq.calibration"]
        assert len(lines) == 1 and FALLBACK_PRESET in lines[0], (why, lines)
    assert len(calls) == 1


def test_the_vllm_switch_resolves_auto_before_the_engine_and_workers_inherit_it(tokenizer, tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from jetson_tq.integrations.vllm import plugin, settings

    model = tiny_model("granite")
    model.save_pretrained(tmp_path / "g")
    tokenizer.save_pretrained(tmp_path / "g")
    monkeypatch.setenv(settings.ENV_CONFIG, "auto")
    monkeypatch.setenv(plugin.ENV_AUTO, "")  # restored after the test (resolving sets it in os.environ)
    assert plugin.auto_requested()
    assert settings.active_config().name == "auto"  # before resolution: the calibrated format, no transform yet
    resolved = plugin.resolve_auto_for_engine(str(tmp_path / "g"), "auto")
    assert resolved.endswith(".yaml") and settings.config_name() == resolved and plugin.auto_requested()
    assert settings.active_config().needs_key_transform and settings.layer_key_transform(0).head_dim == 32
    assert plugin.resolve_auto_for_engine(str(tmp_path / "g"), "dummy") == FALLBACK_PRESET  # a later engine
    monkeypatch.setenv(settings.ENV_CONFIG, "tests/data/vllm_rawkeys_v8_r16.yaml")  # an explicit switch set since:
    assert not plugin.auto_requested()  # what it names is served, not auto (child engines inherit the environment)
    settings._load.cache_clear()


def test_layers_with_their_own_rope_keep_it_in_the_file(tmp_path):
    """A model whose layers apply different RoPE (Gemma 3: local and global theta) gets each layer's back."""
    import dataclasses

    from jetson_tq.codec.klt import RotaryParams, default_inv_freq, spread_transform

    local = spread_transform(2, 32, 104, theta=1e4)
    wide = dataclasses.replace(local, rotary=RotaryParams(default_inv_freq(32, 1e6), 1.5))
    save_transforms(tmp_path / "t.pt", [local, wide, None, local], {})
    layers, _ = load_transforms(tmp_path / "t.pt")
    assert torch.equal(layers[0].rotary.inv_freq, local.rotary.inv_freq) and layers[2] is None
    assert torch.equal(layers[1].rotary.inv_freq, wide.rotary.inv_freq) and layers[1].rotary.attention_scaling == 1.5
    assert torch.equal(layers[3].rotary.inv_freq, local.rotary.inv_freq) and layers[3].rotary.attention_scaling == 1.0


def test_each_layer_is_calibrated_with_the_rope_it_applies(tokenizer):
    """Gemma 3 with a local (sliding, theta 1e4) and a global layer (theta 1e6): each layer's transform holds the
    frequencies of its own layer type, read from the (cos, sin) the layer received."""
    model = tiny_model("gemma3", layer_types=["sliding_attention", "full_attention"], sliding_window=128)
    layers, _ = load_transforms(auto.calibrate_entry(model, tokenizer, SHORT, progress=None))
    rope = model.model.rotary_emb
    assert torch.equal(layers[0].rotary.inv_freq, rope.sliding_attention_inv_freq.float())
    assert torch.equal(layers[1].rotary.inv_freq, rope.full_attention_inv_freq.float())
    assert not torch.equal(layers[0].rotary.inv_freq, layers[1].rotary.inv_freq)
