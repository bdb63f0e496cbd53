"""Reference attention: equals naive dequantize-then-softmax, prefill == sequential decode, fidelity per format."""

import functools
import math

import pytest
import torch

from jetson_tq import FP16_FORMAT, CompressedKVCache, KVFormat, attention_decode, attention_prefill, load_config
from jetson_tq.errors import ShapeError


def naive_attention(q, k, v, lengths, hkv):
    """Softmax attention of q [B, Hq, D] over materialized k, v [B, Hkv, N, D] (fp32)."""
    out = []
    g = q.shape[1] // hkv
    for b in range(q.shape[0]):
        n = int(lengths[b])
        kk = k[b, :, :n].repeat_interleave(g, 0)
        vv = v[b, :, :n].repeat_interleave(g, 0)
        p = torch.softmax(q[b].float().unsqueeze(1) @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
        out.append((p @ vv).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize(
    "fmt",
    [
        KVFormat(key_mode="prod", key_bits=3, value_bits=2, value_group=32, recent_tokens=16),
        KVFormat(key_mode="mse", key_bits=4, recent_tokens=0),
        KVFormat(key_bits=4, value_mode="mse", value_bits=3, recent_tokens=8),
        FP16_FORMAT,
    ],
)
def test_decode_equals_naive_dequantize_then_softmax(fmt):
    torch.manual_seed(0)
    cache = CompressedKVCache(fmt, 2, 64, batch_size=3, dtype=torch.float32)
    for b, n in enumerate([1, 29, 140]):
        cache.append(torch.randn(2, n, 64), torch.randn(2, n, 64), seq=b)
    q = torch.randn(3, 8, 64)
    out = attention_decode(q, cache)
    k, v, lengths = cache.materialize()
    assert out.shape == q.shape
    assert torch.allclose(out, naive_attention(q, k, v, lengths, 2), atol=2e-5)


@pytest.mark.parametrize("window", ["sliding", "block"])
@pytest.mark.parametrize("chunks", [[70, 6], [3, 40, 33], [76], [1] * 76, [20, 25, 31], [32, 32, 12]])
def test_results_do_not_depend_on_how_tokens_are_chunked(chunks, window):
    """Scheduling invariance: prefill in chunks of any size (larger than the window R = 32 too, straddling
    32-token block boundaries or aligned to them) gives the same per-position outputs as one token at a time,
    because a query at p reads positions older than ``exact_start(p)`` (p + 1 - R, or its own block p - p % R)
    compressed and the rest exactly in both paths."""
    fmt, (q, k, v), want = _decoded_one_by_one(window)
    n = sum(chunks)
    cache = CompressedKVCache(fmt, 2, 64, batch_size=2, dtype=torch.float32)
    got, start = [], 0
    for c in chunks:
        got.append(
            attention_prefill(q[:, :, start : start + c], k[:, :, start : start + c], v[:, :, start : start + c], cache)
        )
        start += c
    assert cache.lengths.tolist() == [n, n]
    assert torch.allclose(torch.cat(got, dim=2), want, atol=1e-5)


@functools.lru_cache(maxsize=2)
def _decoded_one_by_one(window: str, n: int = 76):
    """(format, (q, k, v), decode outputs [2, 4, n, 64] one token at a time): the chunking tests' reference."""
    torch.manual_seed(1)
    fmt = KVFormat(recent_tokens=32, value_group=32, window=window)
    q, k, v = torch.randn(2, 4, n, 64), torch.randn(2, 2, n, 64), torch.randn(2, 2, n, 64)
    step = CompressedKVCache(fmt, 2, 64, batch_size=2, dtype=torch.float32)
    one_by_one = []
    for t in range(n):
        step.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        one_by_one.append(attention_decode(q[:, :, t], step))
    return fmt, (q, k, v), torch.stack(one_by_one, dim=2)


def test_block_window_reads_the_own_block_exactly():
    """Under ``window: block`` a query at p reads exactly [p - p % R, p] and compressed everything before: the
    prefill output equals naive softmax over that mix of exact and dequantized tokens, position by position
    (a chunk of 45 from history 27 crosses the boundaries at 32 and 64)."""
    torch.manual_seed(4)
    fmt, ring, s, t = KVFormat(recent_tokens=32, value_group=32, window="block"), 32, 27, 45
    q, k, v = torch.randn(1, 4, s + t, 64), torch.randn(1, 2, s + t, 64), torch.randn(1, 2, s + t, 64)
    cache = CompressedKVCache(fmt, 2, 64, dtype=torch.float32)
    attention_prefill(q[:, :, :s], k[:, :, :s], v[:, :, :s], cache)
    assert cache.buffer_lens.tolist() == [s % ring]
    got = attention_prefill(q[:, :, s:], k[:, :, s:], v[:, :, s:], cache)
    assert cache.buffer_lens.tolist() == [(s + t - 1) % ring + 1]
    f = cache.codec.encode(k[0].transpose(0, 1), v[0].transpose(0, 1))  # [N, H, ·]: the stored form
    kd, vd = cache.codec.decode_keys(f).transpose(0, 1), cache.codec.decode_values(f).transpose(0, 1)
    for p in range(s, s + t):
        e = p - p % ring
        kk = torch.cat([kd[:, :e], k[0, :, e : p + 1]], 1).unsqueeze(0)
        vv = torch.cat([vd[:, :e], v[0, :, e : p + 1]], 1).unsqueeze(0)
        want = naive_attention(q[:, :, p], kk, vv, [p + 1], 2)
        assert torch.allclose(got[:, :, p - s], want, atol=2e-5), p


def exact_attention(q, k, v):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return torch.softmax(q.unsqueeze(2) @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1).matmul(vv).squeeze(2)


@pytest.mark.parametrize("preset,min_cos", [("k4v4", 0.97), ("blog_k3v2", 0.90), ("mse_k3v2", 0.90), ("fp16", 0.9999)])
def test_decode_fidelity_vs_fp32_attention(preset, min_cos):
    """Cosine of decode output vs exact fp32 attention on Gaussian K/V with peaked queries, D=128, 1k context."""
    torch.manual_seed(2)
    fmt = load_config(preset).default
    k, v = torch.randn(2, 4, 1024, 128), torch.randn(2, 4, 1024, 128)
    q = k[:, :, [3, 500, 900, 1000]].transpose(1, 2).reshape(2, 16, 128) * 0.15 + torch.randn(2, 16, 128) * 0.5
    cache = CompressedKVCache(fmt, 4, 128, batch_size=2, dtype=torch.float32)
    cache.append(k, v)
    cos = torch.nn.functional.cosine_similarity(
        attention_decode(q, cache).flatten(1), exact_attention(q, k, v).flatten(1)
    )
    assert float(cos.min()) >= min_cos, (preset, cos.tolist())


def test_attention_errors_are_named():
    cache = CompressedKVCache(KVFormat(), 2, 64, batch_size=2)
    with pytest.raises(ShapeError, match="empty"):
        attention_decode(torch.randn(2, 4, 64), cache)
    cache.append(torch.randn(2, 2, 3, 64), torch.randn(2, 2, 3, 64))
    with pytest.raises(ShapeError):
        attention_decode(torch.randn(2, 3, 64), cache)  # 3 query heads over 2 KV heads
    with pytest.raises(ShapeError):
        attention_decode(torch.randn(2, 4, 32), cache)
    with pytest.raises(ShapeError):
        attention_decode(torch.randn(2, 4, 1, 64), cache)
    with pytest.raises(ShapeError):
        attention_prefill(torch.randn(2, 4, 5, 64), torch.randn(2, 2, 4, 64), torch.randn(2, 2, 4, 64), cache)
