"""Speculative decoding through the vLLM backend's impl: verification rows, rejected drafts, the exact window.

No engine here (``test_vllm_spec_engine.py`` runs vLLM's n-gram speculation): the impl is driven the way vLLM's
model runner drives it under speculative decoding. A verification row holds the last sampled token and its k draft
tokens (T = 1 + k, causal inside the row); the sampler accepts a prefix of them, and vLLM's next step for that
request starts right after the last accepted token, writing the rejected positions again (same slots, other
tokens). Each row's output is compared with ``attention_prefill`` / ``attention_decode`` over a standalone
``CompressedKVCache`` holding only the accepted tokens: what the plain (non-speculative) run attends to.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from jetson_tq import attention_decode, attention_prefill
from jetson_tq.cache.compressed import CompressedKVCache
from jetson_tq.codec.rotation import derive_seed
from jetson_tq.errors import ConfigError
from jetson_tq.format import KVFormat
from jetson_tq.integrations.vllm.impl import TurboQuantAttentionImpl
from jetson_tq.integrations.vllm.metadata import decode_arrays, decode_rows
from jetson_tq.integrations.vllm.recent import RecentBufferLost, RecentSlots, Rewind
from jetson_tq.integrations.vllm.warmup import warm_up
from tests.helpers.vllm_steps import host_metadata, step_layout

HQ, HKV, D, BS, LAYER = 4, 2, 32, 16, 3
SCALE = 1.0 / math.sqrt(D)
SPEC_TOKENS = 4  # the last sampled token and up to 3 drafts

#: steps of (request, tokens written, tokens accepted): a prompt, then verification rows with rejections. With a
#: 16-token ring block, A's row at 29 (4 tokens: 29..32) crosses the block boundary at 32 and keeps only 29, 30:
#: the next step's query at 31 reads block [16, 32) exactly, whose column 0 the rejected 32 overwrote.
SCHEDULE = [
    [("A", 27, 27), ("B", 9, 9)],
    [("A", 2, 2), ("B", 4, 2)],  # B rejects 2 of its 3 drafts
    [("A", 4, 2), ("B", 4, 4)],  # A: 29..32 written, 29, 30 kept (the crossing)
    [("A", 3, 1), ("B", 1, 1)],  # A: 31..33 written, 31 kept; B: a step without drafts
    [("A", 1, 1), ("B", 4, 1)],  # B rejects every draft
    [("B", 4, 3), ("A", 4, 4)],
    [("A", 2, 2), ("B", 1, 1)],
]


def _reference(fmt: KVFormat, k: torch.Tensor, v: torch.Tensor) -> CompressedKVCache:
    """A standalone cache (same format, seed, block size) holding k, v [H, L, D] (the accepted history)."""
    cache = CompressedKVCache(fmt, HKV, D, 1, dtype=k.dtype, seed=derive_seed(fmt.seed, LAYER), block_size=BS)
    if k.shape[1]:
        cache.append(k.unsqueeze(0), v.unsqueeze(0))
    return cache


def _run(
    fmt: KVFormat,
    schedule=SCHEDULE,
    undo: bool = True,
    seed: int = 0,
    ref_backend: str | None = None,
    as_decode: bool = False,
) -> float:
    """Drive the impl through ``schedule``; the largest output difference against the accepted-history reference.
    ``as_decode``: the builder routes a leading run of uniform verification rows to the multi-token decode path
    (what it does when speculative decoding is on; the other rows of the step stay chunks)."""
    g = torch.Generator().manual_seed(seed)
    impl = TurboQuantAttentionImpl(HQ, D, SCALE, HKV)
    impl.set_format(fmt, LAYER, BS, torch.float32)
    impl.set_undo_tokens(SPEC_TOKENS if undo else 0)
    impl.allocate_recent(4, torch.device("cpu"), torch.float32)
    pages = torch.zeros(64, HKV, impl.layout.page_bytes, dtype=torch.uint8)
    free = list(np.random.default_rng(seed).permutation(64))
    tables: dict[str, list[int]] = {}
    lens: dict[str, int] = {}
    history: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # accepted k, v [H, L, D]
    slots = RecentSlots(4)
    worst = 0.0
    routed: list[int] = []  # tokens of each step the decode path served as verification rows
    for step in schedule:
        reqs = [r for r, _, _ in step]
        q_lens = np.array([t for _, t, _ in step])
        ctx = np.array([lens.get(r, 0) for r in reqs])
        block_table, slot_mapping, qsl = step_layout(reqs, q_lens, ctx, tables, free, BS)
        n_tok = int(qsl[-1])
        q, k, v = (torch.randn(n_tok, h, D, generator=g) for h in (HQ, HKV, HKV))
        block = fmt.block_window
        rows = slots.assign(reqs, ctx, q_lens, set(tables), fmt.recent_tokens if block else 0, SPEC_TOKENS)
        if slots.rewinds:  # what the metadata builder does before the step's forward
            cols = [rw.columns(fmt.recent_tokens) for rw in slots.rewinds]
            idx = [[rw.row] * len(c[0]) for rw, c in zip(slots.rewinds, cols)]
            impl.rewind_ring(*(torch.tensor(sum(x, [])) for x in (idx, [c[0] for c in cols], [c[1] for c in cols])))
        md = host_metadata(
            fmt, q_lens, ctx, rows, block_table, slot_mapping, spec_tokens=SPEC_TOKENS if as_decode else 0
        )
        routed.append(md.dec_query_tokens * md.num_decodes)
        out = torch.empty(n_tok, HQ, D)
        impl.do_kv_cache_update(None, k, v, pages, slot_mapping)
        impl.forward(None, q, k, v, pages, md, out)
        for i, (r, t, kept) in enumerate(step):
            a, b = int(qsl[i]), int(qsl[i + 1])
            kk, vv, qq = k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), q[a:b].transpose(0, 1)
            hk, hv = history.get(r, (kk[:, :0], vv[:, :0]))
            if t == 1:
                cache = _reference(fmt, torch.cat([hk, kk], 1), torch.cat([hv, vv], 1))
                want = attention_decode(qq[:, 0].unsqueeze(0), cache, SCALE, ref_backend)[0]
                got = out[a]
            else:
                cache = _reference(fmt, hk, hv)
                want = attention_prefill(qq.unsqueeze(0), kk.unsqueeze(0), vv.unsqueeze(0), cache, SCALE, ref_backend)[
                    0
                ]
                got = out[a:b].transpose(0, 1)
            worst = max(worst, float((got - want).abs().max()))
            history[r] = (torch.cat([hk, kk[:, :kept]], 1), torch.cat([hv, vv[:, :kept]], 1))
            lens[r] = int(ctx[i]) + kept
    if as_decode:  # the schedule's uniform steps (and mixed ones' leading rows) went to the decode path
        assert sum(n for n in routed if n > 1) >= 8, routed
    return worst


FORMATS = [
    KVFormat(recent_tokens=16, window="block"),  # the default window: a draft crosses a ring block
    KVFormat(recent_tokens=8, window="sliding"),  # every rejection overwrote columns still in the window
    KVFormat(key_mode="prod", key_bits=3, value_bits=2, value_group=32, recent_tokens=16, window="block"),
]


@pytest.mark.parametrize("fmt", FORMATS, ids=["mse-block16", "mse-sliding8", "prod-k3v2-block16"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verification_rows_and_rejections_read_the_accepted_history(fmt, seed):
    assert _run(fmt, seed=seed) < 2e-5


@pytest.mark.slow  # ~30 CPU-s in the interpreter; the quick lane keeps the multi-token decode kernel's tests
@pytest.mark.kernel
def test_verification_rows_on_the_kernels_match_the_reference(monkeypatch):
    """The same schedule with the impl on the Triton kernels (CPU interpreter): verification rows of one length in one
    batched prefill launch, one-token rows through the decode kernel, against the reference path."""
    from jetson_tq.ops import backend as ops_backend
    from tests.helpers.kernel_cases import DEVICE

    if DEVICE.type == "cuda":  # _run drives the impl with CPU tensors
        pytest.skip("interpreter only: on CUDA benchmarks/vllm_gpu/spec_decode.py runs this path inside the engine")
    monkeypatch.setenv("JETSON_TQ_BACKEND", "triton")
    ops_backend.configured.cache_clear()
    try:
        err = _run(FORMATS[0], ref_backend="reference")
    finally:
        monkeypatch.delenv("JETSON_TQ_BACKEND")
        ops_backend.configured.cache_clear()
    assert err < 2e-2


@pytest.mark.parametrize("fmt", FORMATS, ids=["mse-block16", "mse-sliding8", "prod-k3v2-block16"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_uniform_verification_rows_on_the_decode_path_read_the_accepted_history(fmt, seed):
    """The same schedule with uniform leading verification rows routed to the multi-token decode (the path CUDA graphs
    capture), mixed steps' other rows as chunks: the same outputs, rejections and ring block crossings included."""
    assert _run(fmt, seed=seed, as_decode=True) < 2e-5


