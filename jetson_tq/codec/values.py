"""Low-bit asymmetric group quantization of values: per token, per group of G coordinates, scale/zero in fp16."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import FormatError, ShapeError, expect_float, expect_last_dim
from .packing import pack_bits, unpack_bits


@dataclass
class GroupCode:
    """Packed group-quantized vectors [..., dim]: x ~ codes * scale + zero per group."""

    codes: torch.Tensor  # uint8 [..., ceil(dim*bits/8)]
    scale: torch.Tensor  # fp16 [..., dim/group]
    zero: torch.Tensor  # fp16 [..., dim/group]
    dtype: torch.dtype


class GroupQuantizer:
    """b-bit min/max quantization per group; scale and zero are rounded to fp16 before coding."""

    def __init__(self, dim: int, bits: int, group: int) -> None:
        if group < 1 or dim % group != 0:
            raise FormatError(f"group size {group} must divide dim {dim}")
        if not 1 <= bits <= 8:
            raise FormatError(f"bits: expected an integer in [1, 8], got {bits!r}")
        self.dim, self.bits, self.group = dim, bits, group
        self.levels = (1 << bits) - 1

    def quantize(self, x: torch.Tensor) -> GroupCode:
        expect_float("x", x)
        expect_last_dim("x", x, self.dim)
        g = x.float().reshape(*x.shape[:-1], self.dim // self.group, self.group)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        zero = lo.to(torch.float16)
        scale = ((hi - zero.float()) / self.levels).to(torch.float16)
        safe = torch.where(scale.float() > 0, scale.float(), torch.ones_like(lo))
        q = torch.round((g - zero.float().unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, self.levels)
        codes = pack_bits(q.to(torch.uint8).reshape(*x.shape[:-1], self.dim), self.bits)
        return GroupCode(codes=codes, scale=scale, zero=zero, dtype=x.dtype)

    def dequantize(self, code: GroupCode) -> torch.Tensor:
        if code.scale.shape != code.zero.shape or code.scale.shape[-1] != self.dim // self.group:
            raise ShapeError(
                f"code: scale {tuple(code.scale.shape)} / zero {tuple(code.zero.shape)} do not fit "
                f"dim {self.dim} in groups of {self.group}"
            )
        q = unpack_bits(code.codes, self.bits, self.dim).float()
        g = q.reshape(*q.shape[:-1], self.dim // self.group, self.group)
        x = g * code.scale.float().unsqueeze(-1) + code.zero.float().unsqueeze(-1)
        return x.reshape(*q.shape).to(code.dtype)
