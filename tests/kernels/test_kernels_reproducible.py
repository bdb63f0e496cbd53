"""Reproducible mode of chunked prefill (``PrefillTuning(reproducible=True)``, the vLLM backend's switch): a query
row's output is bitwise the same whatever chunk it arrives in (one prompt chunk, another chunking, a one-token
decode step) and whatever rows share the launch, and it still matches the PyTorch reference.

One sequence's K/V are written compressed into shuffled pages once; each call then sees, as vLLM hands it over, the
history before its chunk (compressed part in the pages, the ring holding the exact tokens the window rule asks for
at column p % R) and the chunk's own exact K/V.
"""

from __future__ import annotations

import pytest
import torch

from jetson_tq.attention.reference import paged_attention_prefill
from jetson_tq.codec.kv import KVCodec
from jetson_tq.format import PagedLayout
from jetson_tq.kernels.prefill_plan import PrefillTuning, chunked_prefill
from jetson_tq.paged import PagedKV, slots_for_positions, write_slots
from tests.helpers.kernel_cases import DEVICE, fmt_for, fresh_seed, rel_err, vllm_block_table

pytestmark = pytest.mark.kernel

HKV, G, BS = 2, 2, 16
ON = PrefillTuning(reproducible=True)


class _Sequence:
    """One sequence of ``n`` tokens: exact Q/K/V and its compressed pages."""

    def __init__(self, name: str, d: int, n: int, ring: int, window: str, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.n, self.ring, self.block = n, ring, window == "block"
        self.fmt = fmt_for(name, d).with_(recent_tokens=ring, window=window)
        self.codec = KVCodec(self.fmt, d, raw_dtype=torch.float16)
        self.layout = PagedLayout(self.fmt, d, BS)
        self.table = vllm_block_table([n], BS, pad_blocks=2, gen=gen)
        pages = torch.zeros(int(self.table.max()) + 2, HKV, self.layout.page_bytes, dtype=torch.uint8)
        self.q = (torch.randn(n, HKV * G, d, generator=gen) * 3).half()
        self.k = (torch.randn(n, HKV, d, generator=gen) * 2).half()
        self.v = torch.randn(n, HKV, d, generator=gen).half()
        slots = slots_for_positions(self.table.long(), torch.arange(n).unsqueeze(0), BS)[0]
        write_slots(pages, self.layout, slots, self.codec.encode(self.k, self.v))  # vLLM writes chunks first
        self.pages = pages.to(DEVICE)

    def ring_count(self, s: int) -> int:
        """History tokens the ring holds before a chunk starting at s (vLLM's rule)."""
        return s % self.ring if self.block else min(s, self.ring)

    def call(self, starts: list[int], t: int, tuning: PrefillTuning = ON) -> torch.Tensor:
        """Outputs [len(starts), Hq, t, D] of chunks [s, s + t), one batch row each."""
        d, b = self.q.shape[-1], len(starts)
        rk = torch.zeros(b + 1, HKV, self.ring, d, dtype=torch.float16)
        rv = torch.zeros_like(rk)
        rec = [self.ring_count(s) for s in starts]
        for i, (s, r) in enumerate(zip(starts, rec)):
            for p in range(s - r, s):
                rk[i + 1, :, p % self.ring] = self.k[p]
                rv[i + 1, :, p % self.ring] = self.v[p]
        kv = PagedKV(
            self.pages,
            self.table.expand(b, -1).contiguous().to(DEVICE),
            torch.tensor([s - r for s, r in zip(starts, rec)], dtype=torch.int32, device=DEVICE),
            rk.to(DEVICE),
            rv.to(DEVICE),
            torch.tensor(rec, dtype=torch.int32, device=DEVICE),
            torch.arange(1, b + 1, dtype=torch.int32, device=DEVICE),
            self.layout,
            self.codec,
        )

        def rows(x: torch.Tensor) -> torch.Tensor:
            return torch.stack([x[s : s + t] for s in starts]).transpose(1, 2).contiguous().to(DEVICE)

        q, k, v = rows(self.q), rows(self.k), rows(self.v)
        out = chunked_prefill(q, k, v, kv, tuning=tuning)
        ref = paged_attention_prefill(q, k, v, kv)
        err = rel_err(out, ref)
        # fp16 operands: 2e-3 over a chunk's many rows; the error of one or two token rows alone scatters wider
        # (prod keys: 2.1-2.4e-3 on ~6 % of seeds, the same before and after 2026-12-04's changes)
        tol = 2e-3 if t * len(starts) >= 8 else 4e-3
        assert err <= tol, f"starts={starts} T={t} ({tuning}): rel err {err:.2e} against the reference"
        return out.cpu()

    def by_chunks(self, cuts: list[int]) -> torch.Tensor:
        """Outputs [Hq, n, D] of the whole sequence prefilled in chunks cut at ``cuts``."""
        edges = [0, *cuts, self.n]
        parts = [self.call([a], b - a)[0] for a, b in zip(edges[:-1], edges[1:]) if b > a]
        return torch.cat(parts, dim=1)


CASES = [("mse_k4v3", 64, 16, "block"), ("blog_k3v2", 64, 16, "sliding")]


@pytest.mark.parametrize("name,d,ring,window", CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
@pytest.mark.xfail(
    DEVICE.type == "cpu",
    reason="Triton's CPU interpreter on some hosts (an AVX2 AMD EPYC: every seed, on the commit CI passed on another "
    "host too): chunks cut inside a 16-token block move a few rows by 1 fp16 ulp; bitwise on the GPU is the claim",
    strict=False,
)
def test_rows_do_not_depend_on_chunking_or_batch(name, d, ring, window):
    seed = fresh_seed()
    seq = _Sequence(name, d, 80, ring, window, seed)
    whole = seq.by_chunks([])
    for cuts in ([37], [5, 64, 70]):  # chunks that start inside a block, on a tile edge, past the ring
        assert torch.equal(seq.by_chunks(cuts), whole), f"seed={seed} {name} {window}: chunking {cuts} changed rows"
    steps = [1, 16, 63, 79]  # decode steps: one new token at these positions, batched together and alone
    batched = seq.call(steps, 1)
    for i, p in enumerate(steps):
        alone = seq.call([p], 1)[0]
        assert torch.equal(batched[i], alone), f"seed={seed}: position {p} differs batched vs alone"
        assert torch.equal(alone[:, 0], whole[:, p]), f"seed={seed}: position {p} differs decode step vs prompt"


def test_prefill_caches_nothing_per_chunk_length(monkeypatch):
    """Ragged chunk lengths leave no per-shape buffer behind (the query transform's output is a transient tensor):
    the cause of the +16.5 GB GPU memory growth of the H200 load run."""
    from jetson_tq.kernels import _common

    monkeypatch.setattr(_common, "_WORKSPACES", {})
    seq = _Sequence("mse_k4v3", 64, 48, 16, "block", fresh_seed())
    for t in (3, 17, 30):
        seq.call([48 - t], t, PrefillTuning())
    assert _common.workspace_bytes() == 0
