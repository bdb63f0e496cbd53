"""The flash prefill's host plan (``kernels.prefill_flash_plan``, numpy, once per step) against the plan written out
as plain Python loops over every sequence, block and row (what ``flash_prefill`` computed per layer before), on
random ragged steps: histories from 0, chunks from 1 token, on and off block boundaries, one or several workspace
segments. No kernel runs (the plan is host arithmetic and one copy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jetson_tq.errors import ShapeError
from jetson_tq.kernels.prefill_flash_plan import plan_flash_rows
from tests.helpers.kernel_cases import fresh_seed


def _loop_plan(hist: list[int], t: list[int], ring: int, seg: int) -> dict:
    """The plan by loops: part B's offsets and packed keys, part A's sub-sequences per segment."""
    qs = np.concatenate([[0], np.cumsum(t)]).tolist()
    blocks = [
        [
            (j * ring, max(h, j * ring) - h, min(h + n, (j + 1) * ring) - h)
            for j in range(h // ring, (h + n - 1) // ring + 1)
        ]
        for h, n in zip(hist, t)
    ]
    cu_q, cu_k, keys = [0], [0], []
    for b, h in enumerate(hist):
        keys += [("ring", b, i) for i in range(h % ring)] + [("row", qs[b] + r) for r in range(t[b])]
        for j, (_, r0, r1) in enumerate(blocks[b]):
            cu_q.append(qs[b] + r1)
            cu_k.append(cu_k[-1] + (r1 - r0) + (h % ring if j == 0 else 0))
    top = max(bl[-1][0] for bl in blocks)
    segments = []
    for s0 in range(0, top, seg):
        subs = [(b, r0, r1, min(st, s0 + seg) - s0) for b in range(len(hist)) for st, r0, r1 in blocks[b] if st > s0]
        segments.append(
            dict(
                s0=s0,
                rows=[qs[b] + r for b, r0, r1, _ in subs for r in range(r0, r1)],
                cu=[0, *np.cumsum([r1 - r0 for _, r0, r1, _ in subs]).tolist()],
                used=[u for *_, u in subs],
                seq=[b for b, *_ in subs],
            )
        )
    return dict(cu_q=cu_q, cu_k=cu_k, keys=keys, segments=segments)


@pytest.mark.parametrize("ring,workspace", [(16, None), (16, 64), (32, 32), (128, 256)])
def test_plan_matches_the_loops(ring, workspace):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    for _ in range(20):
        n = int(rng.integers(1, 7))
        hist = [int(x) for x in rng.choice([0, 1, ring - 1, ring, 3 * ring + 5, int(rng.integers(0, 20 * ring))], n)]
        t = [int(x) for x in rng.choice([1, 2, ring - 1, ring + 1, int(rng.integers(1, 5 * ring))], n)]
        plan = plan_flash_rows(hist, np.concatenate([[0], np.cumsum(t)]), ring, 2, 64, torch.device("cpu"), workspace)
        want = _loop_plan(hist, t, ring, plan.seg)
        why = f"seed={seed} hist={hist} t={t} R={ring} seg={plan.seg}"
        assert plan.rows == sum(t) and plan.sequences == n, why
        assert plan.cu_q.tolist() == want["cu_q"] and plan.cu_k.tolist() == want["cu_k"], why
        assert plan.max_q == max(np.diff(want["cu_q"])) and plan.max_k == max(np.diff(want["cu_k"])), why
        packed: list = [None] * plan.exact_keys
        for g, at in enumerate(plan.key_rows.tolist()):
            packed[at] = ("row", g)
        for at, b, i in zip(plan.ring_dst.tolist(), plan.ring_seq.tolist(), plan.ring_col.tolist()):
            packed[at] = ("ring", b, i)
        assert packed == want["keys"], why
        # the shortcut that skips packing: only when the packed keys are the chunk rows, in order
        assert plan.keys_are_rows == (want["keys"] == [("row", g) for g in range(sum(t))]), why
        assert plan.last.tolist() == [h + n - 1 for h, n in zip(hist, t)], why
        assert len(plan.segments) == len(want["segments"]), why
        for got, exp in zip(plan.segments, want["segments"]):
            assert got.s0 == exp["s0"] and got.rows.tolist() == exp["rows"] and got.cu_q.tolist() == exp["cu"], why
            assert got.used.tolist() == exp["used"] and got.max_k == max(exp["used"]), why
            rows = exp["rows"]
            one_slice = rows == list(range(rows[0], rows[0] + len(rows)))
            assert got.row_span == ((rows[0], rows[0] + len(rows)) if one_slice else None), why
            assert got.max_q == max(np.diff(exp["cu"])), why
            pages = plan.seg // ring
            assert got.table.tolist() == [[b * pages + p for p in range(pages)] for b in exp["seq"]], why
        if workspace is not None:
            assert plan.seg == -(-workspace // 64) * 64, why  # a multiple of the dequantizer's 64 tokens and R
        _check_one_call(plan, hist, t, ring, why)


def _check_one_call(plan, hist: list[int], t: list[int], ring: int, why: str) -> None:
    """``OneCall`` against loops: present exactly when the history is one workspace segment; sub-sequence s (block b
    of sequence j) reads j's dequantized pages [0, b), then its own exact page; every token of its block up to its
    last row (ring tokens of the first block, then chunk rows) sits in that page at offset position % R."""
    one = plan.one_call
    assert (one is not None) == (len(plan.segments) == 1), why
    if one is None:
        return
    pages = plan.seg // ring
    assert one.base == len(hist) * pages, why
    subs = [(b, j) for b, (h, n) in enumerate(zip(hist, t)) for j in range(h // ring, (h + n - 1) // ring + 1)]
    assert one.pages == one.base + len(subs), why
    home: dict = {}  # (sequence, position) -> workspace token of its exact copy
    for s, (b, j) in enumerate(subs):
        last = min(hist[b] + t[b], (j + 1) * ring) - 1
        assert one.used[s] == last + 1, why
        row = one.table[s].tolist()
        assert row[: j + 1] == [b * pages + p for p in range(j)] + [one.base + s], why
        for p in range(max(j * ring, 0), last + 1):
            home[(b, p)] = (one.base + s) * ring + p % ring
    assert one.max_k == max(one.used.tolist()), why
    qs = np.concatenate([[0], np.cumsum(t)])
    for b, (h, n) in enumerate(zip(hist, t)):
        assert one.row_dst[qs[b] : qs[b] + n].tolist() == [home[(b, h + i)] for i in range(n)], why
    for at, b, i in zip(one.ring_dst.tolist(), plan.ring_seq.tolist(), plan.ring_col.tolist()):
        assert at == home[(b, hist[b] - hist[b] % ring + i)], why
    every = one.row_dst.tolist() + one.ring_dst.tolist()
    assert len(set(every)) == len(every) == len(home), why  # each exact token once, nothing else in the pages


def test_plan_refuses_empty_chunks_and_negative_histories():
    for hist, qsl in (([3, 0], [0, 4, 4]), ([-1], [0, 2]), ([1, 2], [0, 3])):
        with pytest.raises(ShapeError, match="plan_flash_rows"):
            plan_flash_rows(hist, qsl, 16, 2, 64, torch.device("cpu"))
