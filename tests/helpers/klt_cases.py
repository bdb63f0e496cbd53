"""Transform-coded (klt) keys for the kernel tests: calibrated-like transforms and the reference's tie distances."""

from __future__ import annotations

import torch

from jetson_tq.codec.klt import MAX_CODE_BITS, KeyTransform, KeyTransformCoder, RotaryParams, default_inv_freq

#: transform structures the kernels specialize on (``kernels._common.KltSpec``), as ``uneven_transform`` arguments:
#: a dense transform or one 2 x 2 block per RoPE pair (``PAIRS``), codes of any width 0-8 or of 0/2/4/8 bits
#: (``ONE_BYTE``)
STRUCTURES: dict[str, dict] = {
    "dense": {},
    "pairs-bytes": dict(pairs=True, widths=(8, 4, 2, 0)),
    "pairs": dict(pairs=True),
    "dense-bytes": dict(widths=(8, 4, 2, 0)),
}


def uneven_transform(
    num_heads: int,
    head_dim: int,
    code_bits: int,
    rotary_dim: int,
    attention_scaling: float,
    gen: torch.Generator,
    pairs: bool = False,
    widths: tuple[int, ...] = tuple(range(MAX_CODE_BITS, -1, -1)),
) -> KeyTransform:
    """A calibrated-like transform: per head a random orthogonal encode matrix A with decode B = A^T (``pairs``: a
    random 2 x 2 rotation per RoPE pair and a sign per unrotated channel, coefficients shuffled, as a block-2
    calibration gives), a random mean, bits cycling through ``widths`` (default 8, 7, ..., 0; the last cut to fit) up
    to ``code_bits`` at shuffled coefficients, random sorted levels (spread like the coefficients); RoPE with
    transformers' default frequencies over ``rotary_dim`` channels."""
    h, d = num_heads, head_dim
    a = pair_rotations(h, d, rotary_dim, gen) if pairs else dense_rotations(h, d, gen)
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
            lv = (torch.randn(n, generator=gen) * 2).sort().values if n > 1 else torch.zeros(1)
            levels[i, c, :n], levels[i, c, n:] = lv, lv[-1]
    rotary = RotaryParams(default_inv_freq(rotary_dim, 10000.0), attention_scaling)
    mean = torch.randn(h, d, generator=gen) * 0.3
    return KeyTransform(mean, a, a.transpose(1, 2).contiguous(), bits, levels, rotary)


def dense_rotations(num_heads: int, head_dim: int, gen: torch.Generator) -> torch.Tensor:
    """Random orthogonal matrices [H, D, D] (float32)."""
    return torch.linalg.qr(torch.randn(num_heads, head_dim, head_dim, generator=gen, dtype=torch.float64))[0].float()


def pair_rotations(num_heads: int, head_dim: int, rotary_dim: int, gen: torch.Generator) -> torch.Tensor:
    """Random orthogonal encode matrices [H, D, D] (rows = coefficients, float32) that mix channels only within RoPE
    pairs (c, c + R/2): a random 2 x 2 rotation or reflection per pair, a sign per unrotated channel, rows shuffled."""
    half = rotary_dim // 2
    out = torch.zeros(num_heads, head_dim, head_dim, dtype=torch.float64)
    for i in range(num_heads):
        row = 0
        for p in range(half):
            q = torch.linalg.qr(torch.randn(2, 2, generator=gen, dtype=torch.float64))[0]
            out[i, row : row + 2][:, [p, p + half]] = q
            row += 2
        for c in range(rotary_dim, head_dim):
            out[i, row, c] = 1.0 if torch.rand(1, generator=gen).item() < 0.5 else -1.0
            row += 1
        out[i] = out[i][torch.randperm(head_dim, generator=gen)]
    return out.float()


def tie_distance(coder: KeyTransformCoder, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[N, H, D]: each coefficient's distance (float64) to its nearest decision threshold, relative to the L1 norm
    of its key's centered pre-RoPE channels (the scale of a product's rounding); inf for 0-bit coefficients."""
    t = coder.t
    x = t.rotary.apply(k.double(), positions[:, None].expand(k.shape[:2]), inverse=True) - t.mean.double()
    z = torch.einsum("hij,nhj->nhi", t.encode.double(), x)
    dist = (z.unsqueeze(-1) - coder.thresholds.double()).abs().amin(-1)
    return dist / x.abs().sum(-1, keepdim=True).clamp_min(1e-30)