# ~45 CPU-s in the interpreter: the full lane. The quick one keeps the routing on the reference path (above), the
# multi-token decode kernel (tests/kernels/test_decode_multitoken.py) and the verification rows on the kernels as
# chunks.
@pytest.mark.slow
@pytest.mark.kernel
def test_decode_routed_verification_rows_on_the_kernels_match_the_reference(monkeypatch):
    """The decode-routed schedule on the Triton kernels (CPU interpreter): the multi-token decode kernel serves the
    verification rows."""
    from jetson_tq.ops import backend as ops_backend
    from tests.helpers.kernel_cases import DEVICE

    if DEVICE.type == "cuda":  # _run drives the impl with CPU tensors
        pytest.skip("interpreter only: on CUDA benchmarks/vllm_gpu/spec_decode.py runs this path inside the engine")
    monkeypatch.setenv("JETSON_TQ_BACKEND", "triton")
    ops_backend.configured.cache_clear()
    try:
        err = _run(FORMATS[1], ref_backend="reference", as_decode=True)
    finally:
        monkeypatch.delenv("JETSON_TQ_BACKEND")
        ops_backend.configured.cache_clear()
    assert err < 2e-2


def test_builder_routes_uniform_verification_rows_to_decode():
    """``decode_rows``: one-token rows, or a leading run of verification rows of one length 2..1 + k; longer rows,
    and rows after the run that differ, are chunks."""
    assert decode_rows(np.array([1, 1, 1]), 4) == (3, 1)
    assert decode_rows(np.array([4, 4, 4]), 4) == (3, 4)
    assert decode_rows(np.array([3, 3, 2, 40]), 4) == (2, 3)  # a mixed step: the uniform head only
    assert decode_rows(np.array([1, 1, 4, 4]), 4) == (2, 1)
    assert decode_rows(np.array([4, 4]), 0) == (0, 1)  # no speculative decoding: chunks
    assert decode_rows(np.array([5, 5]), 4) == (0, 1)  # longer than 1 + k: a prompt chunk
    assert decode_rows(np.array([], dtype=np.int64), 4) == (0, 1)
    dec = decode_arrays(np.array([3, 3, 9]), np.array([20, 35, 9]), np.array([5, 6, 7]), 16, True, 4)
    assert (dec.rows, dec.tokens) == (2, 3)
    assert dec.compressed.tolist() == [16, 32] and dec.recent.tolist() == [1, 0]  # block history: s % R in the ring
    assert dec.positions.tolist() == [17, 18, 19, 32, 33, 34] and dec.token_cols.tolist() == [[1, 2, 3], [0, 1, 2]]


