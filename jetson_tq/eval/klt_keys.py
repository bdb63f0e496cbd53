"""Transform-coded keys: a calibrated, score-weighted KLT of the pre-RoPE key, bits by reverse water-filling.

Split keys (``split_keys.py``) is a two-level, pair-wise approximation of optimal transform coding; this is the real
thing, per layer and KV head:

1. **Pre-RoPE.** The cache sees post-RoPE keys k_p = R_p k (transformers' ``rotate_half`` convention); per-channel
   structure is stable before RoPE (KVQuant), smeared after. The coder undoes RoPE at the token's known position,
   codes, decodes and re-applies it (a kernel would score against the dequantized pre-RoPE key rotated at read).
2. **Score weight.** A query at p scores a key at s by q^T R_{s-p} k (pre-RoPE q, k), so a key error e costs
   e^T W e with W = E_delta[R_delta^T E[q q^T] R_delta]. Averaged over relative positions whose angles spread, W is
   diagonal by rotary pair: w_c = w_{c+D/2} = E[q_c^2 + q_{c+D/2}^2] / 2 (``pair_weight``). (The numerical average
   over distances 0..4,096, which keeps the slow pairs' full blocks, measured the same: removed.)
3. **KLT.** Whiten the centered pre-RoPE keys by W^(1/2), take their PCA (eigenvectors U, variances lambda): the
   coefficients z = U^T W^(1/2) (k - m) are decorrelated and their squared error is the score error.
4. **Bits.** Integer bits 0..``MAX_BITS`` per coefficient by greedy reverse water-filling on lambda (the marginal
   gain lambda_i (D(b) - D(b+1)) of the Gaussian Lloyd-Max distortion D, optimal for convex D), a fixed number of
   bits per head; each coefficient by the Gaussian Lloyd-Max codebook scaled by its calibrated sigma. With
   ``token_norm`` a per-token fp16 scale (the coefficients' norm over its expectation) divides them first and takes
   2 B of the budget.
5. **Attention-weighted statistics** (``attention``): the mean, covariance (hence U, lambda, bits) and sigmas weight
   each calibration key by ``ATTENTION_FLOOR`` + the attention it receives from queries that read it compressed, over
   its mean. Without it the bulk-optimal transform gives the rare directions of the attended keys few bits.
6. **Calibrated codebooks** (``lloyd``): each coefficient's levels by a weighted 1-D Lloyd-Max on its calibration
   values (started from the Gaussian codebook), for coefficients that are not Gaussian; or (``cubic``) levels that
   are a fitted cubic of the code, which the kernels compute instead of looking them up (``cubic_levels``).
7. **Block-diagonal KLT** (``block`` N < D): the whitened covariance restricted to blocks of N channels, N/2
   consecutive rotary pairs each, a pair's two channels (c, c + D/2) always in one block, so a block is closed under
   RoPE's pairing and a kernel decodes (and rotates) one block of a key from that block's coefficients alone: 2 D N
   FLOPs a key instead of 2 D^2 (``pair_blocks``). N = 1: no transform, each whitened channel its own coefficient
   (its mean and scale fold into its levels). Bits still by water-filling over all D coefficients of the head.
   (Pairs grouped by whitened energy or by greedy Gaussian coding gain measured the same as consecutive pairs on the
   dev split: removed, benchmarks/NOTES.md.)

Bytes: ``KLTKeys.key_bytes`` is stated at ``REFERENCE_DIM`` = 128 (norm included); other head dims keep its code bits
in proportion, as ``SplitKeys`` does. An evaluation format, read by the ``cpu-decoded`` history (``KLTKeyHistory``:
the store's own key code is ignored); the per-head mean, transform and codebooks are calibration constants, not
per-token bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, partial

import torch

from ..cache.compressed import CompressedKVCache
from ..codec.klt import RotaryParams, centered_codes
from ..codec.klt import default_inv_freq as inv_freq
from ..errors import FormatError, ShapeError
from ..format import Field, KVFormat
from ..integrations.transformers import TurboQuantCache, model_dims
from .decoded_history import CodedKeyLayer, DecodedHistory
from .smartmix import LayerCapture
from .split_keys import REFERENCE_DIM

MAX_BITS = 8
MIN_DISTANCE = 128  # a key counts the attention of queries this much later (they read it compressed)
ATTENTION_FLOOR = 1.0  # attention-weighted statistics: each key's weight, floor + received / mean received


@dataclass(frozen=True)
class KLTKeys:
    """Keys of ``key_bytes`` per token at ``REFERENCE_DIM`` (a per-token fp16 scale included with ``token_norm``)."""

    key_bytes: int
    token_norm: bool = False
    attention: bool = False
    lloyd: bool = False
    cubic: bool = False  # levels a fitted cubic of the code per coefficient (``cubic_levels``) instead of Lloyd-Max
    block: int = 0  # channels per diagonal block (an even divisor of D; 1: no transform); 0: one block, the full KLT
    widths: tuple[int, ...] = ()  # the code widths bits may take (0 always); (): any of 0..MAX_BITS

    def __post_init__(self) -> None:
        if self.code_bits(REFERENCE_DIM) <= 0:
            raise FormatError(f"key_bytes {self.key_bytes} leaves no code bits")
        if self.lloyd and self.cubic:
            raise FormatError("lloyd and cubic levels exclude each other")
        if self.block < 0 or (self.block % 2 and self.block != 1):
            raise FormatError(f"block {self.block}: expected 0 (full KLT), 1 (no transform) or an even channel count")

    def decode_cost(self, head_dim: int) -> float:
        """Decode FLOPs of one key as a fraction of the full KLT's 2 D^2: N / D."""
        return 1.0 if self.block in (0, head_dim) else self.block / head_dim

    def norm_bytes(self, norm_dtype: torch.dtype = torch.float16) -> int:
        """Bytes of the per-token scale (0 without one)."""
        return Field("key_norm", norm_dtype, 1).nbytes if self.token_norm else 0

    def code_bits(self, head_dim: int) -> int:
        """Code bits of one key at ``head_dim`` (the budget at ``REFERENCE_DIM`` in proportion)."""
        return (self.key_bytes - self.norm_bytes()) * 8 * head_dim // REFERENCE_DIM

    def key_bytes_per_token(self, head_dim: int) -> float:
        """Bytes of one key: its code bits and the per-token scale."""
        return self.code_bits(head_dim) / 8 + self.norm_bytes()


