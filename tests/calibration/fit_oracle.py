"""The per-head calibration fit, one KV head at a time in Python loops: the oracle ``calibration.fit``'s batched fit
(``fit_heads``) is tested against. Kept here only as the reference (each head's result must be the one it gets
alone); eigenvectors signed as ``fit.block_klt`` signs them (largest-magnitude entry positive)."""

from __future__ import annotations

import math

import torch

from jetson_tq.calibration.fit import LEVEL_KINDS, MAX_BITS, ascending_fit, distortion, gaussian_codebook, pair_blocks
from jetson_tq.codec.klt import centered_codes
from jetson_tq.errors import FormatError


def allocate_bits(
    variances: torch.Tensor, budget: int, max_bits: int = MAX_BITS, widths: tuple[int, ...] = ()
) -> torch.Tensor:
    """Integer bits [n] (0..``max_bits``) summing to ``budget`` (or n * max_bits, if less), least summed
    lambda_i D(b_i): greedy on the marginal gain, optimal since D is convex. ``widths``: only these code widths
    (0 always allowed; e.g. (4, 8) for codes a kernel reads by nibbles), each step to a coefficient's next allowed
    width taken by its gain per bit while it fits the budget."""
    lam = variances.double().cpu().clamp_min(0)  # a greedy loop of D-sized steps: the CPU's
    table = torch.tensor([distortion(b) for b in range(max_bits + 1)] + [0.0], dtype=torch.float64)
    bits = torch.zeros(lam.numel(), dtype=torch.long)
    if widths:
        allowed = sorted({0, *widths})
        nxt = torch.tensor([next((w for w in allowed if w > b), -1) for b in range(max_bits + 1)], dtype=torch.long)
        left = budget
        while True:
            up = nxt[bits]
            step = (up - bits).clamp_min(1)
            gain = lam * (table[bits] - table[up.clamp_min(0)]) / step
            gain[(up < 0) | (step > left)] = -1.0
            i = int(gain.argmax())
            if gain[i] < 0:
                return bits
            left -= int(step[i])
            bits[i] = up[i]
    for _ in range(min(budget, lam.numel() * max_bits)):
        gain = lam * (table[bits] - table[bits + 1])
        gain[bits >= max_bits] = -1.0
        bits[int(gain.argmax())] += 1
    return bits


