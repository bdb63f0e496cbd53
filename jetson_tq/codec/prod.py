"""TurboQuant_prod: (b-1)-bit TurboQuant_mse plus a 1-bit QJL sketch of the residual (unbiased <q, k>)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import FormatError
from .mse import MSECode, TurboQuantMSE, norm_and_unit
from .packing import pack_bits, unpack_bits
from .rotation import Rotation, qjl_matrix


@dataclass
class ProdCode:
    """Packed TurboQuant_prod code of vectors shaped [..., dim]."""

    idx: torch.Tensor | None  # uint8 packed (b-1)-bit indices, None when b == 1
    signs: torch.Tensor  # uint8 [..., ceil(dim/8)], packed sign(S r), bit 1 = +1
    norm: torch.Tensor  # [...] ||x||
    rnorm: torch.Tensor  # [...] ||r||, residual norm in the units of x
    dtype: torch.dtype


class TurboQuantProd:
    """b-bit TurboQuant_prod (paper Alg. 2).

    <q, x~> = ||x|| <Pi q, c[idx]> + sqrt(pi/2)/d * ||r|| * <S q, sign(S r)>, with r = x - x_mse,
    is an unbiased estimate of <q, x>; ``dequantize`` returns the x~ that gives it.
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
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
            raise FormatError(f"bits: expected an integer in [1, 8] (1 QJL bit + b-1 MSE bits), got {bits!r}")
        self.dim, self.bits, self.norm_dtype = dim, bits, norm_dtype
        self.mse = TurboQuantMSE(dim, bits - 1, seed, rotation, norm_dtype, codebook) if bits > 1 else None
        self.rotation = self.mse.rotation if self.mse else Rotation(dim, rotation, seed)
        self.seed = seed
        self.qjl_scale = math.sqrt(math.pi / 2) / dim

    def sketch_matrix(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """S, so that the sketch of x is ``x @ S.T``."""
        return qjl_matrix(self.dim, self.seed, device, dtype)

    def quantize(self, x: torch.Tensor) -> ProdCode:
        norm, unit = norm_and_unit(x, self.dim)
        if self.mse is not None:
            idx = self.mse.quantize_unit_rotated(self.rotation.apply(unit))
            residual = unit - self.rotation.invert(self.mse.centroids(idx))
            packed_idx = pack_bits(idx, self.mse.bits)
        else:
            residual, packed_idx = unit, None
        sketch = residual @ self.sketch_matrix(x.device).T
        signs = pack_bits((sketch >= 0).to(torch.uint8), 1)
        rnorm = norm * residual.norm(dim=-1)
        return ProdCode(
            idx=packed_idx, signs=signs, norm=norm.to(self.norm_dtype), rnorm=rnorm.to(self.norm_dtype), dtype=x.dtype
        )

    def unpack_signs(self, code: ProdCode) -> torch.Tensor:
        """QJL signs as float32 +-1 [..., dim]."""
        return unpack_bits(code.signs, 1, self.dim).float() * 2 - 1

    def mse_part(self, code: ProdCode) -> torch.Tensor:
        """x_mse in float32 (zeros when b == 1)."""
        if self.mse is None:
            return torch.zeros(*code.norm.shape, self.dim, device=code.norm.device)
        assert code.idx is not None  # a prod code carries MSE indices whenever b > 1
        return self.mse.dequantize(MSECode(code.idx, code.norm, torch.float32))

    def dequantize(self, code: ProdCode) -> torch.Tensor:
        qjl = self.unpack_signs(code) @ self.sketch_matrix(code.signs.device)
        x = self.mse_part(code) + self.qjl_scale * code.rnorm.float().unsqueeze(-1) * qjl
        return x.to(code.dtype)
