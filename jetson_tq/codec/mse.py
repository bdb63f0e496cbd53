"""TurboQuant_mse: rotate, quantize each coordinate with the Lloyd-Max codebook, keep the norm."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ShapeError, expect_float, expect_last_dim
from .codebook import codebook_boundaries, key_codebook
from .packing import pack_bits, unpack_bits
from .rotation import Rotation


@dataclass
class MSECode:
    """Packed TurboQuant_mse code of vectors shaped [..., dim]."""

    idx: torch.Tensor  # uint8 [..., ceil(dim*bits/8)], LSB-first packed codebook indices
    norm: torch.Tensor  # [...] norm_dtype, ||x||
    dtype: torch.dtype  # dtype of the vectors that were quantized

    @property
    def shape(self) -> torch.Size:
        return self.norm.shape


def norm_and_unit(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(||x|| [...], x / ||x|| [..., dim]) in float32 of float vectors x [..., dim] (named errors otherwise): what
    both TurboQuant quantizers code; a zero vector stays zero (its norm clamped to fp32's smallest normal)."""
    expect_float("x", x)
    expect_last_dim("x", x, dim)
    xf = x.float()
    norm = xf.norm(dim=-1)
    return norm, xf / norm.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)


class TurboQuantMSE:
    """b-bit TurboQuant_mse (paper Alg. 1) for vectors of any norm: x ~ ||x|| Pi^T c[idx].

    ``codebook``: ``lloyd_max`` (the paper's) or ``uniform`` (an evenly spaced grid, see ``codebook``).
    """

    def __init__(
        self,
        dim: int,
        bits: int,
        seed: int = 0,
        rotation: str = "auto",
        norm_dtype: torch.dtype = torch.float32,
        codebook: str = "lloyd_max",
    ) -> None:
        self.dim, self.bits, self.norm_dtype = dim, bits, norm_dtype
        self.codebook = key_codebook(codebook, dim, bits)
        self.boundaries = codebook_boundaries(self.codebook)
        self.rotation = Rotation(dim, rotation, seed)

    def _on(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return t if t.device == device else t.to(device)

    def quantize_unit_rotated(self, y: torch.Tensor) -> torch.Tensor:
        """Codebook indices (uint8, unpacked) of already-rotated unit vectors y."""
        return torch.bucketize(y.contiguous(), self._on(self.boundaries, y.device)).to(torch.uint8)

    def centroids(self, idx: torch.Tensor) -> torch.Tensor:
        """c[idx] in float32: the rotated-space reconstruction of a unit vector."""
        return self._on(self.codebook, idx.device)[idx.long()]

    def quantize(self, x: torch.Tensor) -> MSECode:
        norm, unit = norm_and_unit(x, self.dim)
        idx = self.quantize_unit_rotated(self.rotation.apply(unit))
        return MSECode(idx=pack_bits(idx, self.bits), norm=norm.to(self.norm_dtype), dtype=x.dtype)

    def unpack(self, code: MSECode) -> torch.Tensor:
        """Unpacked uint8 indices [..., dim]."""
        return unpack_bits(code.idx, self.bits, self.dim)

    def dequantize(self, code: MSECode) -> torch.Tensor:
        if code.idx.shape[:-1] != code.norm.shape:
            raise ShapeError(
                f"code: idx leading shape {tuple(code.idx.shape[:-1])} != norm shape {tuple(code.norm.shape)}"
            )
        unit = self.rotation.invert(self.centroids(self.unpack(code)))
        return (unit * code.norm.float().unsqueeze(-1)).to(code.dtype)
