"""``benchmarks/vllm_gpu/spec_decode.py``'s choices that need no engine: the draft-model proposer's config, prompts
cut from a text, and the usage errors that stop a GPU call before it starts an engine."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

HERE = Path(__file__).resolve().parents[3] / "benchmarks" / "vllm_gpu"
sys.path.insert(0, str(HERE))

import spec_decode  # noqa: E402


def test_draft_model_config_names_the_draft_directory():
    args = SimpleNamespace(method="draft_model", spec_tokens=4)
    assert spec_decode.speculative_config(args, "/m") == {
        "method": "draft_model",
        "model": "/m",
        "num_speculative_tokens": 4,
    }


def test_text_prompts_are_disjoint_pieces_and_the_first_pass_gets_the_next_ones():
    text = list(range(100))
    timed = spec_decode.prompts(3, 10, vocab=0, text=text)
    first = spec_decode.prompts(3, 10, vocab=0, seed=1, text=text)
    assert timed == [list(range(0, 10)), list(range(10, 20)), list(range(20, 30))]
    assert first[0] == list(range(30, 40)) and len(first) == 3
    with pytest.raises(SystemExit, match="60 tokens needed"):
        spec_decode.prompts(3, 20, vocab=0, seed=0, text=text[:50])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "draft_model"], "--method draft_model needs --model-dir"),
        (["--text", "essays"], "--text needs --model-dir"),
        (["--engines", "stock_spec,nope"], "--engines"),
    ],
)
def test_usage_errors(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        spec_decode.main(["--out", str(tmp_path), *argv])
    assert message in capsys.readouterr().err
