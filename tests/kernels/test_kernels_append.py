"""The append bookkeeping kernel (``kernels.append``) against its PyTorch reference ``paged.append_rows_reference``:
slots, overflow flag, exact ring copy and lengths, for staged, committed and full appends, any ring size."""

from __future__ import annotations

import pytest
import torch

from jetson_tq.format import exact_count
from jetson_tq.kernels.append import append_rows
from jetson_tq.paged import AppendState, AppendStep, append_rows_reference
from tests.helpers.kernel_cases import DEVICE, fresh_seed

pytestmark = pytest.mark.kernel


def _state(b: int, h: int, ring: int, d: int, lens: list[int], gen: torch.Generator, block: bool = False):
    rk = torch.randn(b, h, ring, d, generator=gen).half().to(DEVICE)
    rv = torch.randn(b, h, ring, d, generator=gen).half().to(DEVICE)
    L = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    rec = exact_count(L, ring, block)
    return [rk, rv, L, L - rec, rec, torch.zeros((), dtype=torch.bool, device=DEVICE)]


@pytest.mark.parametrize(
    "ring,t,row0,nb,stage,commit,block",
    [
        (8, 1, 0, 3, True, True, False),  # a decode step for a batch
        (8, 21, 1, 1, True, True, False),  # a prefill chunk longer than the ring
        (16, 5, 0, 1, True, False, False),  # stage only: slots, nothing counted
        (16, 5, 2, 1, False, True, False),  # commit only
        (0, 7, 0, 1, True, True, False),  # no ring
        (8, 30, 0, 1, True, True, False),  # past the capacity: slots -1, overflow set
        (8, 1, 0, 3, True, True, True),  # block window: a decode step (13 -> 14 tokens: 6 exact; 3 -> 4; 30 -> 31)
        (8, 11, 1, 1, True, True, True),  # block window: a chunk across two boundaries (3 -> 14 tokens)
        (8, 5, 0, 1, False, True, True),  # block window: commit only
    ],
)
def test_append_kernel_matches_reference(ring, t, row0, nb, stage, commit, block):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    b, h, d, capacity = 3, 2, 64, 40
    lens = [13, 3, 30]
    k = torch.randn(nb, h, t, d, generator=gen).to(DEVICE)  # fp32 in: stored through the ring dtype
    v = torch.randn(nb, h, t, d, generator=gen).to(DEVICE)
    ref, got = (
        _state(b, h, ring, d, lens, torch.Generator().manual_seed(seed), block),
        _state(b, h, ring, d, lens, torch.Generator().manual_seed(seed), block),
    )
    step = AppendStep(row0, capacity, stage, commit)
    want_slots = append_rows_reference(k, v, AppendState(*ref, block), step)
    got_slots = append_rows(k, v, AppendState(*got, block), step)
    if stage:
        assert torch.equal(got_slots.cpu(), want_slots.cpu()), f"seed={seed}"
    for name, a, w in zip(("ring_k", "ring_v", "lens", "comp", "rec", "overflow"), got, ref):
        assert torch.equal(a.cpu(), w.cpu()), f"{name} seed={seed}"


@pytest.mark.parametrize("fault", [False, True])
def test_guarded_commit_and_slots_buffer_match_reference(fault):
    """The commit behind a store fault record (``guard``): committed while it is clean, else nothing is committed and
    the record is closed; slots written into a caller's buffer (``out``) equal the allocated ones."""
    from jetson_tq.validate import FAULT_NONE

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    b, h, d, capacity, ring, t = 3, 2, 64, 40, 8, 5
    lens = [13, 3, 30]
    k = torch.randn(b, h, t, d, generator=gen).to(DEVICE)
    v = torch.randn(b, h, t, d, generator=gen).to(DEVICE)
    ref, got = (_state(b, h, ring, d, lens, torch.Generator().manual_seed(seed)) for _ in range(2))
    code = 3 if fault else FAULT_NONE
    guards = [torch.tensor([code, 0], dtype=torch.int64, device=DEVICE) for _ in range(2)]
    out = torch.full((b * t,), -7, dtype=torch.int64, device=DEVICE)
    want_slots = append_rows_reference(k, v, AppendState(*ref), AppendStep(0, capacity, True, False))
    got_slots = append_rows(k, v, AppendState(*got), AppendStep(0, capacity, True, False, out=out))
    assert got_slots.data_ptr() == out.data_ptr() and torch.equal(out.cpu(), want_slots.cpu()), f"seed={seed}"
    append_rows_reference(k, v, AppendState(*ref), AppendStep(0, capacity, False, True, guard=guards[0]))
    append_rows(k, v, AppendState(*got), AppendStep(0, capacity, False, True, guard=guards[1]))
    assert torch.equal(guards[1].cpu(), guards[0].cpu()), f"seed={seed}"
    assert guards[1].tolist() == [code, 1 if fault else 0]
    for name, a, w in zip(("ring_k", "ring_v", "lens", "comp", "rec", "overflow"), got, ref):
        assert torch.equal(a.cpu(), w.cpu()), f"{name} seed={seed}"
    assert (got[2].tolist() == lens) == fault  # refused: the lengths stayed
