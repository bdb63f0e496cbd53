"""Chunked prefill (``kernels.prefill``) with sinks, soft cap and sliding window against the reference.

Blocks wholly before the first chunk row's window start point at a block of 0xFF bytes (fp16 NaN), as vLLM's
freed sliding-window blocks point at its null block: a kernel that read one would return NaN.
"""

from __future__ import annotations

import pytest
import torch

from jetson_tq.attention.extras import AttentionExtras
from jetson_tq.attention.reference import paged_attention_prefill
from jetson_tq.kernels.prefill_plan import PrefillTuning, chunked_prefill
from tests.helpers.kernel_cases import DEVICE, build_paged_kv, fmt_for, fresh_seed, rel_err
from tests.helpers.masking import poison_freed

pytestmark = pytest.mark.kernel

# (format, head dim, G, compressed lens, recent lens, chunk T, window kind, extras kind)
CASES = [
    ("mse_k4v3", 64, 2, [70, 20], [16, 16], 12, "sliding", "all"),
    ("mse_k4v3", 128, 4, [60], [16], 7, "block", "sinks"),
    ("blog_k3v2", 80, 1, [50], [8], 9, "sliding", "window"),
    ("mse_k4v3", 64, 3, [64], [16], 20, "block", "all"),
    ("fp16", 64, 2, [40], [4], 6, "sliding", "cap"),
    ("klt52_g3", 64, 2, [50], [8], 5, "sliding", "all"),
]


def _extras(kind: str, hq: int, gen: torch.Generator, window: int) -> AttentionExtras:
    return AttentionExtras(
        sinks=(torch.randn(hq, generator=gen) * 2 + 6).to(DEVICE) if kind in ("sinks", "all") else None,
        soft_cap=12.0 if kind in ("cap", "all") else None,
        sliding_window=window if kind in ("window", "all") else None,
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-D{c[1]}-G{c[2]}-{c[6]}-{c[7]}")
@pytest.mark.parametrize("knobs", [{}, {"workspace_tokens": 64}, {"reproducible": True}], ids=["one", "segs", "repro"])
def test_prefill_extras_match_reference(case, knobs):
    name, d, g, comp, rec, t, window_kind, kind = case
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    hkv, ring = 2, max(rec)
    hist = [c + r for c, r in zip(comp, rec)]
    if window_kind == "block":
        rec = [s % ring for s in hist]
    comp = [s - r for s, r in zip(hist, rec)]
    fmt = fmt_for(name, d).with_(recent_tokens=ring, window=window_kind)
    kv = build_paged_kv(fmt, hkv, d, comp, rec, torch.float16, gen, recent_cap=ring, pages_hold=[s + t for s in hist])
    b = len(comp)
    q = (torch.randn(b, hkv * g, t, d, generator=gen) * 3).half().to(DEVICE)
    k = (torch.randn(b, hkv, t, d, generator=gen) * 2).half().to(DEVICE)
    v = torch.randn(b, hkv, t, d, generator=gen).half().to(DEVICE)
    w = 37  # reaches below the ring into the compressed history, not to its start
    extras = _extras(kind, hkv * g, gen, w)
    if extras.sliding_window is not None:
        kv = poison_freed(kv, [s - w + 1 for s in hist])
    ref = paged_attention_prefill(q, k, v, kv, extras=extras)
    out = chunked_prefill(q, k, v, kv, tuning=PrefillTuning(**knobs), extras=extras)
    err = rel_err(out, ref)
    assert err <= 2e-3, f"seed={seed} {case} {knobs}: rel err {err:.2e}"


def test_plain_prefill_unchanged_by_an_empty_extras():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    fmt = fmt_for("mse_k4v3", 64).with_(recent_tokens=16, window="sliding")
    kv = build_paged_kv(fmt, 2, 64, [40], [16], torch.float16, gen, recent_cap=16, pages_hold=[61])
    q = torch.randn(1, 4, 5, 64, generator=gen).half().to(DEVICE)
    k, v = (torch.randn(1, 2, 5, 64, generator=gen).half().to(DEVICE) for _ in range(2))
    a = chunked_prefill(q, k, v, kv)
    big = chunked_prefill(q, k, v, kv, extras=AttentionExtras(sliding_window=1 << 20))
    assert torch.equal(a, big), f"seed={seed}"
