"""``attention.dispatch``: backend choice, the env switch, and kernel/reference agreement through it."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import DEVICE, fresh_seed, rel_err
from jetson_tq.attention import dispatch
from jetson_tq.attention.reference import attention_decode, attention_prefill
from jetson_tq.cache.compressed import CompressedKVCache
from jetson_tq.errors import ConfigError, ShapeError, UnsupportedPlatformError
from jetson_tq.format import KVFormat, PagedLayout


def test_backend_resolution(monkeypatch):
    lay = PagedLayout(KVFormat(), 64, 16)
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.resolve_backend("auto", torch.device("cpu"), lay) == "reference"
    assert dispatch.resolve_backend("auto", torch.device("cuda"), lay) == "triton"
    assert dispatch.resolve_backend("reference", torch.device("cuda"), lay) == "reference"
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    assert dispatch.resolve_backend("auto", torch.device("cuda"), lay) == "reference"
    assert dispatch.resolve_backend("triton", torch.device("cpu"), lay) == "triton"  # explicit wins
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert dispatch.resolve_backend("auto", torch.device("cpu"), lay) == "triton"
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    with pytest.raises(ConfigError):
        dispatch.resolve_backend("auto", torch.device("cpu"), lay)
    with pytest.raises(ConfigError):
        dispatch.resolve_backend("fast", torch.device("cpu"), lay)


def test_unsupported_format_falls_back_or_raises(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    lay = PagedLayout(KVFormat(value_mode="mse"), 64, 16)
    assert dispatch.resolve_backend("auto", torch.device("cuda"), lay) == "reference"
    with pytest.raises(UnsupportedPlatformError):
        dispatch.resolve_backend("triton", torch.device("cuda"), lay)


def test_reference_path_on_cpu(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    cache = CompressedKVCache(KVFormat(buffer_tokens=8, flush_chunk=8), 2, 64, 2)
    cache.append(torch.randn(2, 2, 30, 64), torch.randn(2, 2, 30, 64))
    q = torch.randn(2, 4, 64)
    assert torch.equal(dispatch.decode(q, cache), attention_decode(q, cache))
    qc, kc = torch.randn(2, 4, 5, 64), torch.randn(2, 2, 5, 64)
    assert torch.equal(dispatch.prefill(qc, kc, kc, cache), attention_prefill(qc, kc, kc, cache))
    empty = CompressedKVCache(KVFormat(), 2, 64, 1)
    with pytest.raises(ShapeError):
        dispatch.decode(torch.randn(1, 4, 64), empty)


@pytest.mark.kernel
def test_triton_backend_agrees_through_the_cache():
    """Appending through the kernel (compress-on-write) and decoding/prefilling through the kernels
    agrees with an all-reference cache fed the same tokens."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    fmt = KVFormat(buffer_tokens=16, flush_chunk=16)
    n = 300 if DEVICE.type == "cuda" else 70
    k = torch.randn(2, 2, n, 128, generator=gen).half()
    v = torch.randn(2, 2, n, 128, generator=gen).half()
    ref_cache = CompressedKVCache(fmt, 2, 128, 2, dtype=torch.float16)
    ref_cache.append(k, v)  # CPU: reference encoder
    cache = CompressedKVCache(fmt, 2, 128, 2, dtype=torch.float16, device=DEVICE)
    if DEVICE.type == "cpu":
        import jetson_tq.attention.dispatch as d
        saved = d.resolve_backend
        d.resolve_backend = lambda backend, device, layout=None: "triton"  # interpreter: force the write kernel
        try:
            cache.append(k.to(DEVICE), v.to(DEVICE))
        finally:
            d.resolve_backend = saved
    else:
        cache.append(k.to(DEVICE), v.to(DEVICE))
    q = torch.randn(2, 8, 128, generator=gen).half()
    ref = attention_decode(q, ref_cache)
    out = dispatch.decode(q.to(DEVICE), cache, backend="triton")
    assert rel_err(out.cpu(), ref) <= 5e-3, f"seed={seed}"  # includes the write kernel's rare sign flips
    qc, kc = torch.randn(2, 8, 9, 128, generator=gen).half(), torch.randn(2, 2, 9, 128, generator=gen).half()
    ref_p = attention_prefill(qc, kc, kc, ref_cache)
    out_p = dispatch.prefill(qc.to(DEVICE), kc.to(DEVICE), kc.to(DEVICE), cache, backend="triton")
    assert rel_err(out_p.cpu(), ref_p) <= 5e-3, f"seed={seed}"
