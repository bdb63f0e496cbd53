"""CI slice of issue 22's quality check: the default preset and the 5x preset on text no calibration ever saw.

Two kinds of held-out text (Paul Graham's essays, the first tokens; Newton's *Opticks*, shipped by apache-tvm-ffi),
2 windows x 768 teacher-forced tokens each, chunks of 128 (history read compressed past each query's own block),
the ``cpu-decoded`` backend (equal to the reference path: tests/lab/eval/test_fidelity.py), plus greedy agreement and a
1k pass key. Bounds are the full measurement's (docs/fidelity.md, "Quality at 5x") loosened for a slice this short.
"""

from __future__ import annotations

import pytest
import torch

from jetson_tq.config import DEFAULT_PRESET, load_config
from jetson_tq.models.smollm2 import load_smollm2
from jetson_tq.models.text import text_by_name
from lab.eval import fidelity as F

FIVE_X = "mse_k3v3w256"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_and_tok():
    torch.manual_seed(0)
    return load_smollm2()


@pytest.fixture(scope="module")
def tokens(model_and_tok):
    _, tok = model_and_tok
    try:
        return {name: tok(text_by_name(name), return_tensors="pt").input_ids[0] for name in ("essays", "opticks")}
    except Exception as e:
        pytest.skip(f"held-out text not installed: {e}")


def _variants() -> list[F.Variant]:
    return [F.Variant(name, "preset", load_config(name), backend="cpu-decoded") for name in (DEFAULT_PRESET, FIVE_X)]


@pytest.fixture(scope="module")
def metrics(model_and_tok, tokens):
    model, _ = model_and_tok
    return {
        name: F.teacher_forced(model, F.token_windows(ids, 2, 769), _variants(), chunk=128, batch=2)
        for name, ids in tokens.items()
    }


def test_five_x_preset_stores_at_most_102_bytes_at_head_dim_128():
    cfg = load_config(FIVE_X)
    assert F.Variant(FIVE_X, "", cfg).bytes_per_token(30, 128) <= 102.0
    assert cfg.default.compression_ratio(128) >= 5.0
    assert cfg.default.block_window  # prefix caching stays on in vLLM


@pytest.mark.parametrize("text", ["essays", "opticks"])
@pytest.mark.parametrize("preset", [DEFAULT_PRESET, FIVE_X])
def test_preset_close_to_uncompressed_on_held_out_text(metrics, text, preset):
    ref, got = metrics[text]["reference"], metrics[text][preset]
    assert ref["tokens"] == 1536
    assert got["ppl"] < ref["ppl"] * 1.035, (text, got, ref)
    assert got["kl"] < 0.03 and got["top1"] > 0.9, (text, got)


def test_greedy_agreement_and_pass_key(model_and_tok, tokens):
    model, tok = model_and_tok
    ids = tokens["essays"]
    prompts = F.token_windows(ids[8192:], 2, 512)
    gen = F.generation(model, prompts, _variants(), new_tokens=32, chunk=16)
    cases = F.needle_cases(tok, ids[12288:], [1024], [0.5])
    found = F.needle(model, tok, cases, _variants())
    for name in (DEFAULT_PRESET, FIVE_X):
        assert gen[name]["greedy_agreement"] >= 0.9, (name, gen[name])
        assert found[name]["1024"]["found"] == found["reference"]["1024"]["found"], (name, found)