@pytest.mark.parametrize("fmt", FORMATS[:2], ids=["mse-block16", "mse-sliding8"])
def test_without_the_undo_pool_rejections_corrupt_the_window(fmt):
    """The check above sees the bug it guards against: with no undo pool (rewinds change nothing), rejected drafts
    stay in the ring."""
    assert _run(fmt, undo=False) > 1e-2


def test_recent_slots_rewind_rejected_drafts():
    slots = RecentSlots(2)
    row = slots.assign(["a"], np.array([0]), np.array([10]), {"a"}, undo_tokens=4)[0]
    assert slots.assign(["a"], np.array([10]), np.array([4]), {"a"}, undo_tokens=4)[0] == row and not slots.rewinds
    # 10..13 written, 10, 11 accepted: the next step starts at 12 and puts back what 12, 13 overwrote
    slots.assign(["a"], np.array([12]), np.array([3]), {"a"}, undo_tokens=4)
    assert slots.rewinds == [Rewind(int(row), 10, 12, 14)]
    assert Rewind(int(row), 10, 12, 14).columns(8) == ([4, 5], [2, 3])
    slots.assign(["a"], np.array([12]), np.array([3]), {"a"}, undo_tokens=4)  # another builder, same step
    assert slots.rewinds == [Rewind(int(row), 10, 12, 14)]
    slots.assign(["a"], np.array([15]), np.array([1]), {"a"}, undo_tokens=4)  # all of 12..14 accepted
    assert slots.rewinds == []
    # a step may not start inside a longer one (a prompt chunk is never rejected), nor without an undo pool
    slots.assign(["b"], np.array([0]), np.array([9]), {"a", "b"}, undo_tokens=4)
    with pytest.raises(RecentBufferLost, match="holds positions up to 9"):
        slots.assign(["b"], np.array([5]), np.array([1]), {"a", "b"}, undo_tokens=4)
    slots.assign(["a"], np.array([16]), np.array([3]), {"a"})
    with pytest.raises(RecentBufferLost, match="holds positions up to 19"):
        slots.assign(["a"], np.array([17]), np.array([1]), {"a"})


