"""Sinks, logit soft cap and sliding window (``attention.extras``) in the PyTorch reference.

The exact (fp16 passthrough) format must equal a plain fp32 dense attention with the same extras up to rounding, in
decode and in prefill at any chunking; compressed formats must give the same result at any chunking (a token's
treatment does not depend on how it arrived) and never read a position before the window start.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from jetson_tq import FP16_FORMAT, CompressedKVCache, KVFormat
from jetson_tq.attention.extras import NO_EXTRAS, AttentionExtras
from jetson_tq.errors import ShapeError
from jetson_tq.ops import decode, prefill


def dense_attention(q, k, v, qpos, scale, extras: AttentionExtras):
    """fp32 attention of q [B, Hq, T, D] at positions qpos [T] over k, v [B, Hkv, N, D] (positions 0..N-1): causal,
    soft cap on the scaled score, keys in [p - W + 1, p], the sink logit in the denominator only."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = (q.float() @ kk.transpose(-1, -2)) * scale
    if extras.soft_cap is not None:
        s = extras.soft_cap * torch.tanh(s / extras.soft_cap)
    kpos = torch.arange(k.shape[2])
    ok = kpos[None, :] <= qpos[:, None]
    if extras.sliding_window is not None:
        ok &= kpos[None, :] > qpos[:, None] - extras.sliding_window
    s = s.masked_fill(~ok, float("-inf"))
    if extras.sinks is not None:
        sink = extras.sinks.float().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    return p @ vv


def random_extras(hq: int, kind: str, gen: torch.Generator) -> AttentionExtras:
    sinks = torch.randn(hq, generator=gen) * 2 if kind in ("sinks", "all") else None
    cap = 5.0 + 20 * float(torch.rand((), generator=gen)) if kind in ("cap", "all") else None
    window = int(torch.randint(3, 40, (), generator=gen)) if kind in ("window", "all") else None
    return AttentionExtras(sinks=sinks, soft_cap=cap, sliding_window=window)


def run_chunks(fmt, q, k, v, chunks, extras, hkv):
    """Prefill q, k, v [B, H, N, D] chunk by chunk through ``ops.prefill`` over a cache (the reference path)."""
    cache = CompressedKVCache(fmt, hkv, q.shape[-1], batch_size=q.shape[0], dtype=torch.float32, block_size=16)
    outs, s = [], 0
    for c in chunks:
        qc, kc, vc = (x[:, :, s : s + c] for x in (q, k, v))
        cache.stage(kc, vc)
        outs.append(prefill(qc, kc, vc, cache.paged(), backend="reference", extras=extras))
        cache.commit(kc, vc)
        s += c
    return torch.cat(outs, dim=2)


def run_decode(fmt, q, k, v, extras, hkv):
    """Decode one token at a time (append, then attend) -> [B, Hq, N, D]."""
    cache = CompressedKVCache(fmt, hkv, q.shape[-1], batch_size=q.shape[0], dtype=torch.float32, block_size=16)
    outs = []
    for t in range(q.shape[2]):
        cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        outs.append(decode(q[:, :, t], cache.paged(), backend="reference", extras=extras))
    return torch.stack(outs, dim=2)


CASES = [  # (head dim, query heads, KV heads, chunks)
    (64, 4, 2, [23, 1, 16]),
    (128, 8, 1, [40]),
    (80, 3, 3, [5, 17, 18]),
    (64, 6, 2, [1] * 4 + [36]),
]


