"""The vLLM backend's impl against jetson-tq's standalone reference, with metadata laid out as vLLM 0.27 builds it.

No engine here: the impl is driven step by step like vLLM's model runner would (flattened tokens,
query_start_loc, block tables of arbitrary physical blocks, slot = block * block_size + offset,
decode rows first, chunked prefill), and each request's output is compared with
``attention_prefill`` / ``attention_decode`` over a ``CompressedKVCache`` holding the same tokens (both
keep every token compressed and the last R exactly; both read under the same window rule).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

import jetson_tq.integrations.vllm.impl as impl_mod
from jetson_tq import attention_decode, attention_prefill
from jetson_tq.cache.compressed import CompressedKVCache
from jetson_tq.codec.rotation import derive_seed
from jetson_tq.errors import UnsupportedModelError
from jetson_tq.format import FP16_FORMAT, KVFormat
from jetson_tq.integrations.vllm.impl import TurboQuantAttentionImpl
from jetson_tq.integrations.vllm.metadata import TurboQuantMetadata, device_ints
from jetson_tq.integrations.vllm.recent import RecentBufferLost, RecentSlots
from jetson_tq.paged import allocate_pages
from tests.helpers.vllm_steps import host_metadata, step_layout

HQ, HKV, D, BS, LAYER = 4, 2, 32, 16, 3


def _schedule():
    """Steps of (request, new tokens): chunked prefills, decodes first in each step, a late arrival."""
    return [
        [("A", 16), ("B", 5)],
        [("B", 1), ("A", 21), ("C", 12)],  # A's second chunk attends to its compressed + ring history
        [("A", 1), ("B", 1), ("C", 9)],
        [("A", 1), ("B", 1), ("C", 1), ("D", 30)],
        [("A", 1), ("C", 1), ("D", 1)],  # B not scheduled this step: its ring must survive
        [("A", 1), ("B", 1), ("C", 1), ("D", 1)],
    ]


HIT_STEP = [("A", 1), ("E", 10)]  # E arrives with a prefix-cache hit on A's first block (16 tokens)


def _run(
    fmt: KVFormat,
    dtype=torch.float32,
    seed: int = 0,
    hit: bool = False,
    reproducible: bool = False,
    key_transform=None,
    monkeypatch=None,
    ref_backend: str | None = None,
) -> float:
    g = torch.Generator().manual_seed(seed)
    impl = TurboQuantAttentionImpl(HQ, D, 1.0 / math.sqrt(D), HKV)
    step_md: dict = {}
    if key_transform is not None:  # klt keys: the layer's transform, and the step's metadata where vLLM keeps it
        import vllm.forward_context

        impl.layer_name = f"model.layers.{LAYER}.self_attn.attn"
        monkeypatch.setattr(impl_mod, "layer_key_transform", lambda index: key_transform)
        context = type("Context", (), {"attn_metadata": step_md})()
        monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)
    impl.reproducible = reproducible  # decode rows as one-token prefill chunks (the reproducible mode's route)
    impl.set_format(fmt, LAYER, BS, dtype)
    impl.allocate_recent(4, torch.device("cpu"), dtype)
    pages = allocate_pages(impl.layout, 64, HKV)
    # Physical blocks handed out in a scrambled order, as vLLM's free-block queue does after some traffic.
    free = list(np.random.default_rng(seed).permutation(64))
    tables: dict[str, list[int]] = {}
    lens: dict[str, int] = {}
    slots = RecentSlots(4)
    ref_fmt = fmt
    refs = {}

    def ref_cache() -> CompressedKVCache:
        """The standalone cache a request is compared with (same format, seed, block size and key transform)."""
        seed = derive_seed(fmt.seed, LAYER)
        return CompressedKVCache(ref_fmt, HKV, D, 1, dtype=dtype, seed=seed, block_size=BS, key_transform=key_transform)

    seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # (k, v) [H, T, D] chunks per request
    worst = 0.0
    for step in _schedule() + ([HIT_STEP] if hit else []):
        if hit and "E" in dict(step):  # vLLM hands E A's cached first block: E starts at position BS
            tables["E"], lens["E"] = [tables["A"][0]], BS
            ka, va = (torch.cat(x, dim=1)[:, :BS] for x in zip(*seen["A"]))
            refs["E"] = ref_cache()
            refs["E"].append(ka.unsqueeze(0), va.unsqueeze(0))
        reqs = [r for r, _ in step]
        q_lens = np.array([n for _, n in step])
        ctx = np.array([lens.get(r, 0) for r in reqs])
        seq = ctx + q_lens
        block_table, slot_mapping, qsl = step_layout(reqs, q_lens, ctx, tables, free, BS)
        n_tok = int(qsl[-1])
        q = torch.randn(n_tok, HQ, D, generator=g).to(dtype)
        k = torch.randn(n_tok, HKV, D, generator=g).to(dtype)
        v = torch.randn(n_tok, HKV, D, generator=g).to(dtype)
        live = set(tables)
        block = fmt.block_window
        rows = (
            slots.assign(reqs, ctx, q_lens, live, fmt.recent_tokens if block else 0)
            if fmt.recent_tokens
            else np.full(len(reqs), 4)
        )
        nd = int(np.argmin(q_lens <= 1)) if not (q_lens <= 1).all() else len(reqs)
        dec_positions = torch.from_numpy(np.pad(seq[:nd] - 1, (0, 4)))  # as the builder fills its buffer
        md = host_metadata(fmt, q_lens, ctx, rows, block_table, slot_mapping, dec_positions)
        out = torch.empty(n_tok, HQ, D, dtype=dtype)
        step_md.clear()
        step_md[impl.layer_name] = md
        impl.do_kv_cache_update(None, k, v, pages, slot_mapping)
        impl.forward(None, q, k, v, pages, md, out)
        for i, r in enumerate(reqs):
            a, b = int(qsl[i]), int(qsl[i + 1])
            cache = refs.get(r) or ref_cache()
            refs[r] = cache
            kk, vv, qq = k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), q[a:b].transpose(0, 1)
            seen.setdefault(r, []).append((kk, vv))
            if i < nd:
                cache.append(kk.unsqueeze(0), vv.unsqueeze(0))
                want = attention_decode(qq[:, 0].unsqueeze(0), cache, 1.0 / math.sqrt(D), ref_backend)[0]
                got = out[a]
            else:
                want = attention_prefill(
                    qq.unsqueeze(0), kk.unsqueeze(0), vv.unsqueeze(0), cache, 1.0 / math.sqrt(D), ref_backend
                )[0]
                got = out[a:b].transpose(0, 1)
            worst = max(worst, float((got.float() - want.float()).abs().max()))
            lens[r] = int(seq[i])
    return worst


@pytest.mark.parametrize(
    "fmt",
    [
        KVFormat(key_mode="prod", key_bits=3, value_bits=2, value_group=32, recent_tokens=8),  # blog_k3v2, 8-token ring
        KVFormat(key_mode="prod", key_bits=4, value_bits=4, value_group=32, recent_tokens=0),  # no ring at all
        KVFormat(key_mode="mse", key_bits=3, recent_tokens=20),
        FP16_FORMAT,
    ],
    ids=["k3v2-r8", "k4v4-r0", "mse3-r20", "fp16"],
)
def test_impl_matches_standalone_reference(fmt):
    assert _run(fmt) < 2e-5


@pytest.mark.parametrize("sink", [False, True], ids=["coded", "calibrated-sink"])
def test_klt_keys_are_placed_at_their_positions(monkeypatch, sink):
    """klt keys: every write is coded at its token's position from the step's metadata (chunked prefill, decode rows,
    a prefix hit), so the impl matches the standalone cache; with a calibrated sink, position 0 reads it in both."""
    from jetson_tq.codec.klt import spread_transform
    from tests.helpers.klt_cases import with_sink

    fmt = KVFormat(key_mode="klt", key_code_bytes=52, value_mode="mse", value_bits=3, recent_tokens=8, window="block")
    transform = spread_transform(HKV, D, fmt.key_code_bits(D))
    if sink:
        transform = with_sink(transform, torch.Generator().manual_seed(2))
    assert _run(fmt, hit=True, key_transform=transform, monkeypatch=monkeypatch) < 2e-5


# ~40 CPU-s a case in the interpreter: the full lane. The quick one keeps the impl's klt placement on the reference
# path (above), the klt kernels (tests/kernels/test_kernels_klt*.py) and a model on them (test_klt_cache.py).
@pytest.mark.slow
@pytest.mark.kernel
@pytest.mark.parametrize("sink", [False, True], ids=["coded", "calibrated-sink"])
def test_klt_impl_on_the_kernels_matches_the_reference(monkeypatch, sink):
    """The 5x preset's format (klt keys, mse values, block window) through the impl on the Triton kernels (CPU
    interpreter): writes coded at the step's positions (chunked prefill, decode rows from the builder's buffer, a
    prefix hit) read back like the standalone cache on the reference path, with or without a calibrated sink."""
    from jetson_tq.ops import backend as ops_backend
    from tests.helpers.kernel_cases import DEVICE
    from tests.helpers.klt_cases import uneven_transform, with_sink

    if DEVICE.type == "cuda":  # _run drives the impl with CPU tensors
        pytest.skip("interpreter only: on CUDA benchmarks/vllm_gpu/real_weights.py checks this path inside the engine")
    monkeypatch.setenv("JETSON_TQ_BACKEND", "triton")
    ops_backend.configured.cache_clear()
    fmt = KVFormat(key_mode="klt", key_code_bytes=52, value_mode="mse", value_bits=3, recent_tokens=8, window="block")
    transform = uneven_transform(HKV, D, fmt.key_code_bits(D), D, 1.0, torch.Generator().manual_seed(1))
    if sink:
        transform = with_sink(transform, torch.Generator().manual_seed(2))
    try:
        err = _run(fmt, hit=True, key_transform=transform, monkeypatch=monkeypatch, ref_backend="reference")
    finally:
        monkeypatch.delenv("JETSON_TQ_BACKEND")
        ops_backend.configured.cache_clear()
    assert err < 2e-2


@pytest.mark.parametrize("ring", [8, 16])
def test_block_window_impl_matches_reference_with_a_prefix_hit(ring):
    """``window: block`` (R divides the 16-token vLLM block): chunked prefill straddling block boundaries, decode
    rows, and a request that starts at position 16 on another request's cached block with an empty ring."""
    assert _run(KVFormat(recent_tokens=ring, window="block"), hit=True) < 2e-5


