"""``jetson_tq.ops``: the one backend choice, the env switch read once, and kernel/reference agreement through
the public API; CUDA-graph capture of append + decode on the GPU."""

from __future__ import annotations

import pytest
import torch

import jetson_tq as jt
from jetson_tq import ops
from jetson_tq.attention.reference import paged_attention_decode, paged_attention_prefill
from jetson_tq.cache.compressed import CaptureError, CompressedKVCache
from jetson_tq.errors import ArgTypeError, ConfigError, ShapeError, UnsupportedPlatformError
from jetson_tq.format import KVFormat, PagedLayout
from tests.helpers.kernel_cases import DEVICE, GPU, fresh_seed, rel_err

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _setting(monkeypatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(ops.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ops.ENV_VAR, value)
    ops.configured.cache_clear()


def test_backend_resolution(monkeypatch):
    lay = PagedLayout(KVFormat(), 64, 16)
    _setting(monkeypatch, None)
    assert ops.resolve(CPU, lay) == "reference" and ops.resolve(CUDA, lay) == "triton"
    assert ops.resolve(CUDA, lay, "reference") == "reference"
    _setting(monkeypatch, "reference")
    assert ops.resolve(CUDA, lay) == "reference"
    assert ops.resolve(CUDA, lay, "auto") == "triton"  # a per-call choice wins over the setting
    _setting(monkeypatch, "Triton ")
    assert ops.configured() == "triton"
    if not ops.backend._interpreting():
        with pytest.raises(UnsupportedPlatformError, match="TRITON_INTERPRET"):
            ops.resolve(CPU, lay)
    _setting(monkeypatch, "cuda")
    with pytest.raises(ConfigError, match="JETSON_TQ_BACKEND.*'cuda'"):
        ops.resolve(CPU, lay)
    with pytest.raises(ConfigError, match="backend: expected"):
        ops.resolve(CPU, lay, "fast")


def test_setting_is_read_once(monkeypatch):
    _setting(monkeypatch, "reference")
    assert ops.configured() == "reference"
    monkeypatch.setenv(ops.ENV_VAR, "triton")  # not re-read until the cache is cleared
    assert ops.configured() == "reference"


def test_unsupported_format_falls_back_or_raises(monkeypatch):
    _setting(monkeypatch, None)
    lay = PagedLayout(KVFormat(sink_tokens=4), 64, 16)
    assert ops.resolve(CUDA, lay) == "reference"
    with pytest.raises(UnsupportedPlatformError, match="sink_tokens"):
        ops.resolve(CUDA, lay, "triton")
    assert not ops.graph_safe(CUDA, lay)


def test_public_api_runs_the_reference_on_cpu(monkeypatch):
    _setting(monkeypatch, None)
    k, v = torch.randn(2, 2, 30, 64), torch.randn(2, 2, 30, 64)
    cache, twin = (CompressedKVCache(KVFormat(recent_tokens=8), 2, 64, 2) for _ in range(2))
    for c in (cache, twin):
        c.append(k, v)
    q = torch.randn(2, 4, 64)
    assert torch.equal(jt.attention_decode(q, cache), paged_attention_decode(q, cache.paged()))
    qc, kc = torch.randn(2, 4, 5, 64), torch.randn(2, 2, 5, 64)
    got = jt.attention_prefill(qc, kc, kc, cache)  # stages the chunk, attends, then appends it
    twin.stage(kc, kc)
    want = paged_attention_prefill(qc, kc, kc, twin.paged())
    twin.commit(kc, kc)
    assert torch.equal(got, want) and cache.lengths.tolist() == twin.lengths.tolist() == [35, 35]
    empty = CompressedKVCache(KVFormat(), 2, 64, 1)
    with pytest.raises(ShapeError, match="empty cache"):
        jt.attention_decode(torch.randn(1, 4, 64), empty)
    with pytest.raises(ArgTypeError, match="q: expected a torch.Tensor"):
        jt.attention_decode([[0.0]], cache)
    with pytest.raises(ArgTypeError, match="CompressedKVCache or PagedKV"):
        jt.attention_decode(q, "cache")


def test_append_keeps_the_last_window_exact_and_everything_compressed():
    """Ring semantics: L tokens are read as compressed [0, L - r) + r = min(L, R) exact tokens in a ring."""
    fmt = KVFormat(recent_tokens=8, window="sliding")
    cache = CompressedKVCache(fmt, 1, 64, 2, dtype=torch.float32)
    k, v = torch.randn(2, 1, 21, 64), torch.randn(2, 1, 21, 64)
    cache.append(k[:, :, :13], v[:, :, :13])
    cache.append(k[:1, 0, 13:], v[:1, 0, 13:], seq=0)  # ragged: sequence 0 gets 8 more
    assert cache.lengths.tolist() == [21, 13] and cache.buffer_lens.tolist() == [8, 8]
    assert cache.compressed_lens.tolist() == [13, 5]
    rk, _ = cache.recent_in_order()
    assert torch.equal(rk[0, 0], k[0, 0, 13:21]) and torch.equal(rk[1, 0], k[1, 0, 5:13])
    full, _, lens = cache.materialize()
    assert torch.equal(full[0, 0, 13:21], k[0, 0, 13:21])  # exact part in position order
    assert rel_err(full[0, 0, :13], k[0, 0, :13]) < 0.2  # compressed part: 4-bit keys
    assert lens.tolist() == [21, 13]


def test_append_memory_is_bounded_at_any_size():
    """One append of N tokens allocates O(chunk) temporaries, not an [N, N/16] index (it was +4.7 GB at 80k)."""
    import subprocess
    import sys

    code = r"""
import resource, torch
torch.set_num_threads(1)
from jetson_tq.cache.compressed import CompressedKVCache
from jetson_tq.format import KVFormat
n = 80_000
c = CompressedKVCache(KVFormat(), 1, 128, 1, dtype=torch.float16, initial_capacity=n)
k = torch.randn(1, n, 128, dtype=torch.float16); v = torch.randn(1, n, 128, dtype=torch.float16)
c.append(k[:, :64], v[:, :64], seq=0)  # warm-up: codebooks, rotation
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
c.append(k[:, 64:], v[:, 64:], seq=0)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
stored = (n - 64) * c.fmt.bytes_per_token(128)
print(peak - before, stored)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    extra, stored = map(int, out.stdout.split())
    assert extra <= 2 * stored, f"peak grew by {extra} B to store {stored} B"


@pytest.mark.slow  # ~14 CPU-s in the interpreter; the quick lane keeps each kernel's own test
@pytest.mark.kernel
def test_triton_backend_agrees_through_the_cache(monkeypatch):
    """Appending through the compress-on-write kernel stores an all-reference cache's bytes (up to codes at exact
    ties), and decoding / prefilling through the kernels agrees with the reference over those pages (CPU: the
    Triton interpreter)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    fmt = KVFormat(recent_tokens=16)
    n = 300 if GPU else 70
    k = torch.randn(2, 2, n, 128, generator=gen).half()
    v = torch.randn(2, 2, n, 128, generator=gen).half()
    q = torch.randn(2, 8, 128, generator=gen).half().to(DEVICE)
    qc, kc = (torch.randn(2, h, 9, 128, generator=gen).half().to(DEVICE) for h in (8, 2))
    _setting(monkeypatch, "reference")
    ref_cache = CompressedKVCache(fmt, 2, 128, 2, dtype=torch.float16)
    ref_cache.append(k, v)
    _setting(monkeypatch, "triton")
    caches = [CompressedKVCache(fmt, 2, 128, 2, dtype=torch.float16, device=DEVICE) for _ in range(2)]
    for cache in caches:
        cache.append(k.to(DEVICE), v.to(DEVICE))
    # fp16 inputs make (v - zero) / scale exactly half-way between two value codes for ~1e-4 of the values; the
    # kernel (a product by 1 / scale) may pick the other, equally near code there: a handful of bytes, never more
    assert torch.equal(caches[0].pages, caches[1].pages)
    differ = float((caches[0].pages.cpu() != ref_cache.pages).double().mean())
    assert differ <= 1e-3, f"seed={seed}: {differ:.2e} of the page bytes differ from the reference write"
    assert torch.equal(caches[0].ring_k.cpu(), ref_cache.ring_k) and torch.equal(
        caches[0].ring_v.cpu(), ref_cache.ring_v
    )
    out, want = (jt.attention_decode(q, caches[0], backend=b) for b in ("triton", "reference"))
    assert rel_err(out.cpu(), want.cpu()) <= 2e-3, f"seed={seed}"
    out_p, want_p = (jt.attention_prefill(qc, kc, kc, c, backend=b) for c, b in zip(caches, ("triton", "reference")))
    assert rel_err(out_p.cpu(), want_p.cpu()) <= 2e-3, f"seed={seed}"


