"""Bit packing of 1..8-bit codes into an LSB-first byte stream (the layout ``format.py`` names).

Code ``j`` of a row occupies bits ``[j*bits, (j+1)*bits)`` of the row's stream; bit ``i`` of the
stream is bit ``i % 8`` of byte ``i // 8``. Rows are packed independently along the last dim.
"""

from __future__ import annotations

import torch

from ..errors import DTypeError, FormatError, ShapeError
from ..format import MAX_BITS, packed_bytes


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise FormatError(f"bits: expected an integer in [1, {MAX_BITS}], got {bits!r}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``codes`` (uint8, values < 2**bits) along the last dim into ``ceil(n*bits/8)`` bytes."""
    _check_bits(bits)
    if codes.dtype != torch.uint8:
        raise DTypeError(f"codes: expected uint8, got {codes.dtype}")
    if codes.dim() == 0:
        raise ShapeError("codes: expected at least 1 dimension, got a scalar")
    n = codes.shape[-1]
    if bits == 8:
        return codes.contiguous()
    shifts = torch.arange(bits, device=codes.device, dtype=torch.uint8)
    stream = ((codes.unsqueeze(-1) >> shifts) & 1).reshape(*codes.shape[:-1], n * bits)
    nbytes = packed_bytes(n, bits)
    pad = nbytes * 8 - n * bits
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int32)).to(torch.uint8)
    octets = stream.reshape(*codes.shape[:-1], nbytes, 8)
    return (octets * weights).sum(dim=-1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: ``n`` codes of ``bits`` bits from each packed row (uint8 out)."""
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise DTypeError(f"packed: expected uint8, got {packed.dtype}")
    if packed.dim() == 0 or packed.shape[-1] != packed_bytes(n, bits):
        raise ShapeError(
            f"packed: expected last dimension {packed_bytes(n, bits)} for {n} codes of {bits} bits, "
            f"got shape {tuple(packed.shape)}"
        )
    if bits == 8:
        return packed.contiguous()
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    stream = ((packed.unsqueeze(-1) >> shifts) & 1).reshape(*packed.shape[:-1], packed.shape[-1] * 8)[..., : n * bits]
    weights = (1 << torch.arange(bits, device=packed.device, dtype=torch.int32)).to(torch.uint8)
    groups = stream.reshape(*packed.shape[:-1], n, bits)
    return (groups * weights).sum(dim=-1, dtype=torch.int32).to(torch.uint8)
