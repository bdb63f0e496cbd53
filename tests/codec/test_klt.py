"""Transform-coded keys (codec.klt): bit-stream packing, nearest-level coding, RoPE, files, named errors."""

from __future__ import annotations

import pytest
import torch

from jetson_tq.codec.klt import (
    KeyTransform,
    KeyTransformCoder,
    RotaryParams,
    code_offsets,
    codes_in_one_byte,
    load_transforms,
    save_transforms,
    spread_transform,
)
from jetson_tq.codec.kv import KVCodec
from jetson_tq.errors import ConfigError, FormatError, ShapeError
from jetson_tq.format import KVFormat, PagedLayout, kernel_unsupported_reason
from tests.helpers.klt_cases import uneven_transform


def random_transform(h: int, d: int, code_bits: int, seed: int = 0, rotary_dim: int | None = None) -> KeyTransform:
    """A valid calibrated-like transform (``klt_cases.uneven_transform``) with RoPE attention scaling 1.25."""
    return uneven_transform(h, d, code_bits, rotary_dim or d, 1.25, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("h,d,bits", [(2, 64, 208), (3, 40, 131), (1, 128, 416), (2, 16, 128)])
def test_pack_unpack_round_trip(h, d, bits):
    t = random_transform(h, d, bits, seed=d)
    coder = KeyTransformCoder(t, (bits + 7) // 8)
    g = torch.Generator().manual_seed(1)
    codes = (torch.rand(5, 7, h, d, generator=g) * (1 << t.bits)).long()
    packed = coder._pack(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 7, h, (bits + 7) // 8)
    assert torch.equal(coder._unpack(packed), codes)


def test_nearest_level_matches_searchsorted():
    t = random_transform(2, 32, 100, seed=3)
    coder = KeyTransformCoder(t, 13)
    z = torch.randn(50, 2, 32) * 3
    got = coder._nearest_level(z)
    for h in range(2):
        for c in range(32):
            n = 1 << int(t.bits[h, c])
            lv = t.levels[h, c, :n]
            want = torch.searchsorted(((lv[1:] + lv[:-1]) / 2).contiguous(), z[:, h, c].contiguous())
            assert torch.equal(got[:, h, c], want), (h, c)


def test_round_trip_is_the_transform_coder():
    """dequantize(quantize(k)) = s R_p (m + B levels[nearest(A (R_p^-1 k / s - m))]), head axis anywhere."""
    t = random_transform(2, 32, 96, seed=5, rotary_dim=24)
    coder = KeyTransformCoder(t, 12)
    k = torch.randn(3, 2, 10, 32)  # [B, H, T, D]
    pos = torch.arange(100, 110)
    got = coder.dequantize(coder.quantize(k, pos, 1), pos, 1)
    kk = k.permute(0, 2, 1, 3)  # [B, T, H, D]
    pre = t.rotary.apply(kk, pos[:, None].expand(10, 2), inverse=True) - t.mean
    z = torch.einsum("hij,...hj->...hi", t.encode, pre)
    zq = t.levels.expand(*z.shape, -1).gather(-1, coder._nearest_level(z).unsqueeze(-1))[..., 0]
    want = t.rotary.apply(torch.einsum("hij,...hj->...hi", t.decode, zq) + t.mean, pos[:, None].expand(10, 2))
    torch.testing.assert_close(got, want.permute(0, 2, 1, 3), rtol=0, atol=1e-6)
    flat = coder.quantize(kk.reshape(30, 2, 32), pos.repeat(3)[:, None], -2)  # [N, H, D]: the write path's layout
    assert torch.equal(flat.reshape(3, 10, 2, -1).permute(0, 2, 1, 3), coder.quantize(k, pos, 1))


def test_rotary_inverse_partial_and_scaled():
    rot = RotaryParams(1.0 / (500 ** (torch.arange(0, 12, 2).float() / 12)), 0.8)
    x = torch.randn(4, 7, 20)
    pos = torch.arange(7) * 37
    y = rot.apply(x, pos)
    torch.testing.assert_close(y[..., 12:], x[..., 12:], rtol=0, atol=0)  # past rotary_dim: untouched
    torch.testing.assert_close(y[..., :12].norm(dim=-1), 0.8 * x[..., :12].norm(dim=-1))
    torch.testing.assert_close(rot.apply(y, pos, inverse=True), x, rtol=1e-5, atol=1e-6)


def test_format_and_codec():
    fmt = KVFormat(key_mode="klt", key_code_bytes=52, value_mode="mse", value_bits=3, recent_tokens=256)
    assert fmt.bytes_per_token(128) == 102 and fmt.key_bytes_per_token(64) == 26 and fmt.key_code_bits(80) == 260
    assert kernel_unsupported_reason(PagedLayout(fmt, 64, 16)) is None  # the kernels serve klt keys and mse values
    with pytest.raises(FormatError, match="key_code_bytes"):
        KVFormat(key_mode="klt")
    with pytest.raises(FormatError, match="only key_mode 'klt'"):
        KVFormat(key_code_bytes=52)
    with pytest.raises(FormatError, match="no code bits"):
        KVFormat(key_mode="klt", key_code_bytes=1).check_head_dim(8)
    with pytest.raises(ConfigError, match="calibrated key transform"):
        KVCodec(fmt, 64)
    codec = KVCodec(fmt, 64, key_transform=spread_transform(2, 64, 208))
    k = torch.randn(6, 2, 64)
    with pytest.raises(ShapeError, match="positions and head_axis"):
        codec.encode(k, k)
    fields = codec.encode(k, k, torch.arange(6)[:, None], 1)
    assert set(fields) == {f.name for f in fmt.fields(64)} and fields["key_code"].shape == (6, 2, 26)
    with pytest.raises(ShapeError, match="KV heads"):
        codec.encode(torch.randn(6, 3, 64), torch.randn(6, 3, 64), torch.arange(6)[:, None], 1)
    with pytest.raises(ShapeError, match="broadcast"):
        codec.encode(k, k, torch.arange(5)[:, None], 1)
    with pytest.raises(ConfigError, match="head dim"):
        KVCodec(fmt, 32, key_transform=spread_transform(2, 64, 208))
    with pytest.raises(ConfigError, match="spends"):
        KVCodec(fmt, 64, key_transform=spread_transform(2, 64, 300))


def test_transform_validation():
    good = spread_transform(2, 16, 40)
    fields = dict(mean=good.mean, encode=good.encode, decode=good.decode, bits=good.bits, levels=good.levels)
    bad_bits = good.bits.clone()
    bad_bits[1, 0] += 1
    with pytest.raises(ConfigError, match="same bits"):
        KeyTransform(**{**fields, "bits": bad_bits}, rotary=good.rotary)
    unsorted = good.levels.clone()
    unsorted[0, 0, :2] = torch.tensor([1.0, -1.0])
    with pytest.raises(ConfigError, match="sorted"):
        KeyTransform(**{**fields, "levels": unsorted}, rotary=good.rotary)
    nan = good.decode.clone()
    nan[0, 0, 0] = float("nan")
    with pytest.raises(ConfigError, match="non-finite"):
        KeyTransform(**{**fields, "decode": nan}, rotary=good.rotary)
    with pytest.raises(ConfigError, match="shape"):
        KeyTransform(**{**fields, "encode": good.encode[:, :8]}, rotary=good.rotary)
    with pytest.raises(ConfigError, match="rotary dim"):
        KeyTransform(**fields, rotary=RotaryParams(torch.ones(9)))


def test_file_round_trip_and_errors(tmp_path):
    layers = [random_transform(2, 16, 40, seed=i) for i in range(3)]
    path = tmp_path / "kt" / "model.pt"
    save_transforms(path, [layers[0], None, layers[2]], {"model": "m"})
    got, meta = load_transforms(path)
    assert meta == {"model": "m"} and got[1] is None
    for a, b in ((layers[0], got[0]), (layers[2], got[2])):
        assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("mean", "encode", "decode", "bits", "levels"))
        assert torch.equal(a.rotary.inv_freq, b.rotary.inv_freq) and a.rotary.attention_scaling == 1.25
    with pytest.raises(ConfigError, match="not found.*calibrate"):
        load_transforms(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match="not readable"):
        load_transforms(tmp_path / "junk.pt")
    torch.save({"kind": "other"}, str(tmp_path / "other.pt"))
    with pytest.raises(ConfigError, match="not a jetson_tq key transform"):
        load_transforms(tmp_path / "other.pt")


# ---------------------------------------------------------------------------------------------- code layout
def test_code_offsets_tile_the_stream_and_keep_byte_widths_in_one_byte():
    """Codes are laid out widest first: each bit of the stream belongs to one code, and codes of 1, 2, 4 or 8 bits
    (any order of coefficients) never straddle a byte; other widths may."""
    g = torch.Generator().manual_seed(3)
    for widths in ((0, 1, 2, 4, 8), (0, 3, 5, 6, 7, 8)):
        bits = torch.tensor(widths)[torch.randint(0, len(widths), (4, 96), generator=g)]
        off = code_offsets(bits)
        for h in range(4):
            owner = torch.zeros(int(bits[h].sum()), dtype=torch.long)
            for c in range(96):
                owner[int(off[h, c]) : int(off[h, c] + bits[h, c])] += 1
            assert bool((owner == 1).all()), "every stream bit belongs to exactly one code"
        assert codes_in_one_byte(bits) == (widths == (0, 1, 2, 4, 8))


def test_cubic_levels_are_recognised_and_reproduced():
    """``KeyTransform.cubic_levels``: levels that are a cubic of the centered code u = 2c - (2^bits - 1) give back
    coefficients that reproduce every used level; levels of 3+ bits sorted at random are no cubic (None); 1- and
    2-bit levels always are one (two and four points)."""
    g = torch.Generator().manual_seed(5)
    t = uneven_transform(2, 48, 160, 48, 1.0, g, cubic=True)
    coef = t.cubic_levels()
    assert coef is not None and coef.shape == (2, 48, 4)
    for h in range(2):
        for c in range(48):
            n = 1 << int(t.bits[h, c])
            u = 2 * torch.arange(n, dtype=torch.float64) - (n - 1)
            got = coef[h, c, 0] + u * coef[h, c, 1] + u**2 * coef[h, c, 2] + u**3 * coef[h, c, 3]
            assert torch.allclose(got, t.levels[h, c, :n].double(), atol=1e-5), (h, c)
    assert uneven_transform(2, 48, 160, 48, 1.0, g).cubic_levels() is None  # widths up to 8, random levels
    low = uneven_transform(2, 48, 64, 48, 1.0, g, widths=(2, 1, 0))
    assert low.cubic_levels() is not None


def test_calibrated_sink_is_what_position_0_decodes_to(tmp_path):
    """A transform with a calibrated sink: the codec decodes position 0's key and value as the sink's (whatever was
    coded there), every other position as before; the sink survives the file; half a sink, a wrong shape, a
    non-finite entry or a sink beside exact sink tokens are named errors."""
    from dataclasses import replace

    from tests.helpers.klt_cases import with_sink

    fmt = KVFormat(key_mode="klt", key_code_bytes=20, value_mode="mse", value_bits=3, recent_tokens=16)
    plain_t = random_transform(2, 32, 40, seed=4)
    sunk_t = with_sink(plain_t, torch.Generator().manual_seed(5))
    plain, sunk = KVCodec(fmt, 32, key_transform=plain_t), KVCodec(fmt, 32, key_transform=sunk_t)
    assert sunk.has_sink and not plain.has_sink
    k, v = torch.randn(3, 2, 5, 32), torch.randn(3, 2, 5, 32)  # [B, H, T, D]: positions 0-4 on axis 2
    pos = torch.arange(5)
    fields = plain.encode(k, v, pos, 1)
    for decode in ("decode_keys", "decode_values"):
        a = getattr(plain, decode)(fields, pos, 1)
        b = getattr(sunk, decode)(fields, pos, 1)
        assert torch.equal(a[:, :, 1:], b[:, :, 1:])
        want = sunk_t.sink_key if decode == "decode_keys" else sunk_t.sink_value
        assert torch.equal(b[:, :, 0], want.expand(3, -1, -1))
    with pytest.raises(ShapeError, match="positions and head_axis"):
        sunk.decode_values(fields)
    path = tmp_path / "sink.pt"
    save_transforms(path, [sunk_t, plain_t], {})
    got, _ = load_transforms(path)
    assert got[0] is not None and got[1] is not None
    assert torch.equal(got[0].sink_key, sunk_t.sink_key) and torch.equal(got[0].sink_value, sunk_t.sink_value)
    assert not got[1].has_sink
    with pytest.raises(ConfigError, match="both sink_key and sink_value"):
        replace(plain_t, sink_key=sunk_t.sink_key)
    with pytest.raises(ConfigError, match="sink_value: expected shape"):
        replace(sunk_t, sink_value=sunk_t.sink_value[:, :8])
    bad = sunk_t.sink_key.clone()
    bad[1, 3] = float("inf")
    with pytest.raises(ConfigError, match="sink_key: non-finite"):
        replace(sunk_t, sink_key=bad)
    with pytest.raises(ConfigError, match="keep one"):
        KVCodec(fmt.with_(sink_tokens=1), 32, key_transform=sunk_t)
