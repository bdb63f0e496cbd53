"""Bit packing of 1..8-bit codes in the planar layout that ``format.py`` names (``PACKING``).

A ``b``-bit code is split into sub-fields of widths ``subfield_widths(b)`` (low code bits first);
each ``w``-bit sub-field of a row is a run of ``CH * w`` bytes (``CH = ceil(n / 8)``) in which
coordinate ``j`` sits in byte ``j % (CH * w)`` at bits ``[(j // (CH * w)) * w, +w)``. So byte ``u``
of a run holds coordinates ``u, u + CH*w, ...``: a kernel gets a contiguous block of coordinates
from one shift and mask of a whole loaded tile. Rows are packed independently along the last dim.
"""

from __future__ import annotations

import torch

from ..errors import DTypeError, FormatError, ShapeError, ValueRangeError, expect_int, expect_tensor
from ..format import MAX_BITS, packed_bytes, subfield_widths


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise FormatError(f"bits: expected an integer in [1, {MAX_BITS}], got {bits!r}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``codes`` (uint8, values < 2**bits) along the last dim into ``ceil(n/8) * bits`` bytes."""
    _check_bits(bits)
    expect_tensor("codes", codes)
    if codes.dtype != torch.uint8:
        raise DTypeError(f"codes: expected uint8, got {codes.dtype}")
    if codes.dim() == 0:
        raise ShapeError("codes: expected at least 1 dimension, got a scalar")
    if bits < MAX_BITS and codes.numel() and int(codes.max()) >= 1 << bits:
        raise ValueRangeError(
            f"codes: expected values < 2**{bits} = {1 << bits} for {bits}-bit packing, "
            f"got {int(codes.max())} (its high bits would be dropped)"
        )
    n = codes.shape[-1]
    ch = (n + 7) // 8
    lead = codes.shape[:-1]
    padded = torch.nn.functional.pad(codes, (0, 8 * ch - n)).to(torch.int32)
    runs, low = [], 0
    for w in subfield_widths(bits):
        part = (padded >> low) & ((1 << w) - 1)  # [..., 8*ch]
        planes = part.reshape(*lead, 8 // w, ch * w)  # plane p = coordinates [p*ch*w, (p+1)*ch*w)
        shifts = (torch.arange(8 // w, device=codes.device, dtype=torch.int32) * w).unsqueeze(-1)
        runs.append((planes << shifts).sum(dim=-2).to(torch.uint8))
        low += w
    return torch.cat(runs, dim=-1)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: ``n`` codes of ``bits`` bits from each packed row (uint8 out)."""
    _check_bits(bits)
    expect_tensor("packed", packed)
    expect_int("n", n)
    if packed.dtype != torch.uint8:
        raise DTypeError(f"packed: expected uint8, got {packed.dtype}")
    if packed.dim() == 0 or packed.shape[-1] != packed_bytes(n, bits):
        raise ShapeError(
            f"packed: expected last dimension {packed_bytes(n, bits)} for {n} codes of {bits} bits, "
            f"got shape {tuple(packed.shape)}"
        )
    ch = (n + 7) // 8
    lead = packed.shape[:-1]
    raw = packed.to(torch.int32)
    codes = torch.zeros(*lead, 8 * ch, dtype=torch.int32, device=packed.device)
    start, low = 0, 0
    for w in subfield_widths(bits):
        run = raw[..., start : start + ch * w].unsqueeze(-2)  # [..., 1, ch*w]
        shifts = (torch.arange(8 // w, device=packed.device, dtype=torch.int32) * w).unsqueeze(-1)
        part = ((run >> shifts) & ((1 << w) - 1)).reshape(*lead, 8 * ch)
        codes |= part << low
        start += ch * w
        low += w
    return codes[..., :n].to(torch.uint8)