@pytest.mark.parametrize("fmt", [KVFormat(recent_tokens=8), KVFormat(recent_tokens=8, window="block")])
def test_reproducible_mode_decode_rows_match_the_reference(fmt):
    """The reproducible mode serves decode rows with the prefill path (one-token chunks in one call, the ring
    filled after attention): the same attention as the decode path, sliding and block windows, with a prefix hit."""
    assert _run(fmt, reproducible=True, hit=fmt.block_window) < 2e-5


def test_impl_bf16_model():
    assert _run(KVFormat(recent_tokens=8), dtype=torch.bfloat16) < 2e-2


def test_recent_slots_refuse_unvouched_history():
    slots = RecentSlots(2)
    rows = slots.assign(["a", "b"], np.array([0, 0]), np.array([5, 3]), {"a", "b"})
    assert sorted(rows.tolist()) == [0, 1]
    assert slots.assign(["a", "b"], np.array([0, 0]), np.array([5, 3]), {"a", "b"}).tolist() == rows.tolist()
    with pytest.raises(RecentBufferLost, match="holds positions up to 5"):
        slots.assign(["a"], np.array([7]), np.array([1]), {"a", "b"})
    with pytest.raises(RecentBufferLost, match="no recent buffer"):
        slots.assign(["z"], np.array([4]), np.array([1]), {"a", "b", "z"})
    # a finished request's row is reused; padding rows (no request / no tokens) go to the scratch row
    rows = slots.assign(["c", None], np.array([0, 0]), np.array([2, 0]), {"b", "c"})
    assert rows[1] == slots.scratch and rows[0] in (0, 1)
    # block windows of 8: a step may start at any multiple of 8 with an empty ring (prefix-cache hit, recompute)
    assert slots.assign(["d"], np.array([16]), np.array([3]), {"c", "d"}, window_block=8)[0] in (0, 1)
    assert slots.assign(["d"], np.array([8]), np.array([3]), {"c", "d"}, window_block=8)[0] in (0, 1)
    with pytest.raises(RecentBufferLost, match="multiples of 8"):
        slots.assign(["e"], np.array([12]), np.array([1]), {"c", "d", "e"}, window_block=8)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"alibi_slopes": [1.0] * HQ}, "alibi_slopes"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
        ({"attn_type": "encoder_only"}, "attn_type"),
    ],
)
def test_impl_refuses_unsupported_attention(kwargs, word):
    with pytest.raises(UnsupportedModelError, match=word):
        TurboQuantAttentionImpl(HQ, D, 1.0, HKV, **kwargs)


