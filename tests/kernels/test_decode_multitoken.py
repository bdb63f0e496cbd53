"""Multi-token fused decode (speculative verification rows: q [B, Q, Hq, D] over the history plus the Q new tokens'
own k, v) against the reference ``paged_attention_decode``'s multi-token form.

Histories are consistent with the ring (sliding: a full ring once anything is compressed; block: the own block's
tokens), the pages hold the new tokens too (vLLM writes them before attention), and Q crosses a block boundary in
the block-window cases, so rows of one sequence read the same positions exactly or compressed by their own window.
"""

from __future__ import annotations

import pytest
import torch

from jetson_tq.attention.extras import NO_EXTRAS, AttentionExtras
from jetson_tq.attention.reference import paged_attention_decode, paged_attention_prefill
from jetson_tq.kernels.hybrid_decode_plan import DecodeTuning, hybrid_decode
from tests.helpers.kernel_cases import DEVICE, build_paged_kv, fmt_for, fresh_seed, rel_err
from tests.helpers.masking import poison_freed

pytestmark = pytest.mark.kernel

R = 8  # ring capacity: block windows restart every 8 positions
# (format, head dim, G, window kind, extras kind)
CASES = [
    ("mse_k4v3", 64, 2, "sliding", "none"),
    ("mse_k4v3", 128, 4, "block", "all"),
    ("mse_k4v3", 64, 1, "sliding", "all"),
    ("blog_k3v2", 80, 2, "block", "none"),
    ("blog_k3v2", 80, 3, "sliding", "all"),
    ("fp16", 64, 2, "block", "all"),
]


def _case(name: str, d: int, g: int, window: str, kind: str, qn: int, gen: torch.Generator):
    hkv = 2
    fmt = fmt_for(name, d).with_(recent_tokens=R, window=window)
    # sliding: a full ring behind compressed tokens, and a short sequence all in the ring; block: a partly filled
    # block (Q >= 3 crosses into the next one) and an empty one
    comp, rec = ([40, 0], [R, 5]) if window == "sliding" else ([40, 16], [5, 0])
    hist = [c + r for c, r in zip(comp, rec)]
    kv = build_paged_kv(fmt, hkv, d, comp, rec, torch.float16, gen, recent_cap=R, pages_hold=[h + qn for h in hist])
    b = len(comp)
    q = (torch.randn(b, qn, hkv * g, d, generator=gen) * 3).half().to(DEVICE)
    k = (torch.randn(b, qn, hkv, d, generator=gen) * 2).half().to(DEVICE)
    v = torch.randn(b, qn, hkv, d, generator=gen).half().to(DEVICE)
    extras = NO_EXTRAS
    if kind == "all":
        w = 11
        extras = AttentionExtras(
            sinks=(torch.randn(hkv * g, generator=gen) + 3).to(DEVICE), soft_cap=12.0, sliding_window=w
        )
        kv = poison_freed(kv, [h - w + 1 for h in hist])  # a read before the first query's window gives NaN
    return kv, q, k, v, extras


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-D{c[1]}-G{c[2]}-{c[3]}-{c[4]}")
@pytest.mark.parametrize("qn", [1, 2, 4])
@pytest.mark.parametrize("splits", [1, 3])
def test_multitoken_decode_matches_reference(case, qn, splits):
    seed = fresh_seed()  # a new one every run (one seed per case: a second doubled the module's ~160 CPU-s)
    gen = torch.Generator().manual_seed(seed)
    kv, q, k, v, extras = _case(*case, qn, gen)
    ref = paged_attention_decode(q, kv, extras=extras, k=k, v=v)
    out = hybrid_decode(q, kv, tuning=DecodeTuning(num_splits=splits), extras=extras, k=k, v=v)
    assert out.shape == q.shape
    err = rel_err(out, ref)
    assert err <= 2e-3, f"seed={seed} {case} Q={qn} splits={splits}: rel err {err:.2e}"


def test_reference_multitoken_is_the_prefill_chunk():
    """The reference's multi-token form is a Q-token prefill chunk over the same history, bit for bit."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    kv, q, k, v, extras = _case("mse_k4v3", 64, 2, "block", "all", 3, gen)
    got = paged_attention_decode(q, kv, extras=extras, k=k, v=v)
    want = paged_attention_prefill(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), kv, extras=extras)
    assert torch.equal(got, want.transpose(1, 2)), f"seed={seed}"


def test_multitoken_into_a_strided_output_and_views():
    """vLLM's layout: q, k, v and the output as [rows * Q, H, D] token rows viewed [rows, Q, H, D] (k, v slices of one
    fused tensor: non-contiguous heads), written in place."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    kv, q, k, v, _ = _case("mse_k4v3", 64, 2, "sliding", "none", 3, gen)
    b, qn, hkv, d = k.shape
    fused = torch.cat([k, v], dim=2).reshape(b * qn, 2 * hkv, d)  # [tokens, K heads | V heads, D]
    kf, vf = fused[:, :hkv].view(b, qn, hkv, d), fused[:, hkv:].view(b, qn, hkv, d)
    out = torch.full((b * qn + 2, q.shape[2], d), float("nan"), dtype=q.dtype, device=DEVICE)
    hybrid_decode(q, kv, out=out[: b * qn].view(b, qn, q.shape[2], d), k=kf, v=vf)
    ref = paged_attention_decode(q, kv, k=k, v=v)
    assert rel_err(out[: b * qn].view_as(ref), ref) <= 2e-3, f"seed={seed}"
    assert bool(out[b * qn :].isnan().all())  # rows past the batch untouched
