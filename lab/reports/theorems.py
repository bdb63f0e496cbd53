"""The paper's guarantees, measured: Theorem 1 (MSE), Theorem 2 (unbiased inner products), Theorem 3 (bounds).

Each function returns plain rows (dicts) so tests can assert them and the demo can print them.
Paper figures (arXiv 2504.19874): D_mse = 0.3634/0.1175/0.0345/0.0095 and d * D_prod = 1.57/0.56/0.18/0.047
for b = 1..4; lower bounds D_mse >= 4^-b, d * D_prod >= 4^-b; upper bounds D_mse <= sqrt(3) pi/2 4^-b,
d * D_prod <= sqrt(3) pi^2 4^-b (unit vectors).
"""

from __future__ import annotations

import math

import torch

from jetson_tq.codec.codebook import lloyd_max_mse
from jetson_tq.codec.mse import TurboQuantMSE
from jetson_tq.codec.prod import TurboQuantProd

PAPER_MSE = {1: 0.3634, 2: 0.1175, 3: 0.0345, 4: 0.0095}
PAPER_PROD_TIMES_D = {1: 1.57, 2: 0.56, 3: 0.18, 4: 0.047}


def random_unit(n: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """n uniformly random unit vectors in R^dim (float32)."""
    x = torch.randn(n, dim, generator=generator)
    return x / x.norm(dim=-1, keepdim=True)


def theorem1_mse(dim: int = 128, n: int = 8192, bits=(1, 2, 3, 4), seed: int = 0) -> list[dict]:
    """Measured E||x - x~||^2 of TurboQuant_mse on random unit vectors, beside the paper and the bounds."""
    g = torch.Generator().manual_seed(seed)
    x = random_unit(n, dim, g)
    rows = []
    for b in bits:
        q = TurboQuantMSE(dim, b, seed=seed + b)
        mse = float(((x - q.dequantize(q.quantize(x))) ** 2).sum(-1).mean())
        paper = PAPER_MSE.get(b)
        rows.append(
            {
                "bits": b,
                "measured": mse,
                "paper": paper,
                "codebook_expected": lloyd_max_mse(dim, b),
                "lower_bound": 4.0**-b,
                "upper_bound": math.sqrt(3) * math.pi / 2 * 4.0**-b,
                "rel_to_paper": None if paper is None else mse / paper - 1,
            }
        )
    return rows


def theorem2_inner_product(
    dim: int = 128, n: int = 2048, bits=(1, 2, 3, 4), seeds: int = 8, seed: int = 0
) -> list[dict]:
    """Bias and distortion of TurboQuant_prod inner products <y, x~> vs <y, x>, over ``seeds`` independent (Pi, S)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in bits:
        errs, trues = [], []
        for s in range(seeds):
            x, y = random_unit(n, dim, g), random_unit(n, dim, g)
            q = TurboQuantProd(dim, b, seed=seed * 1000 + 17 * s + b)
            true = (x * y).sum(-1)
            errs.append((q.dequantize(q.quantize(x)) * y).sum(-1) - true)
            trues.append(true)
        err, true = torch.cat(errs).double(), torch.cat(trues).double()
        bias, stderr = float(err.mean()), float(err.std() / math.sqrt(err.numel()))
        distortion_d = float((err**2).mean()) * dim
        predicted = math.pi / 2 * (lloyd_max_mse(dim, b - 1) if b > 1 else 1.0)
        rows.append(
            {
                "bits": b,
                "bias": bias,
                "bias_stderr": stderr,
                "bias_z": bias / stderr,
                "mean_abs_error": float(err.abs().mean()),
                "relative_error": float(err.abs().mean() / true.abs().mean()),
                "distortion_times_d": distortion_d,
                "paper_times_d": PAPER_PROD_TIMES_D.get(b),
                "predicted_times_d": predicted,
            }
        )
    return rows


def theorem3_bounds(mse_rows: list[dict], prod_rows: list[dict]) -> list[dict]:
    """Lower bound <= measured <= upper bound, for both quantizers, from the rows of Theorems 1 and 2."""
    out = []
    for r in mse_rows:
        out.append(
            {
                "quantizer": "mse",
                "bits": r["bits"],
                "lower": 4.0 ** -r["bits"],
                "measured": r["measured"],
                "upper": r["upper_bound"],
                "ok": 4.0 ** -r["bits"] <= r["measured"] <= r["upper_bound"],
            }
        )
    for r in prod_rows:
        lower, upper = 4.0 ** -r["bits"], math.sqrt(3) * math.pi**2 * 4.0 ** -r["bits"]
        m = r["distortion_times_d"]
        out.append(
            {
                "quantizer": "prod (x d)",
                "bits": r["bits"],
                "lower": lower,
                "measured": m,
                "upper": upper,
                "ok": lower <= m <= upper,
            }
        )
    return out