@pytest.mark.parametrize("width", [32, 19], ids=["aligned-rows", "unaligned-rows"])
def test_warm_up_touches_only_the_null_block_and_the_scratch_row(width):
    """The engine-start warm-up (so Triton compiles before the first request) writes vLLM's null block 0 and the
    scratch ring row, nothing a request owns, also where it runs a chunk as a step's second request (a block table
    whose width is not a multiple of 4); the layer's real path runs, so a broken path fails here."""
    from jetson_tq.integrations.vllm.warmup import bound_cache, warm_up

    fmt = KVFormat()
    impl = TurboQuantAttentionImpl(HQ, D, 1.0 / math.sqrt(D), HKV)
    impl.set_format(fmt, LAYER, BS, torch.float32)
    with torch.inference_mode():  # as vLLM allocates them (H200 call 9: the warm-up's writes were refused)
        impl.allocate_recent(3, torch.device("cpu"), torch.float32)
        pages = allocate_pages(impl.layout, 8, HKV)
        pages.random_(0, 0x7C, generator=torch.Generator().manual_seed(0))
    before, ring_before = pages.clone(), impl.recent_k.clone()
    calls = []
    ops = impl_mod.ops
    prefill, decode = ops.prefill, ops.decode

    def logged_prefill(q, k, v, kv, scale, **kw):
        calls.append(("prefill", int(kv.compressed_lens[0])))
        return prefill(q, k, v, kv, scale, **kw)

    def logged_decode(q, kv, scale, **kw):
        calls.append(("decode", q.shape[0]))
        return decode(q, kv, scale, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "prefill", logged_prefill)
        mp.setattr(ops, "decode", logged_decode)
        warm_up(impl, pages, max_rows=5, table_width=width, budget=64)
    assert ("prefill", 0) in calls and any(k == "prefill" and n > 0 for k, n in calls), "with and without history"
    assert {n for k, n in calls if k == "decode"} == {1, 2, 3, 4, 5}, "every decode row count up to max_rows"
    assert not torch.equal(pages[0], before[0]), "the warm-up must run the write path (block 0)"
    assert torch.equal(pages[1:], before[1:]), "blocks other than the null block 0 must stay untouched"
    assert torch.equal(impl.recent_k[:-1], ring_before[:-1]), "only the scratch ring row may change"

    class Layer:
        kv_cache = [pages]

    assert bound_cache(Layer()) is pages
    Layer.kv_cache = torch.zeros(0)
    assert bound_cache(Layer()) is None
    assert hash((fmt, HQ)) == hash((KVFormat(), HQ)), "warm-up dedupes formats by value"


