"""benchmarks/vllm_gpu/real_weights.py's scoring, checked on CPU without vLLM: PPL from the actual tokens'
log-probabilities, top-1 agreement and the top-k KL lower bound against stock from prompt_logprobs-shaped rows, the
text cut into disjoint pieces, the table that puts the transformers harness beside vLLM's figures, the bitwise
VERDICT line and the random token ids of ``--dummy``."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks" / "vllm_gpu"))

import real_weights as rw


def _row(actual: float, top: dict[int, float]) -> list:
    return [actual, top]


def test_identical_rows_give_zero_kl_and_full_agreement():
    rows = [[_row(math.log(0.5), {1: math.log(0.5), 2: math.log(0.3)}), _row(math.log(0.2), {3: math.log(0.7)})]]
    got = rw.top_kl(rows, rows)
    assert got["tokens"] == 2 and got["top1"] == 1.0 and got["kl_top"] == pytest.approx(0.0, abs=1e-12)
    assert got["ppl"] == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.2)) / 2))


def test_shifted_distribution_gives_positive_kl_and_disagreement():
    ref = [[_row(math.log(0.6), {1: math.log(0.6), 2: math.log(0.4)})]]
    got = [[_row(math.log(0.3), {1: math.log(0.3), 2: math.log(0.7)})]]
    res = rw.top_kl(ref, got)
    want = 0.6 * math.log(0.6 / 0.3) + 0.4 * math.log(0.4 / 0.7)
    assert res["kl_top"] == pytest.approx(want) and res["top1"] == 0.0
    # a token missing from the config's top-k gets its smallest listed log-probability
    miss = [[_row(math.log(0.3), {2: math.log(0.7), 3: math.log(0.2)})]]
    assert rw.top_kl(ref, miss)["kl_top"] == pytest.approx(0.6 * math.log(0.6 / 0.2) + 0.4 * math.log(0.4 / 0.7))


def test_pieces_are_disjoint_and_refuse_a_text_too_short(monkeypatch):
    class Tok:
        def __call__(self, text):
            return type("E", (), {"input_ids": list(range(len(text.split())))})()

    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(lambda *_a, **_k: Tok()))
    text = " ".join("w" * 12)
    assert rw.pieces("m", text, 2, 3, 2, 2) == ([[0, 1, 2], [3, 4, 5]], [[6, 7], [8, 9]])
    assert rw.pieces("m", text, 1, 3, 1, 2, offset=5) == ([[5, 6, 7]], [[8, 9]])
    with pytest.raises(SystemExit, match="13 tokens needed .* after offset 0, the text has 12"):
        rw.pieces("m", text, 3, 3, 2, 2)


def test_compare_and_table_put_the_harness_beside_vllm():
    rows_a = [[_row(math.log(0.6), {1: math.log(0.6), 2: math.log(0.4)})]]
    rows_b = [[_row(math.log(0.5), {1: math.log(0.5), 2: math.log(0.5)})]]

    def rec(rows, ids, ppl):
        return {
            "ppl": ppl,
            "_rows": rows,
            "window_logprobs": [[r[0] for r in rows[0]]],
            "window_top1": [[1]],
            "greedy_ids": ids,
            "greedy_logprobs": [[-0.1, -0.2, -0.3]],
            "nonfinite_logprobs": 0,
            "init_s": 1.0,
        }

    stock, ours = rec(rows_a, [[5, 6, 7]], 10.0), rec(rows_b, [[5, 6, 8]], 10.2)
    c = rw.compare(stock, ours)
    assert c["bitwise"] is False
    assert rw.verdict("mse_k4v3", ours, c, 2).startswith("VERDICT mse_k4v3 vs stock: DIFFERS (greedy identical 0/1")
    same = rw.compare(stock, rec(rows_a, [[5, 6, 7]], 10.0))
    assert same["bitwise"] is True and same["max_abs_prompt_logprob_diff"] == 0.0
    fp16 = {**stock, "compressed_layers": 0, "layers": 30}
    assert rw.verdict("fp16", fp16, same, 2) == (
        "VERDICT fp16 vs stock: BITWISE IDENTICAL (1/1 greedy continuations, 4 log-probabilities and the prompt "
        "positions' top-2 lists equal; 0/30 layers compressed)"
    )
    # one top-k entry off in the last bit is no longer bitwise
    nudged = [[_row(math.log(0.6), {1: math.log(0.6), 2: math.nextafter(math.log(0.4), 0.0)})]]
    assert rw.compare(stock, rec(nudged, [[5, 6, 7]], 10.0))["bitwise"] is False
    assert c["ppl_vs_stock"] == pytest.approx(0.02) and c["greedy_identical"] == 0 and c["first_divergence"] == [2]
    assert c["kl_top_vs_stock"] == pytest.approx(0.6 * math.log(0.6 / 0.5) + 0.4 * math.log(0.4 / 0.5), abs=1e-6)
    result = {
        "engines": {"stock": stock, "mse_k4v3": {**ours, "compressed_layers": 30, "layers": 30}},
        "vs_stock": {"mse_k4v3": c},
        "transformers": {"rows": {"reference": {"ppl": 20.0, "kl": 0.0}, "mse_k4v3": {"ppl": 20.3, "kl": 0.0137}}},
    }
    lines = rw.table(result).splitlines()
    assert lines[2].startswith("| stock | — | 10.0 | — |") and lines[2].endswith("| +0.00 % | — |")
    assert "| mse_k4v3 | 30/30 | 10.2 | +2.00 % |" in lines[3] and lines[3].endswith("| +1.50 % | 0.0137 |")
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_dummy_pieces_are_seeded_token_ids_below_the_vocab():
    wins, held = rw.random_pieces(500, 2, 16, 3, 8, seed=1)
    assert [len(w) for w in wins] == [16, 16] and [len(h) for h in held] == [8, 8, 8]
    assert all(100 <= t < 500 for piece in wins + held for t in piece)
    assert rw.random_pieces(500, 2, 16, 3, 8, seed=1) == (wins, held) != rw.random_pieces(500, 2, 16, 3, 8, seed=2)


def test_text_is_a_file_or_a_project_text_by_name(tmp_path, capsys):
    """``--text``: a UTF-8 file, or 'essays' / 'opticks' by name; anything else is a usage error naming both."""
    import argparse

    p = argparse.ArgumentParser(prog="real_weights.py")
    f = tmp_path / "t.txt"
    f.write_text("a held-out text", encoding="utf-8")
    assert rw._text(str(f), p) == "a held-out text"
    from jetson_tq.models.text import text_by_name

    assert rw._text("opticks", p) == text_by_name("opticks")
    with pytest.raises(SystemExit) as e:
        rw._text(str(tmp_path / "missing.txt"), p)
    assert e.value.code == 2 and "expected a UTF-8 text file or one of ('essays', 'opticks')" in capsys.readouterr().err
