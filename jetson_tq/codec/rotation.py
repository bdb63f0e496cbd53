"""Seeded random rotations (Pi) and the QJL Gaussian sketch matrix (S).

Rotations act on the last dim as ``y = x @ Pi.T``. Two kinds:
- ``dense``: a Haar-random orthogonal matrix (QR of a Gaussian with the sign fix), any d;
- ``hadamard``: Pi = H diag(s) / sqrt(d) with random signs s and a Sylvester Hadamard H, applied
  with the fast Walsh-Hadamard transform in O(d log d); power-of-two d only.
Matrices are generated on the CPU in float64 from a seed, so every device gets the same Pi.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from ..errors import FormatError
from ..format import is_power_of_two
from ..validate import check_allocatable, check_seed

_QJL_SEED_SALT = 0x51A7_C0DE
_VALUE_SEED_SALT = 0x0BAD_5EED


def derive_seed(base: int, layer: int = 0, head: int = 0, salt: int = 0) -> int:
    """A reproducible 63-bit seed for (base seed, layer, head, purpose)."""
    mixed = (base * 1_000_003 + layer * 10_007 + head * 101 + salt) % (2**63 - 1)
    return int(mixed)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(int(seed))


@lru_cache(maxsize=256)
def _haar(dim: int, seed: int) -> torch.Tensor:
    g = torch.randn(dim, dim, generator=_generator(seed), dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


@lru_cache(maxsize=256)
def _signs(dim: int, seed: int) -> torch.Tensor:
    bits = torch.randint(0, 2, (dim,), generator=_generator(seed), dtype=torch.int64)
    return (bits * 2 - 1).to(torch.float64)


@lru_cache(maxsize=64)
def _sylvester(dim: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized fast Walsh-Hadamard transform along the last dim (power-of-two length)."""
    d = x.shape[-1]
    if not is_power_of_two(d):
        raise FormatError(f"fwht: expected a power-of-two last dimension, got {d}")
    lead = x.shape[:-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(*lead, d)


class Rotation:
    """A seeded orthogonal rotation Pi of R^dim: ``apply`` is x -> Pi x, ``invert`` is y -> Pi^T y."""

    def __init__(self, dim: int, kind: str = "auto", seed: int = 0) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise FormatError(f"dim: expected a positive integer, got {dim!r}")
        if kind == "auto":
            kind = "hadamard" if is_power_of_two(dim) else "dense"
        if kind not in ("hadamard", "dense"):
            raise FormatError(f"rotation kind: expected 'auto', 'hadamard' or 'dense', got {kind!r}")
        if kind == "hadamard" and not is_power_of_two(dim):
            raise FormatError(f"rotation 'hadamard' needs a power-of-two dim, got {dim}; use 'dense'")
        # Pi is built as a dim x dim float64 matrix on the CPU (QR of a Gaussian: ~3 of them at once)
        check_allocatable(f"a {kind} rotation of dim {dim}", 3 * dim * dim * 8, torch.device("cpu"))
        self.dim, self.kind, self.seed = dim, kind, check_seed("seed", seed)
        self._cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def matrix64(self) -> torch.Tensor:
        """Pi as a float64 CPU matrix (rows are the rotated basis)."""
        if self.kind == "dense":
            return _haar(self.dim, self.seed)
        return _sylvester(self.dim) * _signs(self.dim, self.seed).unsqueeze(0) / math.sqrt(self.dim)

    def hadamard_signs(self) -> torch.Tensor:
        """The random signs s of Pi = H diag(s) / sqrt(d) (float64, CPU); only for the ``hadamard`` kind."""
        if self.kind != "hadamard":
            raise FormatError(f"hadamard_signs: rotation kind is {self.kind!r}, not 'hadamard'")
        return _signs(self.dim, self.seed)

    def matrix(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Pi on ``device`` in ``dtype`` (cached)."""
        key = (torch.device(device), dtype)
        if key not in self._cache:
            self._cache[key] = self.matrix64().to(device=device, dtype=dtype).contiguous()
        return self._cache[key]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Pi x over the last dim (float32 math for half inputs)."""
        x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        if self.kind == "hadamard":
            signs = _signs(self.dim, self.seed).to(device=x.device, dtype=x.dtype)
            return fwht(x * signs) / math.sqrt(self.dim)
        return x @ self.matrix(x.device, x.dtype).T

    def invert(self, y: torch.Tensor) -> torch.Tensor:
        """Pi^T y over the last dim."""
        y = y.float() if y.dtype in (torch.float16, torch.bfloat16) else y
        if self.kind == "hadamard":
            signs = _signs(self.dim, self.seed).to(device=y.device, dtype=y.dtype)
            return fwht(y) / math.sqrt(self.dim) * signs
        return y @ self.matrix(y.device, y.dtype)


@lru_cache(maxsize=256)
def _gaussian(dim: int, seed: int) -> torch.Tensor:
    return torch.randn(dim, dim, generator=_generator(seed), dtype=torch.float64)


def qjl_matrix(
    dim: int, seed: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The QJL sketch S (dim x dim, i.i.d. N(0, 1)) for ``seed``; the sketch of x is ``x @ S.T``."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise FormatError(f"dim: expected a positive integer, got {dim!r}")
    check_seed("seed", seed)
    check_allocatable(f"a QJL sketch matrix of dim {dim}", 2 * dim * dim * 8, torch.device("cpu"))
    return _gaussian(dim, derive_seed(seed, salt=_QJL_SEED_SALT)).to(device=device, dtype=dtype)


def value_seed(seed: int) -> int:
    """Seed of the value rotation when values use TurboQuant_mse (independent of the key rotation)."""
    return derive_seed(seed, salt=_VALUE_SEED_SALT)
