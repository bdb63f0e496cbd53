"""The ring pools' reserve: a warning when vLLM's ``max_num_seqs`` makes it a large share of the KV budget."""

from __future__ import annotations

import pytest

from jetson_tq.integrations.vllm.memory import RING_SHARE_WARN, ring_share_warning

ROW = 7 * 2**20  # Qwen2.5-7B: 28 layers x 4 KV heads x 128 tokens x 128 x K and V x 2 bytes


def test_a_default_of_1024_sequences_warns_with_its_share_and_the_setting():
    text = ring_share_warning(1025 * ROW, 40 * 2**30, 1024)
    assert text is not None
    assert "max_num_seqs=1024" in text and "7.01 GiB" in text and "18 %" in text and "--max-num-seqs" in text


@pytest.mark.parametrize(
    ("rows", "budget_gib"), [(8, 8), (64, 40), (1024, 0)], ids=["few-rows", "at-scale", "no-budget"]
)
def test_a_small_share_or_no_budget_is_silent(rows, budget_gib):
    pool = (rows + 1) * ROW
    assert pool <= RING_SHARE_WARN * budget_gib * 2**30 or budget_gib == 0
    assert ring_share_warning(pool, budget_gib * 2**30, rows) is None