def test_device_ints_once_per_step_and_aligned():
    """The eager path's index arrays reach the device once per step (memoized on the metadata) with every part and
    every per-row scalar 16-byte aligned (the kernels are specialized on pointer alignment)."""
    md = TurboQuantMetadata(
        num_actual_tokens=3,
        num_reqs=3,
        num_decodes=0,
        recent_tokens=16,
        query_start_loc=np.arange(4),
        seq_lens=np.ones(3, np.int64),
        context_lens=np.zeros(3, np.int64),
        ring_rows=np.arange(3),
        block_table=torch.zeros(3, 1, dtype=torch.int32),
        slot_mapping=torch.zeros(3, dtype=torch.int64),
        dec_ring_rows=torch.zeros(0, dtype=torch.int64),
        dec_ring_cols=torch.zeros(0, dtype=torch.int64),
        dec_compressed_lens=torch.zeros(0, dtype=torch.int32),
        dec_recent_lens=torch.zeros(0, dtype=torch.int32),
    )
    dev = torch.device("cpu")
    a, b = [5, 6, 7], [1, 2, 3]
    vec = device_ints(md, "v", dev, (a, torch.int64), (b, torch.int32), (a, torch.int64))
    assert [x.tolist() for x in vec] == [a, b, a] and [x.dtype for x in vec] == [torch.int64, torch.int32, torch.int64]
    assert all(x.data_ptr() % 16 == 0 for x in vec)
    assert device_ints(md, "v", dev) is vec  # the step's later layers reuse the copies
    rows = device_ints(md, "r", dev, (b, torch.int32), (a, torch.int64), per_row=True)
    for x, want in zip(rows, (b, a)):
        for j, w in enumerate(want):
            assert x[j, :1].tolist() == [w] and x[j, :1].data_ptr() % 16 == 0


