"""Transform-coded (klt) keys for the kernel tests: calibrated-like transforms and the reference's tie distances."""

from __future__ import annotations

import torch

from jetson_tq.codec.klt import MAX_CODE_BITS, KeyTransform, KeyTransformCoder, RotaryParams, default_inv_freq

#: transform structures the kernels specialize on (``kernels._common.KltSpec``), as ``uneven_transform`` arguments:
#: codes of any width 0-8 (two byte loads) or of 0/2/4/8 bits (one), levels sorted at random or a cubic of the code
#: (no level table: ``CUBIC``); ``diagonal-*``: no transform, each coefficient a channel scaled (``DIAGONAL``)
STRUCTURES: dict[str, dict] = {
    "any": {},
    "bytes": dict(widths=(8, 4, 2, 0)),
    "cubic": dict(cubic=True),
    "bytes-cubic": dict(widths=(8, 4, 2, 0), cubic=True),
    "diagonal": dict(diagonal=True),
    "diagonal-bytes-cubic": dict(widths=(8, 4, 2, 0), cubic=True, diagonal=True),
}


def uneven_transform(
    num_heads: int,
    head_dim: int,
    code_bits: int,
    rotary_dim: int,
    attention_scaling: float,
    gen: torch.Generator,
    widths: tuple[int, ...] = tuple(range(MAX_CODE_BITS, -1, -1)),
    cubic: bool = False,
    diagonal: bool = False,
) -> KeyTransform:
    """A calibrated-like transform: per head a random orthogonal encode matrix A with decode B = A^T, a random mean,
    bits cycling through ``widths`` (default 8, 7, ..., 0; the last cut to fit) up to ``code_bits`` at shuffled
    coefficients, random sorted levels (spread like the coefficients; ``cubic``: a random ascending cubic of the
    code); RoPE with transformers' default frequencies
    over ``rotary_dim`` channels. ``diagonal``: no transform, A = diag(1 / s) and B = diag(s) with random per-channel
    scales s in [0.5, 2) (a whitening by the channel's scale alone: ``KltSpec.DIAGONAL``)."""
    h, d = num_heads, head_dim
    if diagonal:
        s = 0.5 + 1.5 * torch.rand(h, d, generator=gen)
        a, dec = torch.diag_embed(1 / s), torch.diag_embed(s)
    else:
        a = torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))[0].float()
        dec = a.transpose(1, 2).contiguous()
    pattern = [widths[i % len(widths)] for i in range(d)]
    bits = torch.zeros(h, d, dtype=torch.long)
    for i in range(h):
        left, row = code_bits, []
        for b in pattern:
            row.append(min(b, left))
            left -= row[-1]
        for c in range(d):  # what the pattern left over: the next allowed width per coefficient while any is left
            wider = [b for b in widths if b > row[c]]
            if left and wider and min(wider) - row[c] <= left:
                left -= min(wider) - row[c]
                row[c] = min(wider)
        bits[i] = torch.tensor(row)[torch.randperm(d, generator=gen)]
    levels = torch.zeros(h, d, 1 << MAX_CODE_BITS)
    for i in range(h):
        for c in range(d):
            n = 1 << int(bits[i, c])
            if cubic and n > 1:  # p x + q x^2 + r x^3 on x in [-1, 1], ascending: p - 2 |q| > 0 <= r
                x = torch.linspace(-1, 1, n, dtype=torch.float64)
                p, q, r, shift = torch.rand(4, generator=gen, dtype=torch.float64)
                p, q = 0.5 + p, (q - 0.5) * 0.6 * (0.5 + p)
                lv = (shift - 0.5 + 4 * (p * x + q * x**2 + r * x**3) / (p + q.abs() + r)).float()
            elif n > 1:
                lv = (torch.randn(n, generator=gen) * 2).sort().values
            else:
                lv = torch.zeros(1)
            levels[i, c, :n], levels[i, c, n:] = lv, lv[-1]
    rotary = RotaryParams(default_inv_freq(rotary_dim, 10000.0), attention_scaling)
    mean = torch.randn(h, d, generator=gen) * 0.3
    return KeyTransform(mean, a, dec, bits, levels, rotary)


def tie_distance(coder: KeyTransformCoder, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[N, H, D]: each coefficient's distance (float64) to its nearest decision threshold, relative to the L1 norm
    of its key's centered pre-RoPE channels (the scale of a product's rounding); inf for 0-bit coefficients."""
    t = coder.t
    x = t.rotary.apply(k.double(), positions[:, None].expand(k.shape[:2]), inverse=True) - t.mean.double()
    z = torch.einsum("hij,nhj->nhi", t.encode.double(), x)
    dist = (z.unsqueeze(-1) - coder.thresholds.double()).abs().amin(-1)
    return dist / x.abs().sum(-1, keepdim=True).clamp_min(1e-30)


def with_sink(transform: KeyTransform, gen: torch.Generator, key_scale: float = 4.0) -> KeyTransform:
    """``transform`` with a random calibrated sink (a key ``key_scale`` times a typical one, so position 0 draws a
    large share of the attention, as a model's sink does)."""
    from dataclasses import replace

    h, d = transform.num_heads, transform.head_dim
    return replace(
        transform,
        sink_key=torch.randn(h, d, generator=gen) * key_scale,
        sink_value=torch.randn(h, d, generator=gen),
    )