def pair_weight(q_pre: torch.Tensor, ridge: float = 1e-6, rotary_dim: int | None = None) -> torch.Tensor:
    """The diagonal of W [D] from pre-RoPE queries [N, D] of one KV head's group: each rotary pair's mean query energy
    per channel (pairs c, c + R/2 over the first ``rotary_dim`` R channels, default all; channels past R, which RoPE
    leaves alone, their own energy), floored at ``ridge`` x the mean, so W^(-1/2) exists."""
    d = q_pre.shape[-1]
    r = d if rotary_dim is None else rotary_dim
    e = (q_pre.double() ** 2).mean(0)
    pair = (e[: r // 2] + e[r // 2 : r]) / 2
    w = torch.cat([pair, pair, e[r:]])
    return w.clamp_min(ridge * float(w.mean()))


def fit_head(
    k_pre: torch.Tensor,
    q_pre: torch.Tensor,
    weight: torch.Tensor,
    budget: int,
    *,
    widths: tuple[int, ...] = (),
    levels: str | None = "cubic",
    block: int = 0,
    rotary_dim: int | None = None,
    token_norm: bool = False,
) -> dict[str, torch.Tensor]:
    """One KV head's coder from its pre-RoPE keys [N, D] (statistics weighted by ``weight`` [N]) and its query
    group's pre-RoPE queries [M, D]: mean [D], encode A = U^T W^(1/2) and decode B = W^(-1/2) U [D, D], sigma [D],
    bits [D] (``budget`` in all, ``widths``) and, with ``levels`` ("cubic" / "lloyd"; None: Gaussian codebooks),
    each coefficient's levels [D, 2^MAX_BITS]. ``token_norm``: fit the levels to coefficients over their token's
    scale (the lab's per-token-norm coder)."""
    d = k_pre.shape[-1]
    kk = k_pre.double()
    ww = (weight.double() / weight.double().sum()).reshape(-1, 1)
    w = pair_weight(q_pre, rotary_dim=rotary_dim)
    w_half, w_inv_half = torch.diag(w.sqrt()), torch.diag(w.rsqrt())
    m = (ww * kk).sum(0)
    y = (kk - m) @ w_half  # W symmetric: rows y = W^(1/2) (k - m)
    cov = y.T @ (ww * y)
    lam, u = block_klt(cov, pair_blocks(d, block, rotary_dim))
    bits = allocate_bits(lam, budget, widths=widths).to(lam.device)
    out = {"mean": m, "encode": u.T @ w_half, "decode": w_inv_half @ u, "sigma": lam.sqrt(), "bits": bits}
    if levels is not None:
        if levels not in LEVEL_KINDS:
            raise FormatError(f"levels {levels!r}: expected one of {LEVEL_KINDS}")
        z = y @ u
        if token_norm:
            z = z / (z.norm(dim=-1, keepdim=True) / lam.sum().sqrt()).clamp_min(1e-12)
        fit = cubic_levels if levels == "cubic" else lloyd_levels
        out["levels"] = fit(z, ww[:, 0], lam.sqrt(), bits)
    return out


def block_klt(cov: torch.Tensor, blocks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The KLT of ``cov`` [D, D] restricted to diagonal ``blocks`` (channel indices): variances lambda [D], descending,
    and the orthogonal U [D, D] whose columns are each block's eigenvectors (zero outside their block)."""
    d = cov.shape[0]
    lams, u = [], torch.zeros(d, d, dtype=cov.dtype, device=cov.device)
    col = 0
    for idx in blocks:
        lam, vec = torch.linalg.eigh(cov[idx][:, idx])
        vec = vec.flip(1)
        for j in range(vec.shape[1]):
            if vec[int(vec[:, j].abs().argmax()), j] < 0:
                vec[:, j] = -vec[:, j]
        lams.append(lam.flip(0).clamp_min(0))
        u[idx, col : col + len(idx)] = vec
        col += len(idx)
    lam = torch.cat(lams)
    order = lam.argsort(descending=True, stable=True)
    return lam[order], u[:, order]


def lloyd_levels(
    z: torch.Tensor, weight: torch.Tensor, sigma: torch.Tensor, bits: torch.Tensor, steps: int = 30
) -> torch.Tensor:
    """Per coefficient the levels [D, 2^MAX_BITS] of a weighted 1-D Lloyd-Max on calibration coefficients z [N, D]
    (``weight`` [N]), started from the Gaussian codebook at its sigma; unused slots repeat the last level."""
    out = torch.zeros(z.shape[1], 1 << MAX_BITS, dtype=torch.float64, device=z.device)
    for b in range(1, MAX_BITS + 1):
        cols = torch.nonzero(bits == b).squeeze(1)
        if not len(cols):
            continue
        x = z[:, cols].T.contiguous()  # [n, N]
        c = gaussian_codebook(b)[0].double().to(z.device)[None, :] * sigma[cols, None]  # [n, 2^b]
        w = weight[None, :].expand_as(x)
        for _ in range(steps):
            idx = torch.searchsorted(((c[:, 1:] + c[:, :-1]) / 2).contiguous(), x)
            num = torch.zeros_like(c).scatter_add_(1, idx, w * x)
            den = torch.zeros_like(c).scatter_add_(1, idx, w)
            c = torch.where(den > 0, num / den.clamp_min(1e-300), c)
        out[cols, : 1 << b] = c
        out[cols, 1 << b :] = c[:, -1:]
    return out


def cubic_levels(
    z: torch.Tensor, weight: torch.Tensor, sigma: torch.Tensor, bits: torch.Tensor, steps: int = 30
) -> torch.Tensor:
    """Per coefficient levels a cubic of the centered code, a + u (s + u (r + t u)) (``centered_codes``) [D,
    2^MAX_BITS], fitted to calibration coefficients z [N, D] (``weight`` [N]): nearest-level codes and a weighted
    least-squares cubic in turn, started on the fitted Lloyd-Max levels (``lloyd_levels``, ``ascending_fit``), each
    step kept only while the levels stay ascending. A kernel computes such levels by three FMAs, with no table; the
    cubic's bend follows a Lloyd-Max codebook's wider outer cells (on Gaussian and Laplacian data within 1-5 % of its
    error at 2-4 bits, up to ~20 % at 5-6; evenly spaced levels lose 20-60 % at 4-5 bits).
    Unused slots repeat the last level."""
    out = torch.zeros(z.shape[1], 1 << MAX_BITS, dtype=torch.float64, device=z.device)
    lloyd = lloyd_levels(z, weight, sigma, bits)
    for b in range(1, MAX_BITS + 1):
        cols = torch.nonzero(bits == b).squeeze(1)
        if not len(cols):
            continue
        n = 1 << b
        # in [-1, 1]: a well-conditioned basis (the levels are the same cubic)
        u = centered_codes(b).to(z.device) / max(n - 1, 1)
        basis = torch.stack([u**p for p in range(min(4, n))], 1)  # [n, P]: 1 bit: a line through 2 levels
        x = z[:, cols].T.double().contiguous()  # [n_cols, N]
        w = weight.double()[None, :].expand_as(x)
        start = lloyd[cols, :n]  # [n_cols, n]
        coef = ascending_fit(basis, start)
        for _ in range(steps):
            lv = (basis @ coef)[..., 0]
            idx = torch.searchsorted(((lv[:, 1:] + lv[:, :-1]) / 2).contiguous(), x)
            mass = torch.zeros_like(lv).scatter_add_(1, idx, w)  # per level: weight and weighted sum of its cell
            total = torch.zeros_like(lv).scatter_add_(1, idx, w * x)
            gram = torch.einsum("ck,kp,kq->cpq", mass, basis, basis)
            new = torch.linalg.lstsq(gram, torch.einsum("ck,kp->cp", total, basis)[..., None]).solution
            new_lv = (basis @ new)[..., 0]
            ok = ((new_lv[:, 1:] - new_lv[:, :-1]) > 0).all(1) & torch.isfinite(new_lv).all(1)
            coef = torch.where(ok[:, None, None], new, coef)
        lv = (basis @ coef)[..., 0]
        out[cols, : 1 << b] = lv
        out[cols, 1 << b :] = lv[:, -1:]
    return out


def gaussian_codebook_alone(bits: int) -> torch.Tensor:
    """One Gaussian Lloyd-Max codebook iterated by itself (float64 [2^bits]), as ``fit.gaussian_codebook`` was."""
    n = 1 << bits
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)
    c = normal.icdf((torch.arange(n, dtype=torch.float64) + 0.5) / n)
    for _ in range(20_000):
        edges = torch.cat([torch.tensor([-math.inf]), (c[1:] + c[:-1]) / 2, torch.tensor([math.inf])]).double()
        pdf, cdf = normal.log_prob(edges).exp(), torch.special.ndtr(edges)
        new = (pdf[:-1] - pdf[1:]) / (cdf[1:] - cdf[:-1])
        moved = float((new - c).abs().max())
        c = new
        if moved < 1e-12:
            break
    return c
