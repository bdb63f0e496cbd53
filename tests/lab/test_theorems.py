"""The paper's guarantees: Theorem 1 (MSE), Theorem 2 (unbiased, distortion), Theorem 3 (bounds)."""

import pytest

from lab.reports.theorems import (
    PAPER_MSE,
    PAPER_PROD_TIMES_D,
    theorem1_mse,
    theorem2_inner_product,
    theorem3_bounds,
)


@pytest.fixture(scope="module")
def mse_rows():
    return theorem1_mse(dim=128, n=8192, bits=(1, 2, 3, 4))


@pytest.fixture(scope="module")
def prod_rows():
    return theorem2_inner_product(dim=128, n=2048, bits=(1, 2, 3, 4), seeds=8)


def test_theorem1_mse_within_10_percent_of_paper(mse_rows):
    for r in mse_rows:
        assert r["measured"] == pytest.approx(PAPER_MSE[r["bits"]], rel=0.10), r
        # and the empirical MSE agrees with the codebook's own expected distortion
        assert r["measured"] == pytest.approx(r["codebook_expected"], rel=0.03), r


def test_theorem2_unbiased_and_distortion_near_paper(prod_rows):
    for r in prod_rows:
        assert abs(r["bias_z"]) < 4.0, r  # mean error consistent with zero (16k draws, 8 independent (Pi, S))
        assert abs(r["bias"]) < 2e-3, r
        # 1.57, 0.56, 0.18 within 10 %; the paper's 0.047 at b=4 is below pi/2 * D_mse(3) = 0.054 -> 20 %
        tol = 0.20 if r["bits"] == 4 else 0.10
        assert r["distortion_times_d"] == pytest.approx(PAPER_PROD_TIMES_D[r["bits"]], rel=tol), r
        assert r["distortion_times_d"] == pytest.approx(r["predicted_times_d"], rel=0.08), r


def test_theorem3_bounds_hold(mse_rows, prod_rows):
    rows = theorem3_bounds(mse_rows, prod_rows)
    assert len(rows) == 8
    assert all(r["ok"] for r in rows), rows
