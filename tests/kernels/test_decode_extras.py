"""Fused hybrid decode (``kernels.hybrid_decode``) with sinks, soft cap and sliding window against the reference.

Blocks wholly before each sequence's window start point at a block of 0xFF bytes (fp16 NaN), as vLLM's freed
sliding-window blocks point at its null block: a kernel that read one would return NaN. Several split counts, so
the window's lower edge and the sink (added by split 0 only) meet the split merge.
"""

from __future__ import annotations

import pytest
import torch

from jetson_tq.attention.extras import AttentionExtras
from jetson_tq.attention.reference import paged_attention_decode
from jetson_tq.kernels.hybrid_decode_plan import DecodeTuning, hybrid_decode
from tests.helpers.kernel_cases import DEVICE, build_paged_kv, fmt_for, fresh_seed, rel_err
from tests.helpers.masking import poison_freed

pytestmark = pytest.mark.kernel

# (format, head dim, G, compressed lens, recent lens (ring = max), window kind, extras kind, sliding window)
CASES = [
    ("mse_k4v3", 64, 2, [90, 20], [16, 16], "sliding", "all", 37),
    ("mse_k4v3", 128, 4, [80], [16], "block", "sinks", None),
    ("blog_k3v2", 80, 1, [70, 5], [8, 8], "sliding", "window", 30),
    ("mse_k4v3", 64, 3, [64, 96], [16, 16], "sliding", "all", 8),  # a window inside the ring: ring rows masked
    ("fp16", 64, 2, [60], [4], "sliding", "cap", None),
    ("klt52_g3", 64, 2, [70], [8], "sliding", "all", 25),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-D{c[1]}-G{c[2]}-{c[5]}-{c[6]}")
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_extras_match_reference(case, splits):
    name, d, g, comp, rec, window_kind, kind, w = case
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    hkv, ring = 2, max(rec)
    fmt = fmt_for(name, d).with_(recent_tokens=ring, window=window_kind)
    kv = build_paged_kv(fmt, hkv, d, comp, rec, torch.float16, gen, recent_cap=ring)
    q = (torch.randn(len(comp), hkv * g, d, generator=gen) * 3).half().to(DEVICE)
    extras = AttentionExtras(
        sinks=(torch.randn(hkv * g, generator=gen) * 2 + 6).to(DEVICE) if kind in ("sinks", "all") else None,
        soft_cap=12.0 if kind in ("cap", "all") else None,
        sliding_window=w,
    )
    if w is not None:
        kv = poison_freed(kv, [c + r - w for c, r in zip(comp, rec)])
    ref = paged_attention_decode(q, kv, extras=extras)
    out = hybrid_decode(q, kv, tuning=DecodeTuning(num_splits=splits), extras=extras)
    err = rel_err(out, ref)
    assert err <= 2e-3, f"seed={seed} {case} splits={splits}: rel err {err:.2e}"


@pytest.mark.parametrize("window_kind", ["block", "sliding"])
def test_window_inside_a_partly_filled_ring(window_kind):
    """A ring of capacity 16 holding fewer tokens (block window: the own block's; sliding: a short sequence), rows by
    position p % 16, and a window that ends inside it: the ring rows before the window start are masked."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    fmt = fmt_for("mse_k4v3", 64).with_(recent_tokens=16, window=window_kind)
    comp, rec = ([64, 32], [5, 9]) if window_kind == "block" else ([0, 0], [11, 14])
    kv = build_paged_kv(fmt, 2, 64, comp, rec, torch.float16, gen, recent_cap=16)
    q = torch.randn(2, 4, 64, generator=gen).half().to(DEVICE)
    extras = AttentionExtras(sliding_window=4, sinks=torch.randn(4, generator=gen).to(DEVICE))
    ref = paged_attention_decode(q, kv, extras=extras)
    for splits in (1, 2):
        err = rel_err(hybrid_decode(q, kv, tuning=DecodeTuning(num_splits=splits), extras=extras), ref)
        assert err <= 2e-3, f"seed={seed} splits={splits}: rel err {err:.2e}"


def test_plain_decode_unchanged_by_a_window_beyond_the_history():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    fmt = fmt_for("mse_k4v3", 64).with_(recent_tokens=16, window="sliding")
    kv = build_paged_kv(fmt, 2, 64, [50], [16], torch.float16, gen, recent_cap=16)
    q = torch.randn(1, 4, 64, generator=gen).half().to(DEVICE)
    a = hybrid_decode(q, kv)
    b = hybrid_decode(q, kv, extras=AttentionExtras(sliding_window=1 << 20))
    assert torch.equal(a, b), f"seed={seed}"