# ---------------------------------------------------------------------------------------------- RoPE
def rope(x: torch.Tensor, positions: torch.Tensor, freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [..., T, D] rotated by RoPE at ``positions`` [T] (``rotate_half`` pairs c, c + D/2); ``inverse`` undoes it."""
    return RotaryParams(freq).apply(x, positions, inverse)


# ---------------------------------------------------------------------------------------------- codebooks
@cache
def gaussian_codebook(bits: int) -> tuple[torch.Tensor, float]:
    """Lloyd-Max centroids of N(0, 1) at ``bits`` (float32 [2^bits]) and their mean squared error (closed-form cell
    means, started at the Gaussian's quantiles, iterated to a 1e-12 move)."""
    if bits == 0:
        return torch.zeros(1), 1.0
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
    edges = torch.cat([torch.tensor([-math.inf]), (c[1:] + c[:-1]) / 2, torch.tensor([math.inf])]).double()
    pdf, cdf = normal.log_prob(edges).exp(), torch.special.ndtr(edges)
    pdf, e = pdf.nan_to_num(0.0), edges.nan_to_num(0.0, posinf=0.0, neginf=0.0)
    # E[(x - c)^2] over a cell [a, b] = (1 + c^2)(F(b) - F(a)) + (a - 2c) f(a) - (b - 2c) f(b), with x f(x) -> 0 at inf
    mass = cdf[1:] - cdf[:-1]
    mse = ((1 + c**2) * mass + (e[:-1] - 2 * c) * pdf[:-1] - (e[1:] - 2 * c) * pdf[1:]).sum()
    return c.float(), float(mse)


def distortion(bits: int) -> float:
    """Mean squared error of a unit Gaussian coded at ``bits`` (1.0 at 0 bits)."""
    return gaussian_codebook(bits)[1]


def allocate_bits(
    variances: torch.Tensor, budget: int, max_bits: int = MAX_BITS, widths: tuple[int, ...] = ()
) -> torch.Tensor:
    """Integer bits [n] (0..``max_bits``) summing to ``budget`` (or n * max_bits, if less), least summed
    lambda_i D(b_i): greedy on the marginal gain, optimal since D is convex. ``widths``: only these code widths
    (0 always allowed; e.g. (4, 8) for codes a kernel reads by nibbles), each step to a coefficient's next allowed
    width taken by its gain per bit while it fits the budget."""
    lam = variances.double().clamp_min(0)
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


# ---------------------------------------------------------------------------------------------- calibration
@dataclass
class KLTLayer:
    """One layer's coder per KV head: mean m [H, D] (pre-RoPE), encode A = U^T W^(1/2) [H, D, D], decode
    B = W^(-1/2) U [H, D, D], coefficient sigmas [H, D], bits [H, D] and, with calibrated codebooks, each
    coefficient's levels [H, D, 2^MAX_BITS] (the first 2^bits used)."""

    mean: torch.Tensor
    encode: torch.Tensor
    decode: torch.Tensor
    sigma: torch.Tensor
    bits: torch.Tensor
    levels: torch.Tensor | None = None

    def predicted_error(self) -> torch.Tensor:
        """Score-error variance per head [H]: sum_i lambda_i D(b_i) (Gaussian coefficients, fixed scale)."""
        table = torch.tensor([distortion(b) for b in range(MAX_BITS + 1)])
        return (self.sigma**2 * table[self.bits]).sum(-1)


def pair_weight(q_pre: torch.Tensor, ridge: float = 1e-6) -> torch.Tensor:
    """The diagonal of W [D] from pre-RoPE queries [N, D] of one KV head's group: each rotary pair's mean query energy
    per channel (floored at ``ridge`` x the mean, so W^(-1/2) exists)."""
    d = q_pre.shape[-1]
    e = (q_pre.double() ** 2).mean(0)
    pair = (e[: d // 2] + e[d // 2 :]) / 2
    w = torch.cat([pair, pair])
    return w.clamp_min(ridge * float(w.mean()))


def received_attention(cap: LayerCapture, min_distance: int = MIN_DISTANCE) -> torch.Tensor:
    """Per key [B, H, T] the exact attention it receives, summed over its query heads and the queries at least
    ``min_distance`` later (those that read it compressed)."""
    q, k = cap.q.float(), cap.k.float()
    g, t, d = q.shape[1] // k.shape[1], k.shape[2], k.shape[3]
    pos = torch.arange(t)
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2) / d**0.5).masked_fill(pos[None, :] > pos[:, None], -math.inf)
    far = pos[None, :] <= pos[:, None] - min_distance
    got = (s.softmax(-1) * far).sum(-2)  # [B, Hq, T]
    return got.reshape(got.shape[0], k.shape[1], g, t).sum(2).double()


def calibrate(
    spec: KLTKeys,
    caps: list[LayerCapture],
    head_dim: int,
    theta: float,
    skip: int = 1,
    rotary: RotaryParams | None = None,
) -> list[KLTLayer]:
    """Per layer the KLT coder from a calibration capture (post-RoPE q, k at positions 0..T-1 of each row), the first
    ``skip`` positions (an attention sink) left out; with ``spec.attention`` each key's statistics weighted by
    ``ATTENTION_FLOOR`` + its received attention over the mean. RoPE is the default one at ``theta`` unless the
    model's own ``rotary`` is given."""
    rotary = rotary or RotaryParams(inv_freq(head_dim, theta))
    budget = spec.code_bits(head_dim)
    out = []
    for cap in caps:
        t = cap.k.shape[2]
        pos = torch.arange(t)
        k = rotary.apply(cap.k.double(), pos, inverse=True)[:, :, skip:]
        q = rotary.apply(cap.q.double(), pos, inverse=True)[:, :, skip:]  # [B, H, T', D], [B, Hq, T', D]
        a = torch.ones(k.shape[:3], dtype=torch.float64)
        if spec.attention:
            got = received_attention(cap)[:, :, skip:]
            a = ATTENTION_FLOOR + got / got.mean((0, 2), keepdim=True)
        h, g = k.shape[1], q.shape[1] // k.shape[1]
        layer: dict[str, list[torch.Tensor]] = {n: [] for n in ("mean", "encode", "decode", "sigma", "bits", "levels")}
        for i in range(h):
            kk, ww = k[:, i].reshape(-1, head_dim), a[:, i].reshape(-1, 1) / a[:, i].sum()
            qq = q[:, i * g : (i + 1) * g].transpose(0, 1).reshape(-1, head_dim)
            w = pair_weight(qq)
            w_half, w_inv_half = torch.diag(w.sqrt()), torch.diag(w.rsqrt())
            m = (ww * kk).sum(0)
            y = (kk - m) @ w_half  # W symmetric: rows y = W^(1/2) (k - m)
            cov = y.T @ (ww * y)
            lam, u = block_klt(cov, pair_blocks(head_dim, spec.block, rotary.rotary_dim))
            layer["mean"].append(m)
            layer["encode"].append(u.T @ w_half)
            layer["decode"].append(w_inv_half @ u)
            layer["sigma"].append(lam.sqrt())
            layer["bits"].append(allocate_bits(lam, budget, widths=spec.widths))
            if spec.lloyd or spec.cubic:
                z = y @ u
                if spec.token_norm:  # fit what the coder quantizes: coefficients over their token's scale
                    z = z / (z.norm(dim=-1, keepdim=True) / lam.sum().sqrt()).clamp_min(1e-12)
                fit = cubic_levels if spec.cubic else lloyd_levels
                layer["levels"].append(fit(z, ww[:, 0], lam.sqrt(), layer["bits"][-1]))
        out.append(
            KLTLayer(
                mean=torch.stack(layer["mean"]).float(),
                encode=torch.stack(layer["encode"]).float(),
                decode=torch.stack(layer["decode"]).float(),
                sigma=torch.stack(layer["sigma"]).float(),
                bits=torch.stack(layer["bits"]),
                levels=torch.stack(layer["levels"]).float() if layer["levels"] else None,
            )
        )
    return out


def pair_blocks(head_dim: int, block: int, rotary_dim: int | None = None) -> list[torch.Tensor]:
    """Channel indices of each diagonal block of the transform: ``block`` channels, block / 2 consecutive rotary pairs
    p (each with its channels p and p + R/2, ``rotate_half`` over the first ``rotary_dim`` R channels, default all);
    channels past R in blocks of ``block`` consecutive channels, each alone for ``block`` 2 (so a 2-channel block is
    always one RoPE pair); ``block`` 0 or D: one block, in order; 1: each channel its own block (no transform)."""
    d = head_dim
    r = d if rotary_dim is None else rotary_dim
    if block in (0, d):
        return [torch.arange(d)]
    if block == 1:
        return list(torch.arange(d).split(1))
    if block % 2 or r % 2 or (r // 2) % (block // 2) or (block > 2 and (d - r) % block):
        raise FormatError(f"block {block}: expected an even divisor of head dim {d} (rotary dim {r})")
    rotary = [torch.cat([pairs, pairs + r // 2]) for pairs in torch.arange(r // 2).split(block // 2)]
    alone = list(torch.arange(r, d).split(1 if block == 2 else block)) if r < d else []
    return rotary + alone


def block_klt(cov: torch.Tensor, blocks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The KLT of ``cov`` [D, D] restricted to diagonal ``blocks`` (channel indices): variances lambda [D], descending,
    and the orthogonal U [D, D] whose columns are each block's eigenvectors (zero outside their block)."""
    d = cov.shape[0]
    lams, u = [], torch.zeros(d, d, dtype=cov.dtype)
    col = 0
    for idx in blocks:
        lam, vec = torch.linalg.eigh(cov[idx][:, idx])
        lams.append(lam.flip(0).clamp_min(0))
        u[idx, col : col + len(idx)] = vec.flip(1)
        col += len(idx)
    lam = torch.cat(lams)
    order = lam.argsort(descending=True, stable=True)
    return lam[order], u[:, order]


def lloyd_levels(
    z: torch.Tensor, weight: torch.Tensor, sigma: torch.Tensor, bits: torch.Tensor, steps: int = 30
) -> torch.Tensor:
    """Per coefficient the levels [D, 2^MAX_BITS] of a weighted 1-D Lloyd-Max on calibration coefficients z [N, D]
    (``weight`` [N]), started from the Gaussian codebook at its sigma; unused slots repeat the last level."""
    out = torch.zeros(z.shape[1], 1 << MAX_BITS, dtype=torch.float64)
    for b in range(1, MAX_BITS + 1):
        cols = torch.nonzero(bits == b).squeeze(1)
        if not len(cols):
            continue
        x = z[:, cols].T.contiguous()  # [n, N]
        c = gaussian_codebook(b)[0].double()[None, :] * sigma[cols, None]  # [n, 2^b]
        w = weight[None, :].expand_as(x)
        for _ in range(steps):
            idx = torch.searchsorted(((c[:, 1:] + c[:, :-1]) / 2).contiguous(), x)
            num = torch.zeros_like(c).scatter_add_(1, idx, w * x)
            den = torch.zeros_like(c).scatter_add_(1, idx, w)
            c = torch.where(den > 0, num / den.clamp_min(1e-300), c)
        out[cols, : 1 << b] = c
        out[cols, 1 << b :] = c[:, -1:]
    return out


def ascending_fit(basis: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Least-squares coefficients [C, P, 1] of ascending ``levels`` [C, n] in ``basis`` [n, P] (powers of the centered
    code), ascending themselves: where the fit bends back (an S-shaped codebook: two tight clusters) the straight
    line's, whose slope through ascending levels is never negative."""
    fit = torch.linalg.lstsq(basis.expand(len(levels), -1, -1), levels[..., None]).solution
    if basis.shape[1] <= 2:
        return fit
    line = torch.linalg.lstsq(basis[:, :2].expand(len(levels), -1, -1), levels[..., None]).solution
    line = torch.cat([line, torch.zeros_like(fit[:, 2:])], 1)
    bent = ((basis @ fit)[..., 0].diff(dim=1) < 0).any(1)
    return torch.where(bent[:, None, None], line, fit)


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
    out = torch.zeros(z.shape[1], 1 << MAX_BITS, dtype=torch.float64)
    lloyd = lloyd_levels(z, weight, sigma, bits)
    for b in range(1, MAX_BITS + 1):
        cols = torch.nonzero(bits == b).squeeze(1)
        if not len(cols):
            continue
        n = 1 << b
        u = centered_codes(b) / max(n - 1, 1)  # in [-1, 1]: a well-conditioned basis (the levels are the same cubic)
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


# ---------------------------------------------------------------------------------------------- coding
def quantize_coefficients(z: torch.Tensor, sigma: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """z^ [..., H, T, D]: each coefficient by the Gaussian Lloyd-Max codebook of its bits scaled by its sigma (0 bits:
    zero). ``sigma``, ``bits``: [H, D]."""
    out = torch.zeros_like(z)
    for b in range(1, MAX_BITS + 1):
        mask = bits == b  # [H, D]
        if not bool(mask.any()):
            continue
        c = gaussian_codebook(b)[0].to(z.device)
        edges = (c[1:] + c[:-1]) / 2
        x = z / sigma.clamp_min(1e-30)[:, None, :]
        coded = c[torch.bucketize(x.contiguous(), edges)] * sigma[:, None, :]
        out = torch.where(mask[:, None, :], coded, out)
    return out


def quantize_to_levels(z: torch.Tensor, levels: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """z^ [B, H, T, D]: each coefficient by its own levels [H, D, 2^MAX_BITS] (the first 2^bits; 0 bits: zero)."""
    b_, h, t, d = z.shape
    x = z.permute(1, 3, 0, 2).reshape(h, d, b_ * t).contiguous()  # [H, D, N]
    out = torch.zeros_like(x)
    for b in range(1, MAX_BITS + 1):
        mask = bits == b
        if not bool(mask.any()):
            continue
        lv = levels[:, :, : 1 << b]
        coded = lv.gather(2, torch.searchsorted(((lv[..., 1:] + lv[..., :-1]) / 2).contiguous(), x))
        out = torch.where(mask[:, :, None], coded, out)
    return out.reshape(h, d, b_, t).permute(2, 0, 3, 1)


class KLTQuantizer:
    """Quantize-dequantize one layer's post-RoPE keys [B, H, T, D] at known positions through the KLT coder."""

    def __init__(self, spec: KLTKeys, layer: KLTLayer, theta: float, norm_dtype: torch.dtype = torch.float16) -> None:
        self.spec, self.layer, self.norm_dtype = spec, layer, norm_dtype
        self.head_dim = layer.mean.shape[-1]
        self.freq = inv_freq(self.head_dim, theta)
        self.expected_norm = layer.sigma.pow(2).sum(-1).sqrt()  # [H]: E||z||^2 ^ 1/2

    def __call__(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """k^ [B, H, T, D] float32 (post-RoPE, like k)."""
        lay = self.layer
        if k.shape[1] != lay.mean.shape[0] or k.shape[-1] != self.head_dim:
            raise ShapeError(f"keys: expected [B, {lay.mean.shape[0]}, T, {self.head_dim}], got {tuple(k.shape)}")
        pre = rope(k.float(), positions, self.freq, inverse=True) - lay.mean[None, :, None, :]
        z = torch.einsum("hij,bhtj->bhti", lay.encode, pre)
        scale = torch.ones(*z.shape[:-1], 1)
        if self.spec.token_norm:
            scale = (z.norm(dim=-1, keepdim=True) / self.expected_norm[None, :, None, None]).to(self.norm_dtype).float()
            scale = scale.clamp_min(1e-12)
        if lay.levels is None:
            zq = quantize_coefficients(z / scale, lay.sigma, lay.bits) * scale
        else:
            zq = quantize_to_levels(z / scale, lay.levels, lay.bits) * scale
        back = torch.einsum("hij,bhtj->bhti", lay.decode, zq) + lay.mean[None, :, None, :]
        return rope(back, positions, self.freq)


class KLTKeyHistory(DecodedHistory):
    """The ``cpu-decoded`` history with its compressed keys coded by a ``KLTQuantizer`` (values unchanged); keys
    arrive centered by the layer's post-RoPE ``center`` (or not), which the coder adds back and removes again."""

    def __init__(
        self, store: CompressedKVCache, sink_tokens: int, quantizer: KLTQuantizer, center: torch.Tensor | None
    ) -> None:
        super().__init__(store, sink_tokens)
        self.quantizer = quantizer
        self.center = None if center is None else center.float().to(store.device)[None, :, None, :]
        self.coded = torch.zeros(store.batch_size, store.num_kv_heads, 0, self.key_dim, device=store.device)

    def note_exact(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Code the next tokens' keys [B, H, T, D] (called once per chunk, before the store holds them)."""
        super().note_exact(k, v)
        start = self.coded.shape[2]
        if int(self.store.lengths[0]) != start:
            return
        raw = k.to(self.store.dtype).float()
        if self.center is not None:
            raw = raw + self.center
        coded = self.quantizer(raw, torch.arange(start, start + k.shape[2]))
        if self.center is not None:
            coded = coded - self.center
        self.coded = torch.cat([self.coded, self.transform_exact_keys(coded)], dim=2)

    def _decode_keys(self, fields: dict) -> torch.Tensor:
        n = fields["key_norm"].shape[2]
        if self.count + n > self.coded.shape[2]:
            raise ShapeError(f"KLT keys hold {self.coded.shape[2]} positions, asked up to {self.count + n}")
        return self.coded[:, :, self.count : self.count + n]


@dataclass
class KLTPlan:
    """A KLT-key row: the spec, each layer's calibrated coder and the model's RoPE theta."""

    spec: KLTKeys
    layers: list[KLTLayer]
    theta: float

    def format_bytes_per_token(self, layer: int, fmt: KVFormat, head_dim: int) -> float:
        """Bytes of one token of ``fmt`` with its keys replaced by this coder."""
        return (
            fmt.bytes_per_token(head_dim) - fmt.key_bytes_per_token(head_dim) + self.spec.key_bytes_per_token(head_dim)
        )


def _history(store: CompressedKVCache, sinks: int, center: torch.Tensor | None, quantizer) -> KLTKeyHistory:
    """A ``CodedKeyLayer`` history for KLT keys."""
    return KLTKeyHistory(store, sinks, quantizer, center)


class KLTKeyCache(TurboQuantCache):
    """A ``TurboQuantCache`` (backend ``cpu-decoded``) with KLT-coded keys in every compressed layer."""

    def __init__(self, model, config, plan: KLTPlan, **kwargs) -> None:
        super().__init__(model, config, backend="cpu-decoded", **kwargs)
        if model_dims(model.config)[3] != plan.layers[0].mean.shape[-1]:
            raise ShapeError("KLT plan head dim differs from the model's")
        for i, layer in enumerate(self._tq_layers):
            if not layer.fmt.is_passthrough:
                q = KLTQuantizer(plan.spec, plan.layers[i], plan.theta, layer.fmt.norm_torch_dtype)
                self.layers[i] = CodedKeyLayer(layer, partial(_history, quantizer=q))


def rope_theta(config) -> float:
    """The model's RoPE theta (transformers 5 ``rope_parameters`` or the older ``rope_theta``)."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
