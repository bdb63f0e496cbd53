"""Transform-coded (klt) keys for the kernel tests: calibrated-like transforms and the reference's tie distances."""

from __future__ import annotations

import torch

from jetson_tq.codec.klt import MAX_CODE_BITS, KeyTransform, KeyTransformCoder, RotaryParams, default_inv_freq


def uneven_transform(
    num_heads: int, head_dim: int, code_bits: int, rotary_dim: int, attention_scaling: float, gen: torch.Generator
) -> KeyTransform:
    """A calibrated-like transform: per head a random orthogonal encode matrix A with decode B = A^T, a random mean,
    bits 8, 7, ..., 0 over and over (the last cut to fit) up to ``code_bits`` at shuffled coefficients, random sorted
    levels (spread like the coefficients); RoPE with transformers' default frequencies over ``rotary_dim`` channels."""
    h, d = num_heads, head_dim
    a = torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))[0].float()
    pattern = [MAX_CODE_BITS - i % (MAX_CODE_BITS + 1) for i in range(d)]
    bits = torch.zeros(h, d, dtype=torch.long)
    for i in range(h):
        left, row = code_bits, []
        for b in pattern:
            row.append(min(b, left))
            left -= row[-1]
        for c in range(d):  # what the pattern left over: one more bit per coefficient while any is left
            if left and row[c] < MAX_CODE_BITS:
                row[c], left = row[c] + 1, left - 1
        bits[i] = torch.tensor(row)[torch.randperm(d, generator=gen)]
    levels = torch.zeros(h, d, 1 << MAX_CODE_BITS)
    for i in range(h):
        for c in range(d):
            n = 1 << int(bits[i, c])
            lv = (torch.randn(n, generator=gen) * 2).sort().values if n > 1 else torch.zeros(1)
            levels[i, c, :n], levels[i, c, n:] = lv, lv[-1]
    rotary = RotaryParams(default_inv_freq(rotary_dim, 10000.0), attention_scaling)
    mean = torch.randn(h, d, generator=gen) * 0.3
    return KeyTransform(mean, a, a.transpose(1, 2).contiguous(), bits, levels, rotary)


def tie_distance(coder: KeyTransformCoder, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[N, H, D]: each coefficient's distance (float64) to its nearest decision threshold, relative to the L1 norm
    of its key's centered pre-RoPE channels (the scale of a product's rounding); inf for 0-bit coefficients."""
    t = coder.t
    x = t.rotary.apply(k.double(), positions[:, None].expand(k.shape[:2]), inverse=True) - t.mean.double()
    z = torch.einsum("hij,nhj->nhi", t.encode.double(), x)
    dist = (z.unsqueeze(-1) - coder.thresholds.double()).abs().amin(-1)
    return dist / x.abs().sum(-1, keepdim=True).clamp_min(1e-30)
