"""The CPU evaluation fast path (decoded history + SDPA) computes the reference attention's numbers."""

from __future__ import annotations

import pytest
import torch

from jetson_tq import ops
from jetson_tq.cache.compressed import CompressedKVCache
from jetson_tq.format import KVFormat
from lab.eval.decoded_history import DecodedHistory

FORMATS = [
    KVFormat(key_mode="prod", key_bits=3, value_bits=2, value_group=16, recent_tokens=8),
    KVFormat(key_mode="prod", key_bits=1, value_mode="mse", value_bits=3, recent_tokens=0),
    KVFormat(key_mode="mse", key_bits=4, value_bits=4, value_group=32, recent_tokens=16),
    KVFormat(key_mode="fp16", value_mode="group", value_bits=2, value_group=8, recent_tokens=0),
    KVFormat(key_mode="mse", key_bits=2, value_mode="fp16", rotation="dense", recent_tokens=4),
    # block windows: the 5-token chunk at 45..49 crosses the boundary at 48 (16-token blocks) / 48 (8-token blocks)
    KVFormat(key_mode="mse", key_bits=4, value_bits=3, value_group=32, recent_tokens=16, window="block"),
    KVFormat(key_mode="prod", key_bits=3, value_bits=2, value_group=16, recent_tokens=8, window="block"),
]


def _filled(fmt: KVFormat, b=2, h=2, d=32, n=45, seed=0):
    g = torch.Generator().manual_seed(seed)
    store = CompressedKVCache(fmt, h, d, b, dtype=torch.float32, seed=7)
    store.append(torch.randn(b, h, n, d, generator=g) * 2, torch.randn(b, h, n, d, generator=g))
    return store, g


@pytest.mark.parametrize(
    "fmt", FORMATS, ids=lambda f: f"{f.key_mode}{f.key_bits}-{f.value_mode}{f.value_bits}-r{f.recent_tokens}-{f.window}"
)
def test_prefill_and_decode_match_reference(fmt):
    store, g = _filled(fmt)
    hist = DecodedHistory(store)
    q = torch.randn(2, 6, 5, 32, generator=g)
    k, v = torch.randn(2, 2, 5, 32, generator=g), torch.randn(2, 2, 5, 32, generator=g)
    store.stage(k, v)
    ref = ops.prefill(q, k, v, store.paged(), 0.2, "reference")
    got = hist.attend(q, k, v, 0.2)
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-4), (got - ref).abs().max()
    store.commit(k, v)
    k1 = torch.randn(2, 2, 1, 32, generator=g)
    store.append(k1, k1)
    q1 = torch.randn(2, 6, 32, generator=g)
    ref1 = ops.decode(q1, store.paged(), 0.2, "reference")
    got1 = hist.attend(q1.unsqueeze(2), None, None, 0.2).squeeze(2)
    assert torch.allclose(got1, ref1, atol=2e-5, rtol=1e-4), (got1 - ref1).abs().max()
    assert hist.count == int(store.lengths[0]) > 0


def test_explicit_mask_matches_masked_reference():
    fmt = FORMATS[0]
    store, g = _filled(fmt, n=30)
    q = torch.randn(2, 6, 4, 32, generator=g)
    k, v = torch.randn(2, 2, 4, 32, generator=g), torch.randn(2, 2, 4, 32, generator=g)
    n = 34
    mask = torch.ones(2, 1, 4, n, dtype=torch.bool).tril(diagonal=n - 4)
    mask[1, :, :, :7] = False  # left padding of the second sequence
    store.stage(k, v)
    ref = ops.prefill(q, k, v, store.paged(), 0.25, "reference", mask)
    got = DecodedHistory(store).attend(q, k, v, 0.25, mask)
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-4)
