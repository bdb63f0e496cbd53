"""Bit packing: exact round trips for 1..8 bits, byte counts, odd shapes, bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jetson_tq.codec.packing import pack_bits, unpack_bits
from jetson_tq.errors import DTypeError, FormatError, ShapeError
from jetson_tq.format import packed_bytes


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(1, 70), lead=st.lists(st.integers(1, 4), max_size=3), seed=st.integers(0, 2**31))
def test_round_trip_any_shape(bits, n, lead, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (*lead, n), generator=g).to(torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape == (*lead, packed_bytes(n, bits))
    assert packed.dtype == torch.uint8
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_lsb_first_layout():
    # 3-bit codes 0b101, 0b011, 0b110 -> stream bits (LSB first): 101 110 011 -> byte0 = 0b10_011_101
    codes = torch.tensor([0b101, 0b011, 0b110], dtype=torch.uint8)
    packed = pack_bits(codes, 3)
    assert packed.tolist() == [0b10011101, 0b1]
    assert pack_bits(torch.tensor([1, 0, 1, 1, 0, 0, 0, 1, 1], dtype=torch.uint8), 1).tolist() == [0b10001101, 1]
    assert pack_bits(torch.tensor([3, 0, 1, 2], dtype=torch.uint8), 2).tolist() == [0b10010011]


def test_bad_input_is_named():
    with pytest.raises(FormatError):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 9)
    with pytest.raises(DTypeError):
        pack_bits(torch.zeros(4, dtype=torch.int32), 2)
    with pytest.raises(ShapeError):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 2, 16)