@pytest.mark.parametrize("kind", ["sinks", "cap", "window", "all"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}-{c[1]}x{c[2]}")
@pytest.mark.parametrize("seed", [0, 1])
def test_exact_format_equals_dense_attention(case, kind, seed):
    d, hq, hkv, chunks = case
    gen = torch.Generator().manual_seed(seed)
    n = sum(chunks)
    q = torch.randn(2, hq, n, d, generator=gen)
    k, v = torch.randn(2, hkv, n, d, generator=gen), torch.randn(2, hkv, n, d, generator=gen)
    extras = random_extras(hq, kind, gen)
    k16, v16 = k.half().float(), v.half().float()  # the passthrough format stores fp16
    want = dense_attention(q, k16, v16, torch.arange(n), 1 / math.sqrt(d), extras)
    got = run_chunks(FP16_FORMAT, q, k, v, chunks, extras, hkv)
    assert (got - want).abs().max() < 1e-5, f"seed={seed} {extras}"
    if seed == 0:  # decode one token at a time (the slow path) on one seed of each case
        got_dec = run_decode(FP16_FORMAT, q, k, v, extras, hkv)
        assert (got_dec - want).abs().max() < 1e-5, f"seed={seed} {extras}"


@pytest.mark.parametrize("window", ["sliding", "block"])
# inside, equal to and beyond the exact window R = 16; 11-14 s each on 2 cores: --quick keeps the window of 16
@pytest.mark.parametrize("w", [pytest.param(5, marks=pytest.mark.slow), 16, pytest.param(40, marks=pytest.mark.slow)])
def test_compressed_prefill_equals_decode_at_any_chunking(window, w, seed=0):
    gen = torch.Generator().manual_seed(seed)
    fmt = KVFormat(recent_tokens=16, value_group=32, window=window)
    n, d, hq, hkv = 56, 64, 4, 2
    q = torch.randn(1, hq, n, d, generator=gen)
    k, v = torch.randn(1, hkv, n, d, generator=gen), torch.randn(1, hkv, n, d, generator=gen)
    extras = AttentionExtras(sinks=torch.randn(hq, generator=gen), soft_cap=8.0, sliding_window=w)
    want = run_decode(fmt, q, k, v, extras, hkv)
    for chunks in ([56], [9, 33, 14], [16, 16, 24]):
        got = run_chunks(fmt, q, k, v, chunks, extras, hkv)
        assert (got - want).abs().max() < 2e-5, f"seed={seed} chunks={chunks}"
    dense = dense_attention(q, k, v, torch.arange(n), 1 / math.sqrt(d), extras)
    cos = torch.nn.functional.cosine_similarity(want.flatten(2), dense.flatten(2), dim=-1)
    assert cos.min() > 0.9, f"seed={seed}: compressed output far from dense ({cos.min():.3f})"
    if w <= 16 and window == "sliding":  # the whole window is exact: compressed == dense up to the ring's rounding
        assert (want - dense).abs().max() < 1e-4


@pytest.mark.parametrize("decode_path", [False, True])
def test_window_never_reads_before_its_start(decode_path):
    """Blocks wholly before every query's window start are pointed at a block of NaN bytes (vLLM's freed blocks point
    at its null block): the output does not change."""
    gen = torch.Generator().manual_seed(3)
    fmt = KVFormat(recent_tokens=16, value_group=32)
    hist, t, d, hq, hkv, w = 80, 1 if decode_path else 12, 64, 4, 2, 24
    q = torch.randn(2, hq, t, d, generator=gen)
    k, v = torch.randn(2, hkv, hist + t, d, generator=gen), torch.randn(2, hkv, hist + t, d, generator=gen)
    extras = AttentionExtras(sinks=torch.randn(hq, generator=gen), sliding_window=w)
    cache = CompressedKVCache(fmt, hkv, d, batch_size=2, dtype=torch.float32, block_size=16)
    if decode_path:
        cache.append(k, v)
    else:
        cache.append(k[:, :, :hist], v[:, :, :hist])
        cache.stage(k[:, :, hist:], v[:, :, hist:])
    kv = cache.paged()

    def attend(view):
        if decode_path:
            return decode(q[:, :, 0], view, backend="reference", extras=extras)
        return prefill(q, k[:, :, hist:], v[:, :, hist:], view, backend="reference", extras=extras)

    want = attend(kv)
    first_read = hist - (w - 1) if not decode_path else hist + t - 1 - (w - 1)
    freed = first_read // 16  # blocks [0, freed) hold only positions before every window
    assert freed >= 2
    nan_block = torch.full_like(kv.pages[:1], 0xFF)  # fp16 0xFFFF is NaN
    table = kv.block_table.clone()
    table[:, :freed] = kv.pages.shape[0]
    poisoned = dataclasses.replace(kv, pages=torch.cat([kv.pages, nan_block]), block_table=table)
    got = attend(poisoned)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)


def test_no_extras_is_the_plain_path():
    gen = torch.Generator().manual_seed(4)
    fmt = KVFormat(recent_tokens=16, value_group=32)
    q, k, v = (
        torch.randn(1, 4, 30, 64, generator=gen),
        torch.randn(1, 2, 30, 64, generator=gen),
        torch.randn(1, 2, 30, 64, generator=gen),
    )
    a = run_chunks(fmt, q, k, v, [30], NO_EXTRAS, 2)
    b = run_chunks(fmt, q, k, v, [30], AttentionExtras(sliding_window=10_000), 2)
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(soft_cap=0.0),
        dict(soft_cap=float("inf")),
        dict(sliding_window=0),
        dict(sliding_window=2.5),
        dict(sinks=torch.zeros(2, 2)),
    ],
)
def test_bad_extras_are_named(kwargs):
    with pytest.raises(ShapeError):
        AttentionExtras(**kwargs)


def test_sinks_must_match_the_query_heads():
    cache = CompressedKVCache(KVFormat(recent_tokens=16, value_group=32), 2, 64, dtype=torch.float32)
    cache.append(torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64))
    with pytest.raises(ShapeError, match=r"sinks: expected \[4\]"):
        decode(torch.randn(1, 4, 64), cache.paged(), extras=AttentionExtras(sinks=torch.zeros(3)))
