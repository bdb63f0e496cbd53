"""Reference attention: equals naive dequantize-then-softmax, prefill == sequential decode, fidelity per format."""

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


@pytest.mark.parametrize("fmt", [KVFormat(key_mode="prod", key_bits=3, value_bits=2, value_group=32, buffer_tokens=16),
                                 KVFormat(key_mode="mse", key_bits=4, buffer_tokens=0),
                                 KVFormat(key_bits=4, value_mode="mse", value_bits=3, buffer_tokens=8),
                                 FP16_FORMAT])
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


@pytest.mark.parametrize("chunks", [[70, 6], [3, 40, 33], [76], [1] * 76])
def test_results_do_not_depend_on_how_tokens_are_chunked(chunks):
    """Scheduling invariance: prefill in chunks of any size (larger than the window R = 32 too) gives the same
    per-position outputs as one token at a time, because a query at p reads positions older than p + 1 - R
    compressed and the last R exactly in both paths."""
    torch.manual_seed(1)
    fmt = KVFormat(buffer_tokens=32, value_group=32)
    n = sum(chunks)
    q, k, v = torch.randn(2, 4, n, 64), torch.randn(2, 2, n, 64), torch.randn(2, 2, n, 64)
    step = CompressedKVCache(fmt, 2, 64, batch_size=2, dtype=torch.float32)
    one_by_one = []
    for t in range(n):
        step.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        one_by_one.append(attention_decode(q[:, :, t], step))
    want = torch.stack(one_by_one, dim=2)
    cache = CompressedKVCache(fmt, 2, 64, batch_size=2, dtype=torch.float32)
    got, start = [], 0
    for c in chunks:
        got.append(attention_prefill(q[:, :, start : start + c], k[:, :, start : start + c],
                                     v[:, :, start : start + c], cache))
        start += c
    assert cache.lengths.tolist() == [n, n]
    assert torch.allclose(torch.cat(got, dim=2), want, atol=1e-5)


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
    cos = torch.nn.functional.cosine_similarity(attention_decode(q, cache).flatten(1), exact_attention(q, k, v).flatten(1))
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
