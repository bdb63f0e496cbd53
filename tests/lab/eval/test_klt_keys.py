"""KLT keys (benchmarks/NOTES.md "Quality at 5x"): RoPE round trip, bit allocation, coding error, bytes, history."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from jetson_tq.cache.compressed import CompressedKVCache
from jetson_tq.config import config_from_dict
from jetson_tq.errors import FormatError
from jetson_tq.format import KVFormat, exact_count
from lab.eval.fidelity import Variant
from lab.eval.klt_keys import (
    KLTKeyHistory,
    KLTKeys,
    KLTPlan,
    KLTQuantizer,
    allocate_bits,
    block_klt,
    calibrate,
    cubic_levels,
    distortion,
    inv_freq,
    lloyd_levels,
    pair_blocks,
    pair_weight,
    quantize_coefficients,
    quantize_to_levels,
    received_attention,
    rope,
)
from lab.eval.smartmix import LayerCapture

THETA = 1e5


def test_rope_matches_transformers_and_round_trips():
    d, pos = 64, torch.arange(3, 40)
    freq = inv_freq(d, THETA)
    x = torch.randn(2, 3, len(pos), d, generator=torch.Generator().manual_seed(0))
    angle = torch.cat([pos[:, None] * freq[None, :]] * 2, dim=-1)
    ref, _ = apply_rotary_pos_emb(x, x, angle.cos(), angle.sin(), unsqueeze_dim=0)
    assert torch.allclose(rope(x, pos, freq), ref, atol=1e-5)
    back = rope(rope(x.double(), pos, freq), pos, freq, inverse=True)
    assert torch.allclose(back, x.double(), atol=1e-12)


def test_gaussian_lloyd_max_distortions():
    known = [1.0, 0.3634, 0.1175, 0.03455, 0.009500, 0.002505, 0.000644]  # Max (1960) / Lloyd
    for b, ref in enumerate(known):
        assert distortion(b) == pytest.approx(ref, rel=2e-3)
    assert all(distortion(b + 1) < distortion(b) for b in range(8))


def test_allocation_sums_to_the_budget_and_follows_the_variances():
    lam = torch.tensor([100.0, 30.0, 10.0, 1.0, 0.1, 0.01, 0.0, 5.0])
    for budget in (0, 1, 7, 19, 40, 64):
        bits = allocate_bits(lam, budget)
        assert int(bits.sum()) == budget and int(bits.min()) >= 0 and int(bits.max()) <= 8
    bits = allocate_bits(lam, 19)
    order = lam.argsort(descending=True)
    assert (bits[order].diff() <= 0).all()  # more variance, no fewer bits
    assert int(bits[6]) == 0  # a zero-variance coefficient gets nothing
    assert int(allocate_bits(lam, 1000).sum()) == 8 * len(lam)  # capped at 8 bits each


def test_allocation_restricted_to_code_widths():
    """``widths``: only those widths (and 0), the budget spent exactly when the steps fit it, still by variance."""
    lam = torch.linspace(5, 0.01, 64) ** 2
    for widths in ((4, 8), (2, 4, 8), (8,)):
        bits = allocate_bits(lam, 208, widths=widths)
        assert int(bits.sum()) == 208 and set(bits.tolist()) <= {0, *widths}
        assert (bits.diff() <= 0).all()  # the variances fall: so do the widths
    assert int(allocate_bits(lam, 10, widths=(4,)).sum()) == 8  # steps of 4 bits: 2 bits cannot be spent


def test_key_bytes():
    fmt = KVFormat(key_mode="mse", key_bits=3, value_mode="mse", value_bits=3)
    assert KLTKeys(52).code_bits(128) == 416 and KLTKeys(52).key_bytes_per_token(128) == 52
    assert KLTKeys(52).key_bytes_per_token(64) == 26  # code bits in proportion, as split keys count them
    assert KLTKeys(52, token_norm=True).code_bits(128) == 400
    assert KLTKeys(52, token_norm=True).key_bytes_per_token(64) == 25 + 2
    plan = KLTPlan(KLTKeys(52), [], THETA)
    assert plan.format_bytes_per_token(0, fmt, 128) == 102  # + 3-bit mse values, 48 B codes + 2 B norm
    raw = {"keys": {"mode": "mse", "bits": 3}, "values": {"mode": "mse", "bits": 3}, "buffer": {"recent_tokens": 256}}
    row = Variant("klt", "", config_from_dict(raw, name="klt"), klt_keys=plan)
    assert row.bytes_per_token(30, 128) == 102.0
    with pytest.raises(FormatError):
        KLTKeys(1, token_norm=True)  # the scale takes every byte


def _capture(h=2, g=3, d=64, t=300, seed=0) -> LayerCapture:
    """Post-RoPE q, k at positions 0..t-1 of correlated, anisotropic pre-RoPE keys with a mean."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(h, d, d, generator=gen) * torch.logspace(0, -2, d)[None, None, :]
    k_pre = torch.einsum("hij,bhtj->bhti", mix, torch.randn(2, h, t, d, generator=gen)) + 0.5
    q_pre = torch.randn(2, h * g, t, d, generator=gen) * torch.linspace(2, 0.2, d)
    pos, freq = torch.arange(t), inv_freq(d, THETA)
    return LayerCapture(q=rope(q_pre, pos, freq), k=rope(k_pre, pos, freq), v=torch.zeros(2, h, t, d), h=torch.zeros(1))


