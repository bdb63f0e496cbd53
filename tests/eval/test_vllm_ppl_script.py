"""benchmarks/vllm_gpu/ppl.py's scoring, checked on CPU without vLLM: PPL from the actual tokens' log-probabilities,
top-1 agreement and the top-20 KL lower bound against stock, computed from prompt_logprobs-shaped rows."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_gpu"))

import ppl


def _row(actual: float, top: dict[int, float]) -> list:
    return [actual, top]


def test_identical_rows_give_zero_kl_and_full_agreement():
    rows = [[_row(math.log(0.5), {1: math.log(0.5), 2: math.log(0.3)}), _row(math.log(0.2), {3: math.log(0.7)})]]
    got = ppl.compare(rows, rows)
    assert got["tokens"] == 2 and got["top1"] == 1.0 and got["kl_top20"] == pytest.approx(0.0, abs=1e-12)
    assert got["ppl"] == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.2)) / 2))


def test_shifted_distribution_gives_positive_kl_and_disagreement():
    ref = [[_row(math.log(0.6), {1: math.log(0.6), 2: math.log(0.4)})]]
    got = [[_row(math.log(0.3), {1: math.log(0.3), 2: math.log(0.7)})]]
    res = ppl.compare(ref, got)
    want = 0.6 * math.log(0.6 / 0.3) + 0.4 * math.log(0.4 / 0.7)
    assert res["kl_top20"] == pytest.approx(want) and res["top1"] == 0.0
    # a token missing from the config's top-20 gets its smallest listed log-probability
    miss = [[_row(math.log(0.3), {2: math.log(0.7), 3: math.log(0.2)})]]
    assert ppl.compare(ref, miss)["kl_top20"] == pytest.approx(0.6 * math.log(0.6 / 0.2) + 0.4 * math.log(0.4 / 0.7))


def test_windows_refuse_a_text_too_short(tmp_path, monkeypatch):
    class Tok:
        def __call__(self, text):
            return type("E", (), {"input_ids": list(range(len(text.split())))})()

    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(lambda *_a, **_k: Tok()))
    text = tmp_path / "t.txt"
    text.write_text("a b c d e f")
    assert ppl.windows("m", str(text), 2, 3, 0) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(SystemExit, match="need 8 tokens"):
        ppl.windows("m", str(text), 2, 4, 0)
