"""Split keys (docs/fidelity.md "Which levers, measured"): bytes, pair choice, error vs uniform, the history path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jetson_tq.cache.compressed import CompressedKVCache
from jetson_tq.codec.mse import TurboQuantMSE
from jetson_tq.config import config_from_dict
from jetson_tq.errors import FormatError
from jetson_tq.eval.fidelity import Variant
from jetson_tq.eval.split_keys import (
    PairEnergy,
    SplitKeyHistory,
    SplitKeyPlan,
    SplitKeyQuantizer,
    SplitKeys,
    hi_channels,
)
from jetson_tq.format import KVFormat, exact_count


@pytest.mark.parametrize(
    ("split", "d128", "d64"),
    [(SplitKeys(64, 4, 2), 52, 28), (SplitKeys(32, 5, 2), 48, 26), (SplitKeys(48, 4, 2), 48, 26)],
)
def test_key_bytes(split, d128, d64):
    assert split.key_bytes_per_token(128) == d128  # (n_hi b_hi + (128 - n_hi) b_lo) / 8 + 2 fp16 norms
    assert split.key_bytes_per_token(64) == d64
    fmt = KVFormat(key_mode="mse", key_bits=3, value_mode="mse", value_bits=3)
    assert split.format_bytes_per_token(fmt, 128) == d128 + 50  # 3-bit mse values: 48 B codes + 2 B norm


def test_a_split_needs_whole_pairs():
    with pytest.raises(FormatError):
        SplitKeys(63, 4, 2)
    with pytest.raises(FormatError):
        SplitKeys(2, 4, 2).hi_count(64)  # one channel at D=64


def _anisotropic(h=2, d=64, t=400, seed=0):
    """Keys whose first 4 rotary pairs carry 36x the energy of the others, and those energies per pair."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.ones(h, d)
    scale[:, :4] = scale[:, d // 2 : d // 2 + 4] = 6.0
    k = torch.randn(3, h, t, d, generator=g) * scale[None, :, None, :]
    energy = (scale**2)[:, : d // 2] + (scale**2)[:, d // 2 :]
    return k, PairEnergy(query=torch.ones_like(energy), key=energy, key_centered=energy)


def test_high_set_is_the_energetic_pairs_both_channels():
    _, energy = _anisotropic()
    hi = hi_channels(SplitKeys(16, 4, 2, "k"), energy, 64, centered=False)
    assert hi.tolist() == [[0, 1, 2, 3, 32, 33, 34, 35]] * 2


def test_split_error_below_uniform_at_equal_bits():
    k, energy = _anisotropic()
    split = SplitKeys(64, 4, 2, "k")  # 32 of 64 channels at 4 bits, 32 at 2: 3 bits per coordinate, as uniform
    got = SplitKeyQuantizer(split, hi_channels(split, energy, 64, centered=False), seed=0)(k)
    uniform = TurboQuantMSE(64, 3, seed=0, norm_dtype=torch.float16)
    ref = uniform.dequantize(uniform.quantize(k))
    assert ((got - k) ** 2).sum(-1).mean() < 0.7 * ((ref - k) ** 2).sum(-1).mean()


def test_history_reads_split_keys_for_compressed_positions_only():
    fmt = KVFormat(key_mode="mse", key_bits=2, value_mode="fp16", buffer_tokens=16, window="block")
    b, h, d, n = 2, 2, 64, 45
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(b, h, n + 1, d, generator=g), torch.randn(b, h, n + 1, d, generator=g)
    _, energy = _anisotropic(h, d)
    split = SplitKeys(64, 4, 2)
    quantizer = SplitKeyQuantizer(split, hi_channels(split, energy, d, centered=False), seed=3)
    store = CompressedKVCache(fmt, h, d, b, dtype=torch.float32, seed=7)
    hist = SplitKeyHistory(store, 0, quantizer)
    for a, z in ((0, n), (n, n + 1)):  # a prefill, then one decode token
        hist.note_exact(k[:, :, a:z], v[:, :, a:z])
        store.append(k[:, :, a:z], v[:, :, a:z])
    q = torch.randn(b, 3 * h, 1, d, generator=g)
    got = hist.attend(q, None, None, 0.2)
    s = n + 1
    old = s - int(exact_count(s, fmt.buffer_tokens, True))
    keys = torch.cat([quantizer(k[:, :, :old]), k[:, :, old:s]], dim=2)
    values = torch.cat([v[:, :, :old].half().float(), v[:, :, old:s]], dim=2)  # fp16-mode values stored as fp16
    ref = F.scaled_dot_product_attention(q, keys, values, scale=0.2, enable_gqa=True)
    assert 0 < old < s
    assert torch.allclose(got, ref, atol=2e-5), (got - ref).abs().max()


def test_a_split_row_counts_its_own_key_bytes():
    raw = {"keys": {"mode": "mse", "bits": 2}, "values": {"mode": "mse", "bits": 3}, "buffer": {"recent_tokens": 256}}
    cfg = config_from_dict(raw, name="split")
    row = Variant("split", "", cfg, split_keys=SplitKeyPlan(SplitKeys(64, 4, 2), hi=[]))
    assert row.bytes_per_token(30, 128) == 102.0  # 52 B split keys + 50 B mse values
    assert row.bytes_per_token(30, 64) == 28 + 26
    assert row.effective_bytes_per_token(30, 128, 2048) - Variant("u", "", cfg).effective_bytes_per_token(
        30, 128, 2048
    ) == pytest.approx(102 - cfg.default.bytes_per_token(128))
