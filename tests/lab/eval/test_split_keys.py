"""Split keys (docs/fidelity.md "Which levers, measured"): bytes, pair choice, error vs uniform, the history path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jetson_tq.cache.compressed import CompressedKVCache
from jetson_tq.codec.mse import TurboQuantMSE
from jetson_tq.codec.rotation import derive_seed
from jetson_tq.config import config_from_dict
from jetson_tq.errors import FormatError
from jetson_tq.format import KVFormat, exact_count
from lab.eval.fidelity import Variant
from lab.eval.smartmix import LayerCapture
from lab.eval.split_keys import (
    PairEnergy,
    SplitKeyHistory,
    SplitKeyPlan,
    SplitKeyQuantizer,
    SplitKeys,
    allocate,
    head_key_bytes,
    hi_channels,
    output_weights,
    plan_allocated,
    predicted_errors,
)


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
    fmt = KVFormat(key_mode="mse", key_bits=2, value_mode="fp16", recent_tokens=16, window="block")
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
    old = s - int(exact_count(s, fmt.recent_tokens, True))
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


def _heads(scales, d=64):
    """Pair energies of heads of key scale ``scale`` (one head per scale), their first 4 pairs 4x the others."""
    energy = torch.ones(len(scales), d // 2)
    energy[:, :4] = 4.0
    energy *= torch.tensor(scales)[:, None] ** 2
    return PairEnergy(query=torch.ones_like(energy), key=energy, key_centered=energy)


def test_allocation_keeps_the_mean_and_favours_anisotropic_heads():
    energies = [_heads([1.0, 6.0, 2.0]), _heads([1.0, 1.0, 8.0])]
    spec = SplitKeys(64, 4, 2)
    sizes = allocate(spec, energies, 64, centered=False)
    flat = [n for row in sizes for n in row]
    assert sum(flat) == 64 * len(flat) and all(n % 16 == 0 and 0 <= n <= 128 for n in flat)
    assert sizes[0][1] > sizes[0][0] and sizes[1][2] > sizes[1][0]  # the louder heads get more high channels
    steps = list(range(0, 129, 16))
    err = torch.cat([predicted_errors(spec, e, 64, False, steps) for e in energies])
    got = sum(float(err[i, n // 16]) for i, n in enumerate(flat))
    assert got <= float(err[:, 4].sum())  # never worse than 64 everywhere, by the model
    weighted = allocate(spec, energies, 64, centered=False, key_weight=[torch.tensor([1.0, 1.0, 1.0]), torch.zeros(3)])
    assert sum(map(sum, weighted)) == sum(flat) and weighted[1] == [0, 0, 0]  # a layer whose keys do not matter


def test_allocated_bytes_are_the_mean_over_heads():
    spec = SplitKeys(64, 4, 2)
    assert [head_key_bytes(spec, n, 128) for n in (0, 64, 128)] == [34, 52, 66]  # an empty set has no norm
    plan = SplitKeyPlan(spec, hi=[], sizes=[[0, 128], [64, 64]])
    assert plan.key_bytes_per_token(0, 128) == 50.0 and plan.key_bytes_per_token(1, 128) == 52.0
    raw = {"keys": {"mode": "mse", "bits": 2}, "values": {"mode": "mse", "bits": 3}, "buffer": {"recent_tokens": 256}}
    cfg = config_from_dict(raw, name="split")
    row = Variant("g", "", cfg, split_keys=SplitKeyPlan(spec, hi=[], sizes=[[0, 128], [64, 64]]))
    assert row.bytes_per_token(2, 128) == (50 + 52) / 2 + 50


def test_per_head_sets_of_other_sizes():
    k, _ = _anisotropic(h=3)
    energies = [_heads([1.0, 6.0, 2.0])]
    spec = SplitKeys(64, 4, 2)
    uniform = SplitKeyQuantizer(spec, hi_channels(spec, energies[0], 64, False), seed=5)
    per_head = SplitKeyQuantizer(spec, list(hi_channels(spec, energies[0], 64, False)), seed=5, head_dim=64)
    assert torch.equal(uniform(k), per_head(k))  # one size for all heads: the same codecs
    plan = plan_allocated(spec, energies, 64, False, allocate(spec, energies, 64, centered=False))
    assert plan.sizes is not None and [len(r) for r in plan.hi[0]] == [n // 2 for n in plan.sizes[0]]
    mixed = SplitKeyQuantizer(spec, [torch.arange(0), torch.arange(64), torch.tensor([0, 32])], seed=5, head_dim=64)
    lo = TurboQuantMSE(64, 2, derive_seed(5, salt=2), norm_dtype=torch.float16)
    hi = TurboQuantMSE(64, 4, derive_seed(5, salt=1), norm_dtype=torch.float16)
    out = mixed(k)
    assert torch.allclose(out[:, 0], lo.dequantize(lo.quantize(k[:, 0])).float())  # no high set: one 2-bit set
    assert torch.allclose(out[:, 1], hi.dequantize(hi.quantize(k[:, 1])).float())  # all high


def test_output_weights_count_only_compressed_positions():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 40, 8, generator=g) for n in (4, 2, 2))
    cap = LayerCapture(q=q, k=k, v=v, h=torch.zeros(1, 40, 8))
    weight = output_weights([cap], exact_block=16, sinks=1)
    assert weight[0].shape == (2,) and (weight[0] > 0).all()
    assert output_weights([cap], exact_block=64, sinks=1)[0].abs().sum() == 0  # every position in its own block
