"""Chunked prefill (``kernels.prefill``) against the PyTorch reference ``paged_attention_prefill``.

Tolerance (relative L2 error): 2e-3 with fp16 inputs, 1.5e-2 with bf16 — the same fp16 tensor-core
operands as decode (transformed query, probabilities, P*scale) with fp32 accumulation; bf16 adds
bf16 rounding of the output and of the chunk/buffer products.
"""

from __future__ import annotations

import pytest
import torch

from jetson_tq.attention.reference import paged_attention_prefill
from jetson_tq.errors import ShapeError
from jetson_tq.format import exact_count
from jetson_tq.kernels.prefill_plan import (
    SHARED_BYTES,
    WORKSPACE_BYTES,
    PrefillTuning,
    chunked_prefill,
    fit_stages,
    workspace_segment,
)
from tests.helpers.kernel_cases import DEVICE, GPU, build_paged_kv, fmt_for, fresh_seed, rel_err

pytestmark = pytest.mark.kernel

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2, torch.float32: 2e-3}

# (format, head dim, G, compressed lens, recent lens, chunk length T); the ring size is max(recent lens)
SMALL = [
    ("blog_k3v2", 128, 4, [90, 0], [12, 5], 17),  # ragged history; one sequence with no compressed tokens
    ("blog_k3v2", 64, 7, [33], [0], 9),  # no buffer; GQA 7
    ("blog_k3v2", 80, 1, [20, 50], [3, 0], 1),  # one query token
    ("blog_k3v2", 256, 2, [40], [2], 5),
    ("blog_k3v2", 50, 4, [30], [4], 6),
    ("blog_k3v2", 100, 4, [0], [0], 12),  # empty history: plain causal attention over the chunk
    ("k4v4", 96, 4, [50], [7], 8),
    ("mse_k3v2", 128, 4, [40], [3], 4),
    ("mse_k4v3", 128, 4, [35], [2], 6),
    ("mse_k4v3u", 64, 4, [30], [2], 5),
    ("mse_k3v3w256", 128, 4, [30], [200], 6),  # the 5x preset: one value group per token, a 256-row ring
    ("fp16", 64, 4, [25], [1], 10),
    ("klt52_g3", 128, 4, [40], [3], 6),  # klt keys: decoded through their transform and RoPE at their positions
    ("klt52_g3", 64, 7, [33], [0], 9),
    ("klt52_g3", 80, 2, [30], [4], 5),
    ("kl52_smollm2", 64, 3, [40], [3], 6),  # the 5x preset's format: klt keys, 3-bit mse values
    ("mse_k4v3+vmse3", 128, 4, [35], [2], 6),  # mse values: ||v|| Pi_v^T c[idx] in the workspace (Hadamard Pi_v)
    ("mse_k4v3+vmse3", 64, 4, [30], [2], 5),
    ("mse_k4v3+vmse3", 96, 2, [25], [3], 4),  # dense Pi_v
    ("blog_k3v2+vmse2", 80, 1, [20], [3], 3),
]
LARGE = [
    ("blog_k3v2", 128, 4, [3000, 77, 0], [128, 0, 5], 300),
    ("blog_k3v2", 128, 7, [1500], [64], 129),
    ("blog_k3v2", 64, 4, [2100, 10], [3, 100], 64),
    ("blog_k3v2", 256, 2, [800], [9], 33),
    ("blog_k3v2", 96, 4, [900], [1], 50),
    ("blog_k3v2", 80, 4, [512], [0], 1),
    ("blog_k3v2", 50, 4, [300], [5], 40),
    ("blog_k3v2", 100, 4, [0, 400], [0, 2], 70),
    ("k4v4", 128, 4, [1000], [20], 64),
    ("mse_k3v2", 128, 4, [700], [5], 100),
    ("mse_k4v3", 128, 4, [900], [30], 70),
    ("mse_k4v3u", 128, 4, [900], [30], 70),
    ("mse_k3v3w256", 128, 4, [900], [256], 70),
    ("fp16", 128, 4, [300], [2], 30),
    ("klt52_g3", 128, 4, [900], [30], 70),
    ("klt52_g3", 64, 7, [1500], [64], 129),
    ("klt52_g3", 96, 4, [700], [5], 33),
    ("kl52_smollm2", 64, 3, [1500], [256], 100),
    ("mse_k4v3+vmse3", 128, 4, [900], [30], 70),
    ("mse_k4v3+vmse3", 96, 4, [900], [1], 50),
    ("blog_k3v2+vmse2", 80, 4, [512], [0], 1),
]
CASES = LARGE if GPU else SMALL


