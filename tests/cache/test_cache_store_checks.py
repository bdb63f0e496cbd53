"""``CompressedKVCache(validate=True)`` on the kernel path: the compress-on-write kernel checks the K/V itself and
records the first fault on the device; the append's commit is skipped there, so a refused append stores nothing and
costs no host sync; the named error comes at the next call, at ``check()``, or at once from ``stage``.

On CPU these run the kernels through Triton's interpreter (``JETSON_TQ_BACKEND=triton`` in the interpreter child).
"""

from __future__ import annotations

import math

import pytest
import torch

from jetson_tq.api import attention_decode, attention_prefill
from jetson_tq.cache.compressed import CompressedKVCache
from jetson_tq.errors import ValueRangeError
from jetson_tq.format import KVFormat

pytestmark = pytest.mark.kernel

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
D, H, B = 64, 2, 2
FMT = KVFormat(recent_tokens=4)  # the default preset's bits (mse_k4v3), a 4-token exact ring


@pytest.fixture(autouse=True)
def _kernel_path(monkeypatch):
    """The Triton kernels also on CPU tensors (the interpreter), so the device-side checks are what runs."""
    if not GPU:
        monkeypatch.setenv("JETSON_TQ_BACKEND", "triton")


def _kv(t: int, seed: int, dtype=torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, H, t, D, generator=g).to(dtype).to(DEVICE),
        torch.randn(B, H, t, D, generator=g).to(dtype).to(DEVICE),
    )


def _settle() -> None:
    """Let the device finish (its fault snapshot is then on the host for the next call to read)."""
    if GPU:
        torch.cuda.synchronize()


@pytest.mark.slow  # > 10 s on 2 cores
def test_a_refused_append_stores_nothing_and_raises_at_the_next_call():
    cache = CompressedKVCache(FMT, H, D, B, device=DEVICE)
    assert cache._device_checks()
    cache.append(*_kv(6, 0))
    ring = cache.ring_k.clone()
    k, v = _kv(3, 1)
    k[1, 0, 2, 5] = math.nan
    cache.append(k, v)  # no host sync: the kernel records the fault, the commit is skipped on the device
    _settle()
    with pytest.raises(ValueRangeError) as e:
        cache.append(*_kv(1, 2))  # the next call raises the earlier refusal, before doing anything
    msg = str(e.value)
    assert "k: expected finite values, got nan at sequence 1, KV head 0, position 8, coordinate 5" in msg, msg
    assert "was not stored" in msg, msg
    assert cache.lengths.tolist() == [6, 6]
    assert torch.equal(cache.ring_k, ring)  # the ring copy of the refused tokens was skipped too
    assert bool(torch.isfinite(attention_decode(torch.randn(B, 4, D).to(DEVICE), cache)).all())
    cache.append(*_kv(1, 3))  # the cache goes on from where it was
    assert cache.lengths.tolist() == [7, 7]


def test_check_raises_now_and_overflow_names_the_bound():
    cache = CompressedKVCache(FMT, H, D, B, device=DEVICE, dtype=torch.float16)
    cache.append(*_kv(2, 0))
    k, v = _kv(2, 4, torch.float32)
    k[0, 1, 1] = 7e4  # fp32 input into an fp16 cache: the ring would hold inf
    cache.append(k, v)
    with pytest.raises(ValueRangeError) as e:
        cache.check()
    msg = str(e.value)
    assert "k: expected |value| <= 65504" in msg and "sequence 0, KV head 1, position 3" in msg, msg
    cache.check()  # raised once: the record is clear again
    assert cache.lengths.tolist() == [2, 2]


def test_stage_raises_before_prefill_reads_the_chunk():
    """``stage`` (prefill's write of the chunk) raises before returning: attention never reads a refused chunk."""
    cache = CompressedKVCache(FMT, H, D, B, device=DEVICE)
    cache.append(*_kv(5, 0))
    k, v = _kv(4, 5)
    v[0, 0, 3, 7] = -math.inf
    with pytest.raises(
        ValueRangeError, match="v: expected finite values, got -inf at sequence 0, KV head 0, position 8, coordinate 7"
    ):
        cache.stage(k, v)
    assert cache.lengths.tolist() == [5, 5]
    out = attention_prefill(torch.randn(B, 4, 4, D).to(DEVICE), *_kv(4, 6), cache)  # the cache is usable
    assert bool(torch.isfinite(out).all()) and cache.lengths.tolist() == [9, 9]


def test_validate_false_records_nothing():
    cache = CompressedKVCache(FMT, H, D, B, device=DEVICE, validate=False)
    k, v = _kv(3, 6)
    k[0, 0, 0, 0] = math.nan
    cache.append(k, v)
    cache.check()
    assert cache.lengths.tolist() == [3, 3]


def test_attention_prefill_names_a_refused_chunk_and_keeps_the_cache():
    """``attention_prefill`` checks its chunk inside the write launch and never waits for the GPU: the named error
    comes from the call (its record already on the host; always so off CUDA) or from the next ``check()``, and the
    guarded commit kept nothing."""
    cache = CompressedKVCache(FMT, H, D, B, device=DEVICE)
    cache.append(*_kv(5, 0))
    ring = cache.ring_k.clone()
    k, v = _kv(4, 7, torch.float32)
    k[1, 1, 0, 3] = 7e4  # finite (the host's input checks pass it), but the fp16 ring would hold inf
    with pytest.raises(ValueRangeError, match=r"k: expected \|value\| <= 65504.*sequence 1, KV head 1, position 5"):
        attention_prefill(torch.randn(B, 4, 4, D).to(DEVICE), k, v, cache)
        cache.check()  # on CUDA the record may still be on its way when the call returns
    assert cache.lengths.tolist() == [5, 5] and torch.equal(cache.ring_k, ring)
    out = attention_prefill(torch.randn(B, 4, 4, D).to(DEVICE), *_kv(4, 8), cache)
    assert bool(torch.isfinite(out).all()) and cache.lengths.tolist() == [9, 9]


def test_mse_values_name_their_norm_bound():
    """mse values store ||v|| in fp16: a bf16 cache (no element bound) refuses a value whose norm is past 65504, and
    the kernel path's attention over mse values matches the reference."""
    fmt = KVFormat(value_mode="mse", value_bits=3, recent_tokens=4)
    cache = CompressedKVCache(fmt, H, D, B, device=DEVICE, dtype=torch.bfloat16)
    cache.append(*_kv(6, 0, torch.bfloat16))
    q = torch.randn(B, 4, D).to(DEVICE)
    want = attention_decode(q, cache, backend="reference")
    got = attention_decode(q, cache)
    assert (got.float() - want.float()).norm() <= 1.5e-2 * want.float().norm()
    k, v = _kv(2, 9, torch.bfloat16)
    v[1, 0, 1] = 9e3  # norm 9e3 * sqrt(64) = 72000: finite in bf16, past the fp16 norm
    cache.append(k, v)
    with pytest.raises(ValueRangeError) as e:
        cache.check()
    msg = str(e.value)
    assert "v: expected value norm <= 65504" in msg and "sequence 1, KV head 0, position 7" in msg, msg
    assert cache.lengths.tolist() == [6, 6]
