"""Host-side helpers the kernels share (no Triton launch): the codebook polynomial and the
compress-on-write tile fallback."""

from __future__ import annotations

import pytest
import torch

from jetson_tq.codec.codebook import lloyd_max_codebook
from jetson_tq.kernels import compress_write as cw
from jetson_tq.kernels._common import POLY_TERMS, _odd_polynomial_fit


def _eval(coef: torch.Tensor, n: int) -> torch.Tensor:
    """What ``_tiles.centroid_poly`` computes, in float64: v * sum_i a_i (v^2)^i, v = k - (n-1)/2."""
    v = torch.arange(n, dtype=torch.float64) - (n - 1) / 2
    t = v * v
    p = torch.zeros_like(v)
    for a in reversed(coef.double().tolist()):
        p = p * t + a
    return v * p


@pytest.mark.parametrize("d", [50, 64, 128, 256])
@pytest.mark.parametrize("bits", [3, 4])
def test_codebook_polynomial_matches_lloyd_max(d, bits):
    cb = lloyd_max_codebook(d, bits).double()
    coef = _odd_polynomial_fit(cb)
    assert coef is not None and coef.shape == (POLY_TERMS,)
    err = (_eval(coef, cb.numel()) - cb).abs().max().item() / cb.abs().max().item()
    # 8 entries: exact (4 odd terms, 4 free values); 16: 6 terms for 8 free values, well under fp16 rounding
    assert err <= (1e-6 if bits == 3 else 2e-5), f"d={d} bits={bits}: {err:.2e}"


def test_codebook_polynomial_refuses_what_it_cannot_fit():
    assert _odd_polynomial_fit(lloyd_max_codebook(128, 2)) is None  # 4 entries: kernels use bit planes
    skewed = lloyd_max_codebook(128, 4).clone()
    skewed[3] += 0.01  # no longer symmetric
    assert _odd_polynomial_fit(skewed) is None


def test_compress_tile_defaults_by_head_dim():
    assert cw.default_block_t(64) == cw.default_block_t(128) == cw.BLOCK_T
    assert cw.default_block_t(256) == cw.BLOCK_T // 2
    assert cw.default_block_t(512) == cw.BLOCK_T // 4


def test_compress_tile_halves_when_shared_memory_overflows(monkeypatch):
    """A tile that does not fit (Triton raises OutOfResources at compile time, before any write) is
    retried at half the tokens, and the size that fit is remembered for the next call."""
    from triton.runtime.errors import OutOfResources

    from jetson_tq.config import load_config
    from jetson_tq.codec.kv import KVCodec
    from jetson_tq.format import PagedLayout

    tried, fits = [], [32]

    class FakeKernel:
        def __getitem__(self, grid):
            def launch(*args, BLOCK_T, **kwargs):
                tried.append(BLOCK_T)
                if BLOCK_T > fits[0]:
                    raise OutOfResources(BLOCK_T * 2304, 232448, "shared memory")
            return launch

    monkeypatch.setattr(cw, "_compress_write_kernel", FakeKernel())
    monkeypatch.setattr(cw, "cuda_or_interpreter", lambda t: None)
    monkeypatch.setattr(cw, "_FITTED_BLOCK_T", {})
    fmt = load_config("blog_k3v2").default
    layout, codec = PagedLayout(fmt, 256, 16), KVCodec(fmt, 256)
    k = torch.zeros(4, 2, 256)
    pages = torch.zeros(2, 2, layout.page_bytes, dtype=torch.uint8)
    cw.compress_write(k, k, torch.arange(4), pages, layout, codec)
    assert tried == [64, 32]
    cw.compress_write(k, k, torch.arange(4), pages, layout, codec)
    assert tried == [64, 32, 32]  # remembered
    tried.clear()
    fits[0] = 0  # nothing fits: the error surfaces after the smallest tile
    with pytest.raises(OutOfResources):
        cw.compress_write(k, k, torch.arange(4), pages, layout, codec, block_t=64)
    assert tried == [64, 32, 16]
