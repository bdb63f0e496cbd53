"""Lloyd-Max codebooks of the exact coordinate density, and seeded rotations."""

import math

import pytest
import torch

from jetson_tq.codec.codebook import key_codebook, lloyd_max_codebook, lloyd_max_mse, uniform_codebook, uniform_mse
from jetson_tq.codec.kv import KVCodec
from jetson_tq.codec.rotation import Rotation, derive_seed, fwht, qjl_matrix
from jetson_tq.errors import FormatError
from jetson_tq.format import KVFormat


def test_known_closed_forms():
    # d=3: a coordinate is uniform on [-1, 1]; the 1-bit Lloyd-Max quantizer is +-1/2 (MSE 3 * 1/12 = 0.25).
    assert lloyd_max_codebook(3, 1).tolist() == pytest.approx([-0.5, 0.5], abs=1e-5)
    assert lloyd_max_mse(3, 2) == pytest.approx(3 * (0.5**2) / 12, rel=1e-3)
    # d=2: x = cos(theta), theta uniform; 1-bit centroids are +-2/pi.
    assert lloyd_max_codebook(2, 1).tolist() == pytest.approx([-2 / math.pi, 2 / math.pi], abs=1e-5)


@pytest.mark.parametrize("bits,gaussian_mse", [(1, 0.3634), (2, 0.1175), (3, 0.0345), (4, 0.0095)])
def test_large_dim_approaches_gaussian_lloyd_max(bits, gaussian_mse):
    assert lloyd_max_mse(4096, bits) == pytest.approx(gaussian_mse, rel=0.02)


@pytest.mark.parametrize("dim", [2, 5, 64, 100, 128])
@pytest.mark.parametrize("bits", [1, 3, 8])
def test_codebook_sorted_symmetric_deterministic(dim, bits):
    c = lloyd_max_codebook(dim, bits)
    assert c.shape == (1 << bits,) and c.dtype == torch.float32
    assert bool((c[1:] > c[:-1]).all())
    assert torch.allclose(c, -c.flip(0), atol=1e-6)
    assert torch.equal(c, lloyd_max_codebook(dim, bits))
    assert float(c.abs().max()) <= 1.0


def test_codebook_rejects_bad_args():
    for dim, bits in ((1, 2), (64, 0), (64, 9)):
        with pytest.raises(FormatError):
            lloyd_max_codebook(dim, bits)


@pytest.mark.parametrize("kind,dim", [("dense", 50), ("dense", 128), ("hadamard", 64), ("hadamard", 128)])
def test_rotations_orthogonal_and_seeded(kind, dim):
    r = Rotation(dim, kind, seed=7)
    m = r.matrix64()
    assert torch.allclose(m @ m.T, torch.eye(dim, dtype=torch.float64), atol=1e-10)
    x = torch.randn(5, dim)
    assert torch.allclose(r.apply(x), x @ r.matrix().T, atol=1e-5)
    assert torch.allclose(r.invert(r.apply(x)), x, atol=1e-5)
    assert torch.equal(Rotation(dim, kind, seed=7).matrix64(), m)
    assert not torch.equal(Rotation(dim, kind, seed=8).matrix64(), m)


def test_fwht_matches_matrix_and_rejects_odd_sizes():
    x = torch.randn(3, 16, dtype=torch.float64)
    h = Rotation(16, "hadamard", 0).matrix64() * math.sqrt(16) / Rotation(16, "hadamard", 0).matrix64()[0].sign()
    assert torch.allclose(fwht(x), x @ h.T, atol=1e-9)
    with pytest.raises(FormatError):
        fwht(torch.randn(12))
    with pytest.raises(FormatError):
        Rotation(12, "hadamard")


def test_seeds_per_layer_and_head_differ_and_repeat():
    seeds = {derive_seed(0, layer, head) for layer in range(30) for head in range(8)}
    assert len(seeds) == 240
    assert derive_seed(3, 2, 1) == derive_seed(3, 2, 1)
    s = qjl_matrix(32, 5)
    assert s.shape == (32, 32) and torch.equal(s, qjl_matrix(32, 5))
    assert abs(float(s.mean())) < 0.1 and abs(float(s.std()) - 1) < 0.1


@pytest.mark.parametrize("dim,bits", [(64, 4), (128, 4), (128, 2)])
def test_uniform_codebook_is_evenly_spaced_with_the_optimal_step(dim, bits):
    c = uniform_codebook(dim, bits).double()
    step = (c[-1] - c[0]) / (c.numel() - 1)
    assert torch.allclose(c, (torch.arange(c.numel(), dtype=torch.float64) - (c.numel() - 1) / 2) * step, atol=1e-7)
    assert uniform_mse(dim, bits) >= lloyd_max_mse(dim, bits)  # Lloyd-Max is the optimum over all codebooks
    from jetson_tq.codec.codebook import _grid_mse, _uniform_levels

    levels = _uniform_levels(bits)
    for f in (0.98, 1.02):  # a 2 % longer or shorter step is worse: the step minimizes the MSE
        assert _grid_mse(dim, float(step) * f * levels) > uniform_mse(dim, bits)
    assert torch.equal(key_codebook("uniform", dim, bits), uniform_codebook(dim, bits))
    with pytest.raises(FormatError):
        key_codebook("nf4", dim, bits)


def test_codec_uses_the_formats_key_codebook():
    """Measured key MSE of the codec matches each codebook's expected MSE (4-bit, D=128, 4096 keys)."""
    k = torch.randn(4096, 128, generator=torch.Generator().manual_seed(0))
    for kind, expect in (("lloyd_max", lloyd_max_mse(128, 4)), ("uniform", uniform_mse(128, 4))):
        codec = KVCodec(KVFormat(key_mode="mse", key_bits=4, key_codebook=kind), 128)
        rel = ((codec.decode_keys(codec.encode_keys(k)) - k).pow(2).sum(-1) / k.pow(2).sum(-1)).mean().item()
        assert abs(rel - expect) < 0.05 * expect, f"{kind}: {rel:.5f} vs {expect:.5f}"