def test_more_speculative_tokens_than_the_exact_window_is_a_config_error():
    impl = TurboQuantAttentionImpl(HQ, D, SCALE, HKV)
    impl.set_format(KVFormat(recent_tokens=8), LAYER, BS, torch.float32)
    with pytest.raises(ConfigError, match="verifies up to 9 tokens per step, more than the exact window of 8"):
        impl.set_undo_tokens(9)


def test_warm_up_covers_verification_rows_on_the_null_block_and_scratch_row(monkeypatch):
    """With speculative decoding the warm-up also launches batches of verification rows of every length (so their
    kernels compile at start-up), writing only vLLM's null block and the scratch ring row."""
    impl = TurboQuantAttentionImpl(HQ, D, SCALE, HKV)
    impl.set_format(KVFormat(recent_tokens=16, window="block"), LAYER, BS, torch.float32)
    impl.set_undo_tokens(SPEC_TOKENS)
    impl.allocate_recent(3, torch.device("cpu"), torch.float32)
    pages = torch.zeros(8, HKV, impl.layout.page_bytes, dtype=torch.uint8)
    launched: list[tuple[int, int]] = []
    forward_rows = impl._forward_rows

    def spy(query, key, value, kv_cache, md, output, sel, t):
        launched.append((len(sel), t))
        return forward_rows(query, key, value, kv_cache, md, output, sel, t)

    monkeypatch.setattr(impl, "_forward_rows", spy)
    warm_up(impl, pages, max_rows=3, max_len=96, budget=32)
    assert sorted(launched) == sorted((rows, t) for t in range(2, SPEC_TOKENS + 1) for rows in range(1, 4))
    assert not pages[1:].any() and not impl.recent_k[:3].any() and not impl.undo_k[:3].any()
