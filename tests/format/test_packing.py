"""The planar packed layout ``format.py`` names (``PACKING``): round trips and where each code lands."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jetson_tq.codec.packing import pack_bits, unpack_bits
from jetson_tq.errors import DTypeError, FormatError, ShapeError
from jetson_tq.format import PACKING, KVFormat, packed_bytes, subfield_widths


@pytest.mark.parametrize("n", [1, 7, 8, 50, 64, 80, 96, 100, 128, 256])
@pytest.mark.parametrize("bits", range(1, 9))
def test_round_trip_and_size(n, bits):
    codes = torch.randint(0, 2**bits, (3, 5, n), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape == (3, 5, packed_bytes(n, bits)) == (3, 5, (n + 7) // 8 * bits)
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_planar_positions():
    """2-bit codes, D=128: byte u holds coordinates u, u+32, u+64, u+96 at bits 0, 2, 4, 6."""
    assert PACKING == "planar"
    codes = torch.zeros(1, 128, dtype=torch.uint8)
    codes[0, 33], codes[0, 96] = 3, 1
    packed = pack_bits(codes, 2)[0]
    assert packed.nonzero().flatten().tolist() == [0, 1]
    assert int(packed[1]) == 3 << 2 and int(packed[0]) == 1 << 6
    signs = torch.zeros(1, 128, dtype=torch.uint8)
    signs[0, 17] = 1  # 1-bit plane: byte 17 % 16 = 1, bit 17 // 16 = 1
    assert pack_bits(signs, 1)[0].nonzero().flatten().tolist() == [1] and int(pack_bits(signs, 1)[0, 1]) == 2


def test_subfields_of_odd_widths():
    """3-bit codes: low 2 bits in a 2-bit run, the high bit in a 1-bit run after it."""
    assert subfield_widths(3) == (2, 1) and subfield_widths(7) == (4, 2, 1) and subfield_widths(8) == (8,)
    codes = torch.zeros(1, 16, dtype=torch.uint8)
    codes[0, 5] = 0b110
    packed = pack_bits(codes, 3)[0]  # CH = 2: 2-bit run = bytes 0..3, 1-bit run = bytes 4..5
    assert int(packed[5 % 4]) == 0b10 << (2 * (5 // 4)) and int(packed[4 + 5 % 2]) == 1 << (5 // 2)


def test_reference_bytes_per_token_unchanged():
    blog = KVFormat(key_mode="prod", key_bits=3, value_bits=2, value_group=32)
    assert blog.bytes_per_token(128) == 100
    assert blog.with_(key_bits=4, value_bits=4).bytes_per_token(128) == 148
    assert blog.with_(key_mode="mse").bytes_per_token(128) == 98
    assert KVFormat().bytes_per_token(128) == 122  # the default, mse_k4v3


def test_bad_input():
    with pytest.raises(FormatError):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 9)
    with pytest.raises(DTypeError):
        pack_bits(torch.zeros(4, dtype=torch.int32), 2)
    with pytest.raises(ShapeError):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 2, 16)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.integers(1, 8),
    n=st.integers(0, 70),
    lead=st.lists(st.integers(0, 4), max_size=3),
    seed=st.integers(0, 2**31),
)
def test_round_trip_property_any_shape(bits, n, lead, seed):
    """Property: pack/unpack is exact for every width, length (0 included) and leading shape."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (*lead, n), generator=g).to(torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape == (*lead, packed_bytes(n, bits)) and packed.dtype == torch.uint8
    assert torch.equal(unpack_bits(packed, bits, n), codes)
