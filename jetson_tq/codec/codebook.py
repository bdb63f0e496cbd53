"""Lloyd-Max codebooks for one coordinate of a uniformly random unit vector in R^d.

The coordinate x = cos(theta) of a uniform point on the sphere S^(d-1) has density proportional
to (1 - x^2)^((d-3)/2) on [-1, 1] (a shifted Beta((d-1)/2, (d-1)/2)); in theta that is
sin(theta)^(d-2) on [0, pi], which is smooth for every d >= 2, so we integrate on a theta grid.
Lloyd's algorithm (cells = midpoints, centroids = conditional means) then runs on prefix sums, so
an iteration costs O(2^bits log M), not O(M).

The ``uniform`` codebook is the evenly spaced grid c[k] = (k - (2^bits - 1)/2) * step whose step
minimizes the same expected squared error (nearest-centroid cells): affine in k, so a kernel can
score <q, c[idx]> = step * <q, idx> - step (2^bits - 1)/2 * sum(q) with idx read as a bit plane.
At 4 bits and d = 128 its MSE is 0.0112 against Lloyd-Max's 0.0093 (+20 %).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from ..errors import FormatError
from ..format import KEY_CODEBOOKS, MAX_BITS

_GRID_POINTS = 1 << 20
_MAX_ITERS = 20000
_TOL = 1e-12


def _check(dim: int, bits: int) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2:
        raise FormatError(f"dim: expected an integer >= 2, got {dim!r}")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise FormatError(f"bits: expected an integer in [1, {MAX_BITS}], got {bits!r}")


@cache
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


@cache
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


def _uniform_levels(bits: int) -> np.ndarray:
    n = 1 << bits
    return np.arange(n, dtype=np.float64) - (n - 1) / 2


@cache
def _prefix_moments(dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The grid's x and prefix sums of w, w x, w x^2 (so a cell's error costs two lookups)."""
    x, w = _grid(dim)
    zero = np.zeros(1)
    return (
        x,
        np.concatenate([zero, np.cumsum(w)]),
        np.concatenate([zero, np.cumsum(w * x)]),
        np.concatenate([zero, np.cumsum(w * x * x)]),
    )


def _grid_mse(dim: int, centroids: np.ndarray) -> float:
    """dim * E[(x - nearest centroid)^2] for a coordinate of a random unit vector in R^dim."""
    x, cw, cwx, cwx2 = _prefix_moments(dim)
    idx = np.concatenate([[0], np.searchsorted(x, 0.5 * (centroids[1:] + centroids[:-1])), [len(x)]])
    m0, m1, m2 = (np.diff(c[idx]) for c in (cw, cwx, cwx2))
    return float(dim * np.sum(m2 - 2 * centroids * m1 + centroids**2 * m0))


@cache
def _uniform(dim: int, bits: int) -> tuple[tuple[float, ...], float]:
    levels = _uniform_levels(bits)
    sigma = 1.0 / np.sqrt(dim)  # a coordinate's standard deviation
    lo, hi = 1e-3 * sigma, 4.0 * sigma
    # golden-section search of the step (the MSE is unimodal in it), to 1e-9 of sigma
    g = (np.sqrt(5.0) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = _grid_mse(dim, a * levels), _grid_mse(dim, b * levels)
    while hi - lo > 1e-9 * sigma:
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = _grid_mse(dim, a * levels)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = _grid_mse(dim, b * levels)
    step = 0.5 * (lo + hi)
    return tuple(float(c) for c in step * levels), _grid_mse(dim, step * levels)


def uniform_codebook(dim: int, bits: int) -> torch.Tensor:
    """Evenly spaced centroids (float32, ascending) with the MSE-optimal step for a coordinate of a random unit
    vector."""
    _check(dim, bits)
    return torch.tensor(_uniform(dim, bits)[0], dtype=torch.float32)


def uniform_mse(dim: int, bits: int) -> float:
    """Expected ||u - u_hat||^2 of a unit vector quantized coordinate-wise with ``uniform_codebook``."""
    _check(dim, bits)
    return _uniform(dim, bits)[1]


def key_codebook(kind: str, dim: int, bits: int) -> torch.Tensor:
    """The codebook of ``format.KVFormat.key_codebook`` kind ``kind`` (``lloyd_max`` or ``uniform``)."""
    if kind not in KEY_CODEBOOKS:
        raise FormatError(f"codebook kind: expected one of {KEY_CODEBOOKS}, got {kind!r}")
    return uniform_codebook(dim, bits) if kind == "uniform" else lloyd_max_codebook(dim, bits)
