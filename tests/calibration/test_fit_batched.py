"""The batched calibration fit (``calibration.fit.fit_heads``: every KV head at once) against the per-head loop it
replaced (``tests/calibration/fit_oracle.py``): the same widths, and transforms, sigmas and levels equal to float
rounding, on random heads of unequal scales at head dims 64 and 128, both level kinds, with and without code widths."""

from __future__ import annotations

import pytest
import torch

from jetson_tq.calibration import fit
from tests.calibration import fit_oracle

HEADS = 3


def random_heads(seed: int, d: int, n: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys [H, N, D] (anisotropic, correlated, heavy-tailed in some heads, offset), queries [H, 2N, D] of unequal
    channel energies, and positive weights [H, N]."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(0.5, -1.5, d, dtype=torch.float64)
    mix = torch.linalg.qr(torch.randn(HEADS, d, d, generator=g, dtype=torch.float64)).Q
    k = (torch.randn(HEADS, n, d, generator=g, dtype=torch.float64) * scale) @ mix
    k = k + torch.randn(HEADS, 1, d, generator=g, dtype=torch.float64)
    k[0] = k[0] ** 3 / 3  # a heavy-tailed head
    energy = torch.rand(d, generator=g, dtype=torch.float64)
    q = torch.randn(HEADS, 2 * n, d, generator=g, dtype=torch.float64) * energy
    w = 1 + torch.rand(HEADS, n, generator=g, dtype=torch.float64) ** 4 * 10
    return k, q, w


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-6) -> bool:
    """Equal to ``rtol`` of the larger's scale (levels and transforms are fitted in float64)."""
    return bool(((a - b).abs().max() <= rtol * b.abs().max().clamp_min(1e-30)).item())


# the cubic fits take 27-95 s each on 2 cores, the Lloyd-Max ones 15-67 s: the full suite runs them all, the --quick
# lane one Lloyd-Max fit (seed 0, D = 64)
CUBIC = pytest.param("cubic", (2, 4, 8), marks=pytest.mark.slow)


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("d", [64, pytest.param(128, marks=pytest.mark.slow)])
@pytest.mark.parametrize(("levels", "widths"), [CUBIC, ("lloyd", ())])
def test_batched_fit_is_the_per_head_fit(seed: int, d: int, levels: str, widths: tuple[int, ...]):
    k, q, w = random_heads(seed, d)
    budget = 52 * 8 * d // 128
    got = fit.fit_heads(k, q, w, budget, widths=widths, levels=levels)
    for h in range(HEADS):
        want = fit_oracle.fit_head(k[h], q[h], w[h], budget, widths=widths, levels=levels)
        assert set(got) == set(want)
        assert torch.equal(got["bits"][h], want["bits"]), f"head {h}: widths differ"
        assert int(got["bits"][h].sum()) <= budget
        for name in ("mean", "encode", "decode", "sigma", "levels"):
            assert close(got[name][h], want[name]), f"head {h}: {name} differs"


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])  # ~13 s each
def test_batched_pieces_match_one_head_at_a_time(seed: int):
    """Blocked KLTs (rotary pairs, a partial rotary dim), the greedy without widths and per-token-norm levels."""
    k, q, w = random_heads(seed, 64, n=512)
    kw = {"block": 4, "rotary_dim": 48, "token_norm": True, "levels": "cubic"}
    got = fit.fit_heads(k, q, w, 200, **kw)
    for h in range(HEADS):
        want = fit_oracle.fit_head(k[h], q[h], w[h], 200, **kw)
        assert torch.equal(got["bits"][h], want["bits"])
        for name in ("encode", "decode", "sigma", "levels"):
            assert close(got[name][h], want[name]), f"head {h}: {name} differs"
    lam = torch.rand(5, 64, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) ** 3
    lam[2, :8] = lam[2, 8]  # equal gains: the first one taken, as alone
    batched = fit.allocate_bits(lam, 150)
    assert all(torch.equal(batched[i], fit_oracle.allocate_bits(lam[i], 150)) for i in range(5))


def test_eigenvector_signs_are_fixed():
    """Each column of U has its largest-magnitude entry positive, the same from a stack's batched eigh as from each
    matrix alone and for the matrix's negated eigenvectors' input (a covariance of the negated keys)."""
    k, _, _ = random_heads(0, 64, n=256)
    cov = k.transpose(1, 2) @ k
    lam, u = fit.block_klt(cov, fit.pair_blocks(64, 0))
    lead = u.abs().argmax(-2, keepdim=True)
    assert bool((u.gather(-2, lead) > 0).all())
    for h in range(HEADS):
        lam_h, u_h = fit.block_klt(cov[h], fit.pair_blocks(64, 0))
        assert close(u_h, u[h], 1e-9) and close(lam_h, lam[h], 1e-12)
        assert close(u_h.T @ cov[h] @ u_h, torch.diag(lam_h), 1e-9)
    assert close(u.transpose(1, 2) @ u, torch.eye(64, dtype=torch.float64).expand(HEADS, -1, -1), 1e-9)


def test_gaussian_codebooks_iterated_together_are_each_alone():
    """All widths' Lloyd-Max codebooks in one loop: bit for bit the codebook iterated by itself (1..6 bits here;
    7 and 8, which run the full 20,000 steps, agree too but take ~10 s alone)."""
    books = fit._lloyd_max_gaussian()
    for b in range(1, 7):
        assert torch.equal(books[b - 1], fit_oracle.gaussian_codebook_alone(b)), f"{b} bits"
    assert [len(c) for c in books] == [1 << b for b in range(1, fit.MAX_BITS + 1)]
    assert all(bool((c.diff() > 0).all()) for c in books)
    assert fit.distortion(8) < fit.distortion(4) < fit.distortion(1) < 1.0


def test_fit_heads_refuses_mismatched_shapes():
    k, q, w = random_heads(0, 64, n=64)
    with pytest.raises(fit.FormatError, match=r"expected \[H, N, D\]"):
        fit.fit_heads(k, q[:2], w, 100)


def test_no_transform_in_channel_order_has_a_diagonal_decode():
    """``in_channel_order`` of a fit without a transform (block 1): the decode matrix diagonal (``KltSpec.DIAGONAL``),
    every channel keeping the bits, levels and scale its coefficient had, and encode / decode still inverse."""
    k, q, w = random_heads(0, 64, n=256)
    budget = 52 * 8 * 64 // 128
    plain = fit.fit_heads(k, q, w, budget, widths=(2, 4, 8), levels="lloyd", block=1)
    got = fit.in_channel_order(plain)
    dec = got["decode"]
    assert torch.equal(dec, torch.diag_embed(torch.diagonal(dec, dim1=-2, dim2=-1)))
    chan = (plain["decode"] != 0).to(torch.int8).argmax(-2)  # [H, D]: each old coefficient's channel
    for h in range(HEADS):
        for i in range(64):
            c = int(chan[h, i])
            assert dec[h, c, c] == plain["decode"][h, c, i]
            assert got["bits"][h, c] == plain["bits"][h, i]
            assert torch.equal(got["levels"][h, c], plain["levels"][h, i])
            assert got["sigma"][h, c] == plain["sigma"][h, i]
    eye = torch.eye(64, dtype=dec.dtype).expand(HEADS, -1, -1)
    assert close(got["decode"] @ got["encode"], eye)
    with pytest.raises(Exception, match="without a transform"):
        fit.in_channel_order(fit.fit_heads(k, q, w, budget, levels=None))
