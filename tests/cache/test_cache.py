"""CompressedKVCache: every token compressed + an exact ring of the last R, ragged batches, geometric growth,
real byte counts, errors."""

import pytest
import torch

from jetson_tq import FP16_FORMAT, CompressedKVCache, KVFormat
from jetson_tq.errors import DTypeError, ShapeError

FMT = KVFormat(recent_tokens=8, value_group=32, window="sliding")  # the ring rule these tests spell out


def test_ring_keeps_the_last_window_exact_one_token_at_a_time():
    cache = CompressedKVCache(FMT, 2, 64, batch_size=1, dtype=torch.float32)
    k, v = torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    for t in range(40):
        cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        n_c, n_b = int(cache.compressed_lens[0]), int(cache.buffer_lens[0])
        assert (n_c, n_b) == (max(0, t + 1 - 8), min(t + 1, 8))
        rk, rv = cache.recent_in_order()
        assert torch.equal(rk[0, :, :n_b], k[0, :, t + 1 - n_b : t + 1])  # exact and in position order
        assert torch.equal(rv[0, :, :n_b], v[0, :, t + 1 - n_b : t + 1])
    # every token is also in the pages, compressed: the same fields whether appended one by one or at once
    bulk = CompressedKVCache(FMT, 2, 64, batch_size=1, dtype=torch.float32)
    bulk.append(k, v)
    one, many = cache.paged().gather_compressed(40), bulk.paged().gather_compressed(40)
    assert all(torch.equal(one[n], many[n]) for n in one)


def test_ragged_batch_prefill_then_decode_matches_materialized_tokens():
    cache = CompressedKVCache(FMT, 2, 64, batch_size=3, dtype=torch.float16)
    lens = [3, 17, 50]
    ks = [torch.randn(2, n, 64) for n in lens]
    for b in range(len(lens)):
        cache.append(ks[b], ks[b] * 0.5, seq=b)
    step = torch.randn(3, 2, 1, 64)
    cache.append(step, step)
    assert cache.lengths.tolist() == [4, 18, 51]
    k, v, lengths = cache.materialize()
    assert lengths.tolist() == [4, 18, 51]
    for b, n in enumerate(lens):
        n_c = int(cache.compressed_lens[b])
        full = torch.cat([ks[b], step[b]], dim=1).float()
        # buffered tokens are exact (fp16), compressed ones are close
        assert torch.allclose(k[b, :, n_c : n + 1], full[:, n_c:].half().float())
        if n_c:
            rel = (k[b, :, :n_c] - full[:, :n_c]).norm() / full[:, :n_c].norm()
            assert float(rel) < 0.6


def test_storage_grows_geometrically():
    cache = CompressedKVCache(KVFormat(recent_tokens=0), 1, 64, initial_capacity=16)
    capacities = set()
    for _ in range(100):
        cache.append(torch.randn(1, 1, 37, 64), torch.randn(1, 1, 37, 64))
        capacities.add(cache.capacity)
    assert int(cache.lengths[0]) == 3700
    assert len(capacities) <= 9  # 16 -> ... -> 4096: doublings, not one allocation per append
    assert cache.capacity >= 3700


def test_nbytes_is_real_storage_and_used_bytes_follow_the_format():
    fmt = KVFormat(recent_tokens=16, window="sliding")
    cache = CompressedKVCache(fmt, 4, 128, batch_size=2, dtype=torch.float16, initial_capacity=64)
    cache.append(torch.randn(2, 4, 100, 128), torch.randn(2, 4, 100, 128))
    storage = cache.pages.untyped_storage().nbytes() + 2 * cache.ring_k.untyped_storage().nbytes()
    assert cache.nbytes() == storage
    assert cache.pages.numel() == 2 * cache.blocks_per_seq * 4 * 16 * 122  # page = 16 tokens x 122 B (mse_k4v3)
    n_all, n_b = int(cache.lengths.sum()), int(cache.buffer_lens.sum())
    assert cache.used_bytes() == n_all * 4 * 122 + n_b * 4 * 2 * 128 * 2


def test_fp16_passthrough_is_lossless():
    cache = CompressedKVCache(FP16_FORMAT, 2, 64, dtype=torch.float16)
    k = torch.randn(1, 2, 10, 64).half()
    cache.append(k, -k)
    kk, vv, _ = cache.materialize()
    assert torch.equal(kk.half(), k) and torch.equal(vv.half(), -k)


def test_append_errors_are_named():
    cache = CompressedKVCache(FMT, 2, 64, batch_size=2)
    with pytest.raises(ShapeError):
        cache.append(torch.randn(2, 3, 1, 64), torch.randn(2, 3, 1, 64))  # 3 heads, cache has 2
    with pytest.raises(ShapeError):
        cache.append(torch.randn(2, 2, 1, 32), torch.randn(2, 2, 1, 32))
    with pytest.raises(ShapeError):
        cache.append(torch.randn(3, 2, 1, 64), torch.randn(3, 2, 1, 64))  # batch 3 vs 2
    with pytest.raises(ShapeError):
        cache.append(torch.randn(2, 1, 64), torch.randn(2, 1, 64), seq=5)
    with pytest.raises(DTypeError):
        cache.append(torch.ones(2, 2, 1, 64, dtype=torch.int32), torch.ones(2, 2, 1, 64, dtype=torch.int32))
    with pytest.raises(DTypeError):
        CompressedKVCache(FMT, 2, 64, dtype=torch.int8)