def test_prefill_varlen_by_chunk_work(monkeypatch):
    """FlashAttention serves a chunk once history + chunk reach FLASH_MIN_TOKENS; shorter ones stay on the Triton loop
    (the measured crossover), and nothing without vLLM's FlashAttention (this CPU machine)."""
    from jetson_tq.integrations.vllm import flash

    assert flash.prefill_varlen(10**6, 10**4) is None  # no CUDA here: vllm_varlen() is None
    sentinel = object()
    monkeypatch.setattr(flash, "vllm_varlen", lambda: sentinel)
    n = flash.FLASH_MIN_TOKENS
    assert flash.prefill_varlen(0, n) is sentinel and flash.prefill_varlen(n - 2048, 2048) is sentinel
    assert flash.prefill_varlen(0, n - 1) is None and flash.prefill_varlen(2048, 2048) is None
    varlen, on = flash.flash_rows(np.array([0, n - 2048, 2048]), np.array([n, 2048, 2048]))  # a step's rows at once
    assert varlen is sentinel and on.tolist() == [True, True, False]


def test_flash_min_tokens_reads_the_environment(monkeypatch):
    """``JETSON_TQ_FLASH_MIN_TOKENS`` moves the threshold (read once per process); a bad value is a named error."""
    from jetson_tq.errors import ConfigError
    from jetson_tq.integrations.vllm import flash

    for raw, want in ((None, flash.FLASH_MIN_TOKENS), ("4096", 4096), ("0", 0)):
        if raw is None:
            monkeypatch.delenv("JETSON_TQ_FLASH_MIN_TOKENS", raising=False)
        else:
            monkeypatch.setenv("JETSON_TQ_FLASH_MIN_TOKENS", raw)
        flash.flash_min_tokens.cache_clear()
        assert flash.flash_min_tokens() == want
    monkeypatch.setenv("JETSON_TQ_FLASH_MIN_TOKENS", "16k")
    flash.flash_min_tokens.cache_clear()
    with pytest.raises(ConfigError, match="JETSON_TQ_FLASH_MIN_TOKENS"):
        flash.flash_min_tokens()
    flash.flash_min_tokens.cache_clear()


def test_vllm_varlen_hands_flash_attention_its_own_argument_order(monkeypatch):
    """The FlashAttention call (``VarlenAttention``'s order: cu_seqlens_q before max_seqlen_q) reaches vLLM's
    ``flash_attn_varlen_func`` in its order (max_seqlen_q first), with the paged keywords, lse and the version vLLM
    names; stand-ins for the CUDA-only modules let it run here."""
    import sys
    import types

    from jetson_tq.integrations.vllm import flash

    seen: dict = {}

    def flash_attn_varlen_func(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        return "out", "lse"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fa = types.ModuleType("vllm.vllm_flash_attn")
    fa.flash_attn_varlen_func = flash_attn_varlen_func
    utils = types.ModuleType("vllm.v1.attention.backends.fa_utils")
    utils.get_flash_attn_version = lambda: 3
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", fa)
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.fa_utils", utils)
    varlen = flash.vllm_varlen.__wrapped__()  # past the process cache
    assert varlen is not None
    assert varlen("q", "k", "v", "cu_q", 7, 9, 0.5, True, seqused_k="used", block_table="table") == ("out", "lse")
    assert seen["args"] == ("q", "k", "v", 7, "cu_q", 9)
    assert seen["kwargs"] == dict(
        softmax_scale=0.5, causal=True, return_softmax_lse=True, fa_version=3, seqused_k="used", block_table="table"
    )