def _check(name, d, g, comp, rec, t, dtype, seed, window="sliding", ring_rows=None, **knobs):
    gen = torch.Generator().manual_seed(seed)
    hkv = 2
    # The ring has R = max(rec) rows and, as in vLLM and CompressedKVCache, holds min(s, R) of the s history
    # tokens (block window: ``ring_rows(s, R)`` of them, the own block's); the pages hold history and chunk (vLLM
    # writes the chunk before attention).
    ring = max(rec)
    hist = [c + r for c, r in zip(comp, rec)]
    rec = [(ring_rows or min)(s, ring) for s in hist]
    comp = [s - r for s, r in zip(hist, rec)]
    hold = [s + t for s in hist]
    fmt = fmt_for(name, d).with_(recent_tokens=ring, window=window)  # the window the ring of R rows serves
    kv = build_paged_kv(fmt, hkv, d, comp, rec, dtype, gen, recent_cap=ring, pages_hold=hold)
    b = len(comp)
    q = (torch.randn(b, hkv * g, t, d, generator=gen) * 3).to(dtype).to(DEVICE)
    k = (torch.randn(b, hkv, t, d, generator=gen) * 2).to(dtype).to(DEVICE)
    v = torch.randn(b, hkv, t, d, generator=gen).to(dtype).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    chunked_prefill(q, k, v, kv, out=out, tuning=PrefillTuning(**knobs))
    ref = paged_attention_prefill(q, k, v, kv)
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"seed={seed} {name} {window} D={d} G={g} lens={comp}+{rec} T={t}: rel err {err:.2e}"


@pytest.mark.parametrize("name,d,g,comp,rec,t", CASES, ids=[f"{c[0]}-D{c[1]}-G{c[2]}-T{c[5]}" for c in CASES])
def test_prefill_matches_reference(name, d, g, comp, rec, t):
    _check(name, d, g, comp, rec, t, torch.float16, fresh_seed())


# window: block — chunks that start inside a block, on a boundary (history 48 = 3 x 16, nothing in the ring), and
# straddle one or more boundaries; the ring holds the own block's s % R tokens (vLLM) or exact_count(s) (the cache)
BLOCK_CASES = [
    ("mse_k4v3", 64, 2, [40, 48], [16, 0], 21, "vllm"),
    ("blog_k3v2", 128, 2, [20], [16], 5, "cache"),
    ("mse_k4v3", 80, 1, [0, 33], [16, 0], 20, "cache"),
]
RING_ROWS = {"vllm": lambda s, r: s % r, "cache": lambda s, r: exact_count(s, r, True)}


@pytest.mark.parametrize(
    "name,d,g,comp,rec,t,rows", BLOCK_CASES, ids=[f"{c[0]}-D{c[1]}-T{c[5]}-{c[6]}" for c in BLOCK_CASES]
)
def test_block_window_prefill_matches_reference(name, d, g, comp, rec, t, rows):
    _check(name, d, g, comp, rec, t, torch.float16, fresh_seed(), window="block", ring_rows=RING_ROWS[rows])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_dtypes(dtype):
    _check("blog_k3v2", 128, 4, [200 if GPU else 40], [6], 40 if GPU else 7, dtype, fresh_seed())


