"""KVFormat: byte counts from the packed layout, validation, paged layout."""

import pytest
import torch

from jetson_tq import FP16_FORMAT, KVFormat, PagedLayout, fp16_bytes_per_token
from jetson_tq.codec.kv import KVCodec
from jetson_tq.errors import FormatError


def test_reference_setting_bytes():
    fmt = KVFormat(key_mode="prod", key_bits=3, value_bits=2, value_group=32)
    # keys: 2-bit idx 32 B + signs 16 B + norm 2 + rnorm 2; values: 2-bit 32 B + 4 fp16 scales + 4 fp16 zeros
    assert fmt.breakdown(128) == {
        "key_idx": 32,
        "key_signs": 16,
        "key_norm": 2,
        "key_rnorm": 2,
        "val_codes": 32,
        "val_scale": 8,
        "val_zero": 8,
    }
    assert fmt.bytes_per_token(128) == 100
    assert fmt.compression_ratio(128) == pytest.approx(512 / 100)
    assert fp16_bytes_per_token(128) == 512
    assert FP16_FORMAT.bytes_per_token(128) == 512


def test_odd_bits_and_dims():
    fmt = KVFormat(key_mode="prod", key_bits=4, value_bits=3, value_group=25)
    # D=50, planar packing (ceil(D/8) bytes per bit plane): 3-bit idx 7*3=21, signs 7, norms 4;
    # values 3-bit 21 + 2 groups * (fp16 scale + zero) 8
    assert fmt.bytes_per_token(50) == 21 + 7 + 4 + 21 + 8
    assert KVFormat(key_mode="prod", key_bits=1).key_bytes_per_token(64) == 8 + 4  # no MSE part at 1 bit


def test_bytes_match_what_the_codec_produces():
    for fmt in (
        KVFormat(value_group=16),
        KVFormat(key_mode="mse", key_bits=3, value_group=16),
        KVFormat(value_mode="mse", value_bits=3),
        KVFormat(key_bits=5, value_bits=5, value_group=16),
        KVFormat(key_bits=1, value_group=16, norm_dtype="float32"),
        FP16_FORMAT,
    ):
        for d in (64, 80, 128):
            codec = KVCodec(fmt, d)
            enc = codec.encode(torch.randn(7, d), torch.randn(7, d))
            assert sum(t[0].numel() * t.element_size() for t in enc.values()) == fmt.bytes_per_token(d)
            assert list(enc) == [f.name for f in fmt.fields(d)]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(key_mode="qjl"),
        dict(key_bits=0),
        dict(key_bits=9),
        dict(value_bits=0),
        dict(value_mode="int"),
        dict(rotation="random"),
        dict(norm_dtype="bfloat8"),
        dict(recent_tokens=-1),
        dict(flush_chunk=0),
        dict(key_bits=2.5),
        dict(key_codebook="nf4"),
    ],
)
def test_invalid_formats_raise(kwargs):
    with pytest.raises(FormatError):
        KVFormat(**kwargs)


def test_head_dim_checks():
    assert (
        KVFormat(value_group=32).value_group_for(80) == 20
    )  # 20 divides 80: fitted, not refused (tests/codec/test_head_dims.py)
    with pytest.raises(FormatError, match="not less than fp16"):
        KVFormat(value_group=32).bytes_per_token(37)  # prime: only groups of 1 fit
    with pytest.raises(FormatError, match="power-of-two"):
        KVFormat(rotation="hadamard", value_group=16).bytes_per_token(80)
    assert KVFormat(value_group=16).rotation_for(80) == "dense"
    assert KVFormat().rotation_for(128) == "hadamard"


def test_sequence_bytes_counts_every_token_compressed_plus_the_exact_ring():
    fmt = KVFormat(recent_tokens=128)  # mse_k4v3: 122 B per token and head at D=128
    assert fmt.sequence_bytes(100, 128) == 100 * 122 + 100 * 512
    assert fmt.sequence_bytes(10_000, 128) == 10_000 * 122 + 128 * 512


def test_paged_layout_regions_are_aligned_and_disjoint():
    layout = PagedLayout(KVFormat(), 128, 16)
    offs = layout.offsets()
    sizes = {f.name: f.nbytes * 16 for f in KVFormat().fields(128)}
    ends = sorted((o, o + sizes[n]) for n, o in offs.items())
    assert all(o % 16 == 0 for o in offs.values())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))
    assert layout.page_bytes >= 16 * 122 and layout.page_bytes % 16 == 0
    assert layout.page_bytes == 16 * 122  # every region is already a multiple of 16 B at block 16


def test_window_rule_sliding_and_block():
    """``exact_start`` / ``exact_count``: the one window rule, elementwise on ints, NumPy arrays and tensors."""
    import numpy as np

    from jetson_tq.format import exact_count, exact_start

    pos = [0, 5, 7, 8, 9, 15, 16, 17]
    assert [exact_start(p, 8, False) for p in pos] == [p - 7 for p in pos]
    assert [exact_start(p, 8, True) for p in pos] == [0, 0, 0, 8, 8, 8, 16, 16]
    lens = [0, 1, 7, 8, 9, 16, 17]
    assert [exact_count(n, 8, False) for n in lens] == [0, 1, 7, 8, 8, 8, 8]
    assert [exact_count(n, 8, True) for n in lens] == [0, 1, 7, 8, 1, 8, 1]
    assert [exact_count(n, 0, False) for n in lens] == [0] * len(lens)
    for block in (False, True):  # a sequence of L tokens reads L - max(exact_start(L - 1), 0) of them exactly
        assert [exact_count(n, 8, block) for n in lens[1:]] == [
            n - max(exact_start(n - 1, 8, block), 0) for n in lens[1:]
        ]
        assert exact_count(np.array(lens), 8, block).tolist() == [exact_count(n, 8, block) for n in lens]
        assert exact_count(torch.tensor(lens), 8, block).tolist() == [exact_count(n, 8, block) for n in lens]
        assert exact_start(torch.tensor(pos), 8, block).tolist() == [exact_start(p, 8, block) for p in pos]
    fmt = KVFormat(recent_tokens=8, window="block")
    assert fmt.block_window and fmt.exact_start(13) == 8
    assert not KVFormat(recent_tokens=0, window="block").block_window  # no buffer: nothing exact either way
    with pytest.raises(FormatError, match="window"):
        KVFormat(window="ring")