@pytest.mark.gpu  # CUDA graphs need a CUDA GPU
def test_append_and_decode_capture_in_a_cuda_graph_and_replay_as_the_cache_grows(monkeypatch):
    _setting(monkeypatch, None)
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, hkv, hq, d = 2, 2, 8, 128
    cache = CompressedKVCache(KVFormat(), hkv, d, b, device="cuda", dtype=torch.float16)
    eager = CompressedKVCache(KVFormat(), hkv, d, b, device="cuda", dtype=torch.float16)
    prompt = torch.randn(b, hkv, 300, d, device="cuda", generator=gen).half()
    for c in (cache, eager):
        c.append(prompt, prompt)
        c.reserve(300 + 40)
    k_in = torch.zeros(b, hkv, 1, d, device="cuda", dtype=torch.float16)
    q_in = torch.zeros(b, hq, d, device="cuda", dtype=torch.float16)
    jt.attention_decode(q_in, cache)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            cache.append(k_in, k_in)
            out = jt.attention_decode(q_in, cache)
    torch.cuda.current_stream().wait_stream(stream)
    for step in range(30):
        k = torch.randn(b, hkv, 1, d, device="cuda", generator=gen).half()
        q = torch.randn(b, hq, d, device="cuda", generator=gen).half()
        k_in.copy_(k)
        q_in.copy_(q)
        graph.replay()
        eager.append(k, k)
        want = jt.attention_decode(q, eager)
        assert torch.allclose(out, want, atol=2e-3, rtol=0), f"step {step}"
    assert cache.lengths.tolist() == [330, 330] and not cache.overflowed  # capture records, replays append
    too_many = cache.capacity - 330 + 1  # one token more than the reserved pages hold
    with pytest.raises(CaptureError, match="reserve"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            cache.append(
                torch.zeros(b, hkv, too_many, d, device="cuda", dtype=torch.float16),
                torch.zeros(b, hkv, too_many, d, device="cuda", dtype=torch.float16),
            )