# history longer than one workspace segment: the flash state is carried between segments (64 tokens each here; at
# least 2 segments, one of them past a sequence's compressed range), sliding and block windows
SEGMENT_CASES = [
    ("mse_k4v3", 64, 4, [150, 20], [7, 3], 9, "sliding", None),
    ("blog_k3v2", 64, 2, [100], [16], 30, "block", RING_ROWS["vllm"]),
]


@pytest.mark.parametrize(
    "name,d,g,comp,rec,t,window,rows", SEGMENT_CASES, ids=[f"{c[0]}-D{c[1]}-{c[6]}" for c in SEGMENT_CASES]
)
def test_prefill_workspace_segments(name, d, g, comp, rec, t, window, rows):
    _check(name, d, g, comp, rec, t, torch.float16, fresh_seed(), window=window, ring_rows=rows, workspace_tokens=64)


def test_workspace_and_stages_are_bounded():
    """The workspace never exceeds its byte budget (one block at the least) and covers a history that fits; the
    pipeline stages fit in sm_90 shared memory (the compiled sizes match the formula, benchmarks/NOTES.md run 8)."""
    row = 2 * (128 + 128)  # fp16 key + value per (token, KV head) at D=128, mse keys
    assert workspace_segment(1, 8, row, 34816, 64) == 34816
    for cap in (1, 1000, 10**6):
        seg = workspace_segment(4, 8, row, cap, 64)
        assert seg % 64 == 0 and 4 * 8 * row * seg <= max(WORKSPACE_BYTES, 4 * 8 * row * 64) and seg >= min(cap, 64)
    assert fit_stages(128, 64, 128, 128) == 3  # 3 x 32 KB + 32 KB: the compiled 131072 bytes
    assert fit_stages(64, 64, 512, 256) == 1  # prod keys at D=256
    for bm, kw, dp in ((128, 128, 128), (64, 256, 256), (64, 512, 256), (128, 256, 128)):
        st = fit_stages(bm, 64, kw, dp)
        assert st * 64 * (kw + dp) * 2 + bm * kw * 2 <= SHARED_BYTES


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("rows", [24, 4096])
def test_query_transform_rows(rows, dtype):
    """The query transform prefill calls first (16-row programs for decode, 64-row ones from PREFILL_ROWS rows on),
    for fp16 and bf16 queries (the two fp16 products take both: bf16 is exact in fp16 within its range)."""
    from jetson_tq.kernels.query_transform import PREFILL_ROWS, query_transform

    gen = torch.Generator().manual_seed(rows)
    q = torch.randn(rows // 8, 8, 64, generator=gen).to(dtype).to(DEVICE)
    m = torch.randn(128, 64, generator=gen).to(DEVICE)  # prod keys: [Pi; S]
    got = query_transform(q, m, 0.3).clone()
    want = 0.3 * q.reshape(rows, 64).float() @ m.T
    assert (rows >= PREFILL_ROWS) == (rows == 4096)
    assert rel_err(got, want) <= 1e-5
    m16 = torch.stack([m.half(), (m.double() - m.half().double()).half()])  # codec_constants' qmat16 pair
    got16 = query_transform(q, m, 0.3, qmat16=m16).clone()  # fp16 products from PREFILL_ROWS rows on
    assert rel_err(got16, want) <= 1e-5
    # an fp16 out (the flash prefill's FlashAttention operand): the fp32 result rounded once, in the store
    half = query_transform(q, m, 0.3, out=torch.empty(rows, 128, dtype=torch.float16, device=DEVICE), qmat16=m16)
    assert half.dtype == torch.float16 and rel_err(half.float(), want) <= 1e-3
    with pytest.raises(ShapeError, match="out: expected"):
        query_transform(q, m, 0.3, out=torch.empty(rows, 64, device=DEVICE))
    if dtype == torch.bfloat16:  # beyond fp16's range: clamped to it on the fp16 products, finite either way
        big = q.clone()
        big[0, 0, 0] = 1e6
        assert torch.isfinite(query_transform(big, m, 1e-3, qmat16=m16)).all()
