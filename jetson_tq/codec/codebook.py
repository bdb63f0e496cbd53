"""Lloyd-Max codebooks for one coordinate of a uniformly random unit vector in R^d.

The coordinate x = cos(theta) of a uniform point on the sphere S^(d-1) has density proportional
to (1 - x^2)^((d-3)/2) on [-1, 1] (a shifted Beta((d-1)/2, (d-1)/2)); in theta that is
sin(theta)^(d-2) on [0, pi], which is smooth for every d >= 2, so we integrate on a theta grid.
Lloyd's algorithm (cells = midpoints, centroids = conditional means) then runs on prefix sums, so
an iteration costs O(2^bits log M), not O(M).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from ..errors import FormatError
from ..format import MAX_BITS

_GRID_POINTS = 1 << 20
_MAX_ITERS = 20000
_TOL = 1e-12


def _check(dim: int, bits: int) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2:
        raise FormatError(f"dim: expected an integer >= 2, got {dim!r}")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise FormatError(f"bits: expected an integer in [1, {MAX_BITS}], got {bits!r}")


@lru_cache(maxsize=None)
def _grid(dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted sample points x and their probability weights for the coordinate density."""
    half_width = min(1.0, 14.0 / np.sqrt(dim))  # beyond 14 sigma the mass is < 1e-40
    lo, hi = np.arccos(half_width), np.arccos(-half_width)
    edges = np.linspace(lo, hi, _GRID_POINTS + 1)
    theta = 0.5 * (edges[1:] + edges[:-1])
    log_w = (dim - 2) * np.log(np.sin(theta))
    w = np.exp(log_w - log_w.max())
    w /= w.sum()
    x = np.cos(theta)[::-1].copy()
    return x, w[::-1].copy()


@lru_cache(maxsize=None)
def _lloyd_max(dim: int, bits: int) -> tuple[tuple[float, ...], float]:
    x, w = _grid(dim)
    cw = np.concatenate([[0.0], np.cumsum(w)])
    cwx = np.concatenate([[0.0], np.cumsum(w * x)])
    n = 1 << bits
    # Start from equal-probability cells: a good guess that makes convergence quick.
    cuts = np.searchsorted(cw, np.arange(1, n) / n)
    centroids = _cell_means(np.concatenate([[0], cuts, [len(x)]]), cw, cwx)
    for _ in range(_MAX_ITERS):
        bounds = 0.5 * (centroids[1:] + centroids[:-1])
        idx = np.concatenate([[0], np.searchsorted(x, bounds), [len(x)]])
        new = _cell_means(idx, cw, cwx, fallback=centroids)
        new = 0.5 * (new - new[::-1])  # the density is symmetric: keep the codebook symmetric
        done = np.max(np.abs(new - centroids)) < _TOL
        centroids = new
        if done:
            break
    bounds = 0.5 * (centroids[1:] + centroids[:-1])
    cell = np.searchsorted(bounds, x)
    mse = float(dim * np.sum(w * (x - centroids[cell]) ** 2))
    return tuple(float(c) for c in centroids), mse


def _cell_means(idx: np.ndarray, cw: np.ndarray, cwx: np.ndarray, fallback: np.ndarray | None = None) -> np.ndarray:
    mass = cw[idx[1:]] - cw[idx[:-1]]
    first = cwx[idx[1:]] - cwx[idx[:-1]]
    with np.errstate(invalid="ignore", divide="ignore"):
        means = first / mass
    if fallback is not None:
        means = np.where(mass > 0, means, fallback)
    return means


def lloyd_max_codebook(dim: int, bits: int) -> torch.Tensor:
    """Centroids (float32, ascending, 2**bits of them) for a coordinate of a random unit vector in R^dim."""
    _check(dim, bits)
    return torch.tensor(_lloyd_max(dim, bits)[0], dtype=torch.float32)


def lloyd_max_mse(dim: int, bits: int) -> float:
    """Expected ||u - u_hat||^2 of a unit vector quantized coordinate-wise with that codebook."""
    _check(dim, bits)
    return _lloyd_max(dim, bits)[1]


def codebook_boundaries(codebook: torch.Tensor) -> torch.Tensor:
    """Decision boundaries (midpoints between neighbouring centroids) for ``torch.bucketize``."""
    return 0.5 * (codebook[1:] + codebook[:-1])