@pytest.mark.parametrize("attention", [False, True])
def test_coding_error_falls_with_bits(attention):
    cap = _capture()
    pos = torch.arange(cap.k.shape[2])
    errors = []
    for key_bytes in (16, 32, 52, 80):
        spec = KLTKeys(key_bytes, attention=attention)
        layer = calibrate(spec, [cap], 64, THETA)[0]
        assert (layer.bits.sum(-1) == spec.code_bits(64)).all()
        coded = KLTQuantizer(spec, layer, THETA)(cap.k, pos)
        errors.append(float(((coded - cap.k) ** 2).mean()))
    assert all(b < a for a, b in zip(errors, errors[1:])), errors


def test_klt_beats_its_own_budget_spread_evenly():
    cap = _capture()
    pos = torch.arange(cap.k.shape[2])
    spec = KLTKeys(52)
    layer = calibrate(spec, [cap], 64, THETA)[0]
    even = calibrate(spec, [cap], 64, THETA)[0]
    even.bits = torch.full_like(even.bits, spec.code_bits(64) // 64)  # 3.25 -> 3 bits each: fewer bits, no choice
    err = [float(((KLTQuantizer(spec, x, THETA)(cap.k, pos) - cap.k) ** 2).mean()) for x in (layer, even)]
    assert err[0] < 0.5 * err[1]
    assert float(layer.predicted_error().sum()) < float(even.predicted_error().sum())


def test_pair_weight_is_per_rotary_pair():
    q = torch.randn(5000, 64, generator=torch.Generator().manual_seed(2)) * torch.linspace(2, 0.2, 64)
    w = pair_weight(q)
    e = (q.double() ** 2).mean(0)
    assert torch.allclose(w[:32], (e[:32] + e[32:]) / 2) and torch.equal(w[:32], w[32:])


def test_history_reads_klt_keys_for_compressed_positions_only():
    fmt = KVFormat(key_mode="mse", key_bits=2, value_mode="fp16", recent_tokens=16, window="block")
    cap = _capture(h=2, t=200)
    b, h, d, n = 2, 2, 64, 45
    spec = KLTKeys(40, token_norm=True)
    quantizer = KLTQuantizer(spec, calibrate(spec, [cap], d, THETA)[0], THETA)
    k, v = cap.k[:, :, : n + 1].contiguous(), torch.randn(b, h, n + 1, d, generator=torch.Generator().manual_seed(1))
    center = torch.randn(h, d)
    store = CompressedKVCache(fmt, h, d, b, dtype=torch.float32, seed=7)
    hist = KLTKeyHistory(store, 0, quantizer, center)
    kc = k - center[None, :, None, :]  # what a centered layer hands the history
    for a, z in ((0, n), (n, n + 1)):  # a prefill, then one decode token
        hist.note_exact(kc[:, :, a:z], v[:, :, a:z])
        store.append(kc[:, :, a:z], v[:, :, a:z])
    q = torch.randn(b, 3 * h, 1, d)
    got = hist.attend(q, None, None, 0.2)
    s = n + 1
    old = s - int(exact_count(s, fmt.recent_tokens, True))
    coded = quantizer(k[:, :, :old], torch.arange(old)) - center[None, :, None, :]
    keys = torch.cat([coded, kc[:, :, old:s]], dim=2)
    values = torch.cat([v[:, :, :old].half().float(), v[:, :, old:s]], dim=2)  # fp16-mode values stored as fp16
    ref = F.scaled_dot_product_attention(q, keys, values, scale=0.2, enable_gqa=True)
    assert 0 < old < s
    assert torch.allclose(got, ref, atol=2e-5), (got - ref).abs().max()


def test_received_attention_counts_each_query_once():
    cap = _capture(h=2, g=3, t=50)
    got = received_attention(cap, min_distance=0)
    assert got.shape == (2, 2, 50)
    assert torch.allclose(got.sum(-1), torch.full((2, 2), 3.0 * 50, dtype=torch.float64), atol=1e-4)
    far = received_attention(cap, min_distance=10)
    assert (far[..., -10:] == 0).all() and (far <= got + 1e-6).all()  # the last keys have no query 10 later


def test_attention_weighted_calibration_keeps_the_budget():
    cap = _capture()
    spec = KLTKeys(40, token_norm=True, attention=True)
    layer = calibrate(spec, [cap], 64, THETA)[0]
    assert (layer.bits.sum(-1) == spec.code_bits(64)).all()
    coded = KLTQuantizer(spec, layer, THETA)(cap.k, torch.arange(cap.k.shape[2]))
    assert float(((coded - cap.k) ** 2).mean()) < 0.1 * float(cap.k.var())


def test_levels_path_matches_the_gaussian_path_and_lloyd_fits_the_data():
    torch.manual_seed(3)
    z = torch.distributions.Laplace(0.0, 1.0).sample((4000, 6)).double() * torch.tensor([3.0, 2, 1, 1, 0.5, 0.2])
    bits = torch.tensor([4, 3, 3, 2, 1, 0])
    sigma = z.std(0)
    gauss = lloyd_levels(z, torch.ones(4000, dtype=torch.float64), sigma, bits, steps=0)
    fitted = lloyd_levels(z, torch.ones(4000, dtype=torch.float64), sigma, bits)
    x = z.float().T[None, None].permute(0, 1, 3, 2)  # [1, 1, N, D]: one head
    a = quantize_coefficients(x, sigma.float()[None], bits[None])
    b = quantize_to_levels(x, gauss.float()[None], bits[None])
    assert torch.allclose(a, b, atol=1e-5)
    c = quantize_to_levels(x, fitted.float()[None], bits[None])
    err_g, err_f = ((a - x) ** 2).sum((0, 1, 2)), ((c - x) ** 2).sum((0, 1, 2))
    assert (err_f[:5] < err_g[:5]).all()  # heavier tails than the Gaussian: the fitted levels do better
    assert torch.allclose(err_f[5], err_g[5])  # 0 bits: zero either way


def test_cubic_levels_fit_the_data_nearly_as_well_as_lloyd_max():
    """``cubic_levels``: ascending levels that are a cubic of the centered code (the product's ``cubic_levels``
    recognises them), within 10 % of the fitted Lloyd-Max error on Gaussian and Laplacian coefficients at 1-4 bits
    (25 % at 5-6), and well below the error of the best evenly spaced levels at 4-5 bits."""
    from jetson_tq.codec.klt import MAX_CODE_BITS, KeyTransform, RotaryParams

    torch.manual_seed(4)
    n = 20000
    gauss = torch.randn(n, 6, dtype=torch.float64)
    laplace = torch.distributions.Laplace(0.0, 1.0).sample((n, 6)).double()
    bits = torch.tensor([1, 2, 3, 4, 5, 6])
    w = torch.ones(n, dtype=torch.float64)
    uniform_4_5 = {"gauss": (0.01154, 0.00349)}  # Max (1960): the best evenly spaced 4-, 5-bit levels of N(0, 1)
    for name, z in (("gauss", gauss), ("laplace", laplace)):
        sigma = z.std(0)
        cub, ll = cubic_levels(z, w, sigma, bits), lloyd_levels(z, w, sigma, bits)
        x = z.float().T[None, None].permute(0, 1, 3, 2)
        err_c = ((quantize_to_levels(x, cub.float()[None], bits[None]) - x) ** 2).mean((0, 1, 2)) / z.var(0)
        err_l = ((quantize_to_levels(x, ll.float()[None], bits[None]) - x) ** 2).mean((0, 1, 2)) / z.var(0)
        assert (err_c <= torch.tensor([1.1] * 4 + [1.25] * 2, dtype=torch.float64) * err_l).all(), (name, err_c, err_l)
        if name in uniform_4_5:
            assert float(err_c[3]) < 0.9 * uniform_4_5[name][0] and float(err_c[4]) < 0.85 * uniform_4_5[name][1]
        used = torch.arange(1 << MAX_CODE_BITS) < (1 << bits)[:, None]
        assert bool(((cub[:, 1:] - cub[:, :-1] > 0) | ~used[:, 1:]).all()), "used levels ascend"
        eye = torch.eye(6).expand(1, 6, 6)
        t = KeyTransform(torch.zeros(1, 6), eye, eye, bits[None], cub.float()[None], RotaryParams(torch.ones(3)))
        assert t.cubic_levels() is not None


def test_level_kinds_are_named_and_exclusive():
    """The calibration's level kinds: cubic (default) or lloyd; anything else, or both at once, is a named error."""
    from jetson_tq.errors import ConfigError
    from lab.eval.calibrate_keys import DEFAULT_LEVELS, DEFAULT_WIDTHS, calibration_spec

    spec = calibration_spec(52)
    assert (spec.cubic, spec.lloyd, spec.widths, DEFAULT_LEVELS) == (True, False, DEFAULT_WIDTHS, "cubic")
    assert calibration_spec(40, (), "lloyd").lloyd and not calibration_spec(40, (), "lloyd").cubic
    with pytest.raises(ConfigError, match="levels 'uniform'"):
        calibration_spec(52, levels="uniform")
    with pytest.raises(FormatError, match="exclude each other"):
        KLTKeys(52, lloyd=True, cubic=True)


# ---------------------------------------------------------------------------------------------- block-diagonal KLT
def test_pair_blocks_partition_the_head_into_rotary_closed_blocks():
    d = 64
    for block in (2, 8, 16, 32):
        blocks = pair_blocks(d, block)
        assert len(blocks) == d // block and all(len(b) == block for b in blocks)
        assert sorted(torch.cat(blocks).tolist()) == list(range(d))
        for j, b in enumerate(blocks):  # consecutive rotary pairs (c, c + D/2), both channels in one block
            pairs = torch.arange(j * block // 2, (j + 1) * block // 2)
            assert torch.equal(b, torch.cat([pairs, pairs + d // 2]))
    assert torch.equal(pair_blocks(d, 0)[0], torch.arange(d)) and torch.equal(pair_blocks(d, d)[0], torch.arange(d))
    assert [b.tolist() for b in pair_blocks(d, 1)] == [[c] for c in range(d)]
    with pytest.raises(FormatError):
        pair_blocks(d, 12)  # not a divisor of 64
    partial = pair_blocks(80, 2, rotary_dim=40)  # partial rotary: pairs (p, p + 20), then each unrotated channel alone
    assert [b.tolist() for b in partial[:2]] == [[0, 20], [1, 21]] and len(partial) == 20 + 40
    assert [b.tolist() for b in partial[20:22]] == [[40], [41]]
    assert sorted(torch.cat(partial).tolist()) == list(range(80))


def test_block_klt_of_one_block_is_the_full_klt():
    y = torch.randn(300, 16, generator=torch.Generator().manual_seed(6)).double() @ torch.randn(16, 16).double()
    cov = y.T @ y
    lam, u = block_klt(cov, [torch.arange(16)])
    ref_lam, ref_u = torch.linalg.eigh(cov)
    ref_u = ref_u.flip(1)  # each column signed so that its largest-magnitude entry is positive
    ref_u = ref_u * torch.where(ref_u.gather(0, ref_u.abs().argmax(0, keepdim=True)) < 0, -1.0, 1.0).double()
    assert torch.equal(lam, ref_lam.flip(0).clamp_min(0)) and torch.equal(u, ref_u)


# ~6 CPU-s each: the quick lane keeps blocks of 2 pairs (the same calibration code at another block size)
@pytest.mark.parametrize("block", [pytest.param(b, marks=pytest.mark.slow) if b != 2 else b for b in (1, 2, 16)])
def test_block_diagonal_calibration_codes_within_its_blocks(block):
    cap = _capture(h=2, d=64)
    pos = torch.arange(cap.k.shape[2])
    spec = KLTKeys(52, attention=True, lloyd=True, block=block)
    layer = calibrate(spec, [cap], 64, THETA)[0]
    assert (layer.bits.sum(-1) == spec.code_bits(64)).all()  # water-filling over all blocks: the whole budget
    blocks = [set(b.tolist()) for b in pair_blocks(64, block)]
    for h in range(2):
        enc, dec = layer.encode[h], layer.decode[h]
        assert torch.allclose(enc @ dec, torch.eye(64), atol=1e-4)
        for i in range(64):  # each coefficient reads and writes the channels of one block
            read = set(torch.nonzero(enc[i]).squeeze(1).tolist())
            assert read == set(torch.nonzero(dec[:, i]).squeeze(1).tolist())
            assert any(read <= b for b in blocks)
    full = calibrate(KLTKeys(52, attention=True, lloyd=True), [cap], 64, THETA)[0]
    one_block = calibrate(KLTKeys(52, block=64), [cap], 64, THETA)[0]
    assert torch.equal(one_block.decode, calibrate(KLTKeys(52), [cap], 64, THETA)[0].decode)
    err = [float(((KLTQuantizer(spec, x, THETA)(cap.k, pos) - cap.k) ** 2).mean()) for x in (layer, full)]
    assert err[1] <= err[0] < 0.1 * float(cap.k.var()), err  # fewer cross terms decorrelated, still a good coder
    fine = KLTKeys(200, block=block)  # 8 bits a coefficient: near-exact through the block transform
    coded = KLTQuantizer(fine, calibrate(fine, [cap], 64, THETA)[0], THETA)(cap.k, pos)
    assert float(((coded - cap.k) ** 2).mean()) < 1e-3 * float(cap.k.var())


def test_blocks_lose_nothing_when_the_keys_are_block_diagonal():
    """Keys that mix rotary pairs only within groups of 4 consecutive pairs: blocks of 8 channels code them as well as
    the full KLT, blocks of 2 do not."""
    gen, d, t = torch.Generator().manual_seed(5), 32, 400
    k_pre = torch.zeros(2, 1, t, d)
    for j, idx in enumerate(pair_blocks(d, 8)):
        mix = torch.randn(8, 8, generator=gen) * 2.0**-j
        k_pre[..., idx] = torch.randn(2, 1, t, 8, generator=gen) @ mix.T
    pos, freq = torch.arange(t), inv_freq(d, THETA)
    q = rope(torch.randn(2, 2, t, d, generator=gen), pos, freq)
    cap = LayerCapture(q=q, k=rope(k_pre, pos, freq), v=torch.zeros(1), h=torch.zeros(1))
    err = {n: float(calibrate(KLTKeys(52, block=n), [cap], d, THETA)[0].predicted_error().sum()) for n in (0, 8, 2)}
    assert err[8] == pytest.approx(err[0], rel=0.03) and err[2] > 2 * err[0], err  # (sample cross terms: ~2 %)


def test_block_spec_is_checked_and_costed():
    assert KLTKeys(52).decode_cost(64) == 1.0 and KLTKeys(52, block=64).decode_cost(64) == 1.0
    assert KLTKeys(52, block=16).decode_cost(64) == 0.25 and KLTKeys(52, block=16).decode_cost(128) == 0.125
    with pytest.raises(FormatError):
        KLTKeys(52, block=7)
    with pytest.raises(FormatError):
        KLTKeys(52, block=-2)


def test_cubic_levels_start_ascending_on_an_s_shaped_codebook():
    """``ascending_fit``: a cubic through two tight clusters' levels bends back (the level order breaks, which
    ``KeyTransform`` refuses); the fit then starts on the straight line, and the plain fit is kept where it ascends."""
    from jetson_tq.codec.klt import centered_codes
    from lab.eval.klt_keys import ascending_fit

    u = centered_codes(3) / 7
    basis = torch.stack([u**p for p in range(4)], 1)
    step = torch.tensor([[-3.0, -2.9, -2.8, -2.7, 2.7, 2.8, 2.9, 3.0]], dtype=torch.float64)
    plain = torch.linalg.lstsq(basis[None], step[..., None]).solution
    assert bool(((basis @ plain)[..., 0].diff(dim=1) < 0).any()), "the plain cubic fit bends back"
    fit = ascending_fit(basis, step)
    assert bool(((basis @ fit)[..., 0].diff(dim=1) >= 0).all()) and float(fit[0, 2:].abs().max()) == 0.0
    smooth = torch.linspace(-2, 2, 8, dtype=torch.float64)[None] ** 3 / 4 + torch.linspace(-2, 2, 8)[None]
    assert torch.allclose(ascending_fit(basis, smooth), torch.linalg.lstsq(basis[None], smooth[..., None]).solution)
