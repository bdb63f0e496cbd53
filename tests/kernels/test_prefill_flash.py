"""Prefill through a FlashAttention varlen kernel (``kernels.prefill_flash``) against ``paged_attention_prefill``,
and the state merge (``kernels.merge_states``) against its reference.

On CPU the dequantization and merge kernels run under the interpreter and the varlen attention is the PyTorch
stand-in ``varlen_attention_reference`` (FlashAttention's contract); on a GPU with vLLM's FlashAttention the real
kernel runs too. Tolerances as in test_kernels_prefill.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jetson_tq import ops
from jetson_tq.attention.reference import merge_states_reference, paged_attention_prefill, varlen_attention_reference
from jetson_tq.errors import ShapeError
from jetson_tq.format import exact_count
from jetson_tq.kernels.merge_states import merge_states
from jetson_tq.kernels.prefill_flash import flash_prefill, flash_prefill_rows, flash_unsupported_reason, plan_for
from jetson_tq.kernels.prefill_plan import dequantize_segment
from tests.helpers.kernel_cases import DEVICE, GPU, build_paged_kv, fmt_for, fresh_seed, rel_err

pytestmark = pytest.mark.kernel

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
RING_ROWS = {"vllm": lambda s, r: s % r, "cache": lambda s, r: exact_count(s, r, True)}


def _vllm_varlen():
    """vLLM's FlashAttention varlen call as a ``VarlenAttention`` (None without it)."""
    if not GPU:
        return None
    from jetson_tq.integrations.vllm.flash import vllm_varlen

    return vllm_varlen()


VARLENS = [("reference", lambda: varlen_attention_reference), ("vllm-fa", _vllm_varlen)]

# (format, head dim, G, history per sequence, chunk T, ring R, ring convention, workspace tokens)
CASES = [
    ("mse_k4v3", 64, 2, [56, 48], 21, 16, "vllm", None),  # ragged: mid-block and on a boundary, chunk straddles
    ("mse_k4v3", 64, 4, [0], 12, 16, "vllm", None),  # empty history, one block: no compressed part
    ("mse_k4v3", 128, 4, [0], 40, 16, "cache", None),  # empty history, the chunk reads its own older blocks
    ("mse_k4v3", 64, 1, [37], 5, 32, "cache", None),  # one block, history in the ring
    ("mse_k3v3w256", 64, 2, [150, 20], 30, 16, "vllm", 64),  # segments of 64 tokens: the merge across segments
    ("klt52_g3", 64, 2, [56, 48], 21, 16, "vllm", None),  # klt keys: the workspace holds post-RoPE keys
    ("klt52_g3+sink", 64, 2, [56, 0], 21, 16, "vllm", None),  # ... and a calibrated sink at workspace row 0
    ("mse_k4v3+vmse3", 64, 2, [56, 48], 21, 16, "vllm", None),  # mse values, dequantized in the original domain
    ("mse_k4v3", 80, 3, [40, 19], 27, 16, "vllm", None),  # a head dim below its padded width: keys rotated back
]
if GPU:
    CASES += [
        ("mse_k4v3", 128, 4, [3000, 700], 300, 128, "vllm", None),
        ("mse_k4v3", 128, 7, [5000], 257, 128, "cache", 1024),
        ("mse_k3v3w256", 128, 4, [2048], 600, 256, "vllm", None),
        ("klt52_g3", 128, 4, [3000, 700], 300, 128, "vllm", None),
        ("mse_k4v3+vmse3", 128, 4, [3000, 700], 300, 128, "vllm", None),
    ]


def _case(name, d, g, hist, t, ring, rows, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    hkv = 2
    rec = [RING_ROWS[rows](s, ring) for s in hist]
    comp = [s - r for s, r in zip(hist, rec)]
    sink = name.endswith("+sink")
    fmt = fmt_for(name.removesuffix("+sink"), d).with_(recent_tokens=ring, window="block")
    hold = [s + t for s in hist]
    kv = build_paged_kv(fmt, hkv, d, comp, rec, dtype, gen, recent_cap=ring, pages_hold=hold, sink=sink)
    b = len(hist)
    q = (torch.randn(b, hkv * g, t, d, generator=gen) * 3).to(dtype).to(DEVICE)
    k = (torch.randn(b, hkv, t, d, generator=gen) * 2).to(dtype).to(DEVICE)
    v = torch.randn(b, hkv, t, d, generator=gen).to(dtype).to(DEVICE)
    return q, k, v, kv


@pytest.mark.parametrize("varlen_name,make", VARLENS, ids=[v[0] for v in VARLENS])
@pytest.mark.parametrize(
    "name,d,g,hist,t,ring,rows,ws", CASES, ids=[f"{c[0]}-D{c[1]}-G{c[2]}-h{c[3]}-T{c[4]}-R{c[5]}" for c in CASES]
)
def test_flash_prefill_matches_reference(varlen_name, make, name, d, g, hist, t, ring, rows, ws):
    varlen = make()
    if varlen is None:
        pytest.skip("vLLM's FlashAttention needs a CUDA GPU with the vLLM bundle")
    seed = fresh_seed()
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v, kv = _case(name, d, g, hist, t, ring, rows, dtype, seed)
        assert flash_unsupported_reason(kv, dtype) is None
        out = torch.full_like(q, float("nan"))
        flash_prefill(q, k, v, kv, hist, varlen, out=out, workspace_tokens=ws)
        err = rel_err(out, paged_attention_prefill(q, k, v, kv))
        assert err <= TOL[dtype], f"seed={seed} {varlen_name} {name} {dtype} hist={hist} T={t} R={ring}: {err:.2e}"


def test_flash_unsupported_reasons():
    """What the flash path refuses (the Triton loop serves it): fp32 queries, sliding windows, prod keys, raw keys."""
    gen = torch.Generator().manual_seed(0)

    def paged(name: str, window: str):
        fmt = fmt_for(name, 64).with_(recent_tokens=16, window=window)
        return build_paged_kv(fmt, 2, 64, [16], [4], torch.half, gen, recent_cap=16)

    kv, sliding = paged("mse_k4v3", "block"), paged("mse_k4v3", "sliding")
    assert flash_unsupported_reason(kv, torch.float16) is None
    assert "fp16 / bf16" in flash_unsupported_reason(kv, torch.float32)
    assert "block window" in flash_unsupported_reason(sliding, torch.float16)
    for name in ("blog_k3v2", "fp16"):
        assert "mse or klt keys" in flash_unsupported_reason(paged(name, "block"), torch.float16)
    q = torch.randn(1, 4, 3, 64).half().to(DEVICE)
    k = torch.randn(1, 2, 3, 64).half().to(DEVICE)
    with pytest.raises(ShapeError, match="history"):
        flash_prefill(q, k, k, kv, [16, 3], varlen_attention_reference)
    with pytest.raises(ShapeError, match="block window"):
        flash_prefill(q, k, k, sliding, [20], varlen_attention_reference)
    prod = paged("blog_k3v2", "block")  # keys scored against S q too: no raw-query form to rotate them back into
    wk = torch.zeros(64, 2, 64, dtype=torch.half, device=DEVICE)
    with pytest.raises(ShapeError, match="prod keys"):
        dequantize_segment(
            prod, torch.zeros(8, device=DEVICE), wk, wk, 0, 32, 1, 16, True, 16, True, unrotate_keys=True
        )


@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float16), (torch.bfloat16, torch.float16)])
def test_merge_states_matches_reference(dtypes):
    """Random partial states, including rows marked empty (+inf / -inf log-sum-exp, FlashAttention's marks)."""
    gen = torch.Generator().manual_seed(fresh_seed())
    n, m, h, d = 37, 19, 6, 80
    out = torch.randn(n, h, d, generator=gen).to(dtypes[0])
    lse = torch.randn(h, n, generator=gen) * 4
    part = torch.randn(m, h, d, generator=gen).to(dtypes[1])
    plse = torch.randn(h, m, generator=gen) * 4
    lse[0, :3] = float("inf")
    plse[1, :2] = float("-inf")
    lse[2, 5] = plse[2, 0] = float("-inf")
    rows = torch.randperm(n, generator=gen)[:m]
    want_out, want_lse = out.clone(), lse.clone()
    merge_states_reference(want_out, want_lse, part, plse, rows)
    got_out, got_lse = out.to(DEVICE), lse.to(DEVICE)
    merge_states(got_out, got_lse, part.to(DEVICE), plse.to(DEVICE), rows.to(DEVICE))
    assert rel_err(got_out.cpu(), want_out) <= TOL[dtypes[0]]  # one rounding of the merged row to out's dtype
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(got_lse.cpu()))
    assert torch.allclose(got_lse.cpu()[fin], want_lse[fin], atol=1e-4)
    with pytest.raises(ShapeError):
        merge_states(got_out, got_lse, part.to(DEVICE), plse.to(DEVICE)[:, :3], rows.to(DEVICE))


# (format, head dim, KV heads, G, history per sequence, chunk per sequence, ring R, workspace tokens)
RAGGED = [
    ("mse_k4v3", 64, 2, 3, [0, 37, 16, 70, 5], [21, 1, 40, 7, 16], 16, None),  # empty history, T = 1, T > R
    ("mse_k4v3", 64, 3, 2, [150, 0, 33], [9, 50, 1], 16, 64),  # three segments of 64 tokens
    ("klt52_g3", 64, 2, 2, [56, 0, 19], [21, 3, 30], 16, None),  # klt keys
]
if GPU:
    RAGGED += [
        ("mse_k4v3", 128, 4, 7, [3000, 0, 700, 128], [300, 1, 129, 2048], 128, None),
        ("mse_k4v3", 128, 4, 7, [5000, 0, 2048], [257, 600, 1], 128, 1024),
    ]


def _ragged_step(name, d, hkv, g, hist, t, ring, seed):
    """q [N, Hkv G, D], k, v [N, Hkv, D] of chunks of ``t`` rows after ``hist`` tokens, their row offsets, and the
    pages and ring holding every history and chunk (vLLM's ring convention)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float16
    rec = [s % ring for s in hist]
    fmt = fmt_for(name, d).with_(recent_tokens=ring, window="block")
    hold = [s + n for s, n in zip(hist, t)]
    kv = build_paged_kv(
        fmt, hkv, d, [s - r for s, r in zip(hist, rec)], rec, dtype, gen, recent_cap=ring, pages_hold=hold
    )
    rows = sum(t)
    q = (torch.randn(rows, hkv * g, d, generator=gen) * 3).to(dtype).to(DEVICE)
    k = (torch.randn(rows, hkv, d, generator=gen) * 2).to(dtype).to(DEVICE)
    v = torch.randn(rows, hkv, d, generator=gen).to(dtype).to(DEVICE)
    return q, k, v, np.concatenate([[0], np.cumsum(t)]), kv


@pytest.mark.parametrize("varlen_name,make", VARLENS, ids=[v[0] for v in VARLENS])
@pytest.mark.parametrize(
    "name,d,hkv,g,hist,t,ring,ws", RAGGED, ids=[f"{c[0]}-H{c[2]}-G{c[3]}-h{c[4]}-T{c[5]}" for c in RAGGED]
)
def test_flash_prefill_rows_ragged_step(varlen_name, make, name, d, hkv, g, hist, t, ring, ws):
    """A step of ragged chunks (concatenated rows, vLLM's layout) in one ``flash_prefill_rows`` call equals each
    chunk through ``flash_prefill`` on its own and the reference, within the flash path's tolerance."""
    varlen = make()
    if varlen is None:
        pytest.skip("vLLM's FlashAttention needs a CUDA GPU with the vLLM bundle")
    seed = fresh_seed()
    dtype = torch.float16
    q, k, v, qsl, kv = _ragged_step(name, d, hkv, g, hist, t, ring, seed)
    plan = plan_for(kv, hist, qsl, workspace_tokens=ws)
    got = flash_prefill_rows(q, k, v, kv, plan, varlen)
    for b in range(len(hist)):
        one = kv.sequence(b)
        qb, kb, vb = (x[qsl[b] : qsl[b + 1]].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        alone = flash_prefill(qb, kb, vb, one, [hist[b]], varlen, workspace_tokens=ws)
        ref = paged_attention_prefill(qb, kb, vb, one)
        mine = got[qsl[b] : qsl[b + 1]].transpose(0, 1).unsqueeze(0)
        path = "one call" if plan.one_call else f"{len(plan.segments)} segments"
        why = f"seed={seed} {varlen_name} {name} sequence {b} ({path}): hist={hist[b]} T={t[b]} R={ring}"
        assert rel_err(mine, alone) <= 1e-3, f"{why}: batched vs alone {rel_err(mine, alone):.2e}"
        assert rel_err(mine, ref) <= TOL[dtype], f"{why}: vs reference {rel_err(mine, ref):.2e}"


def test_ops_prefill_rows_routes():
    """``ops.prefill_rows``: with a varlen call on the Triton backend the one flash call; without one, or in
    reproducible mode, the Triton loop sequence by sequence; both close to the reference."""
    name, d, hkv, g, hist, t, ring, _ = RAGGED[0]
    seed = fresh_seed()
    q, k, v, qsl, kv = _ragged_step(name, d, hkv, g, hist, t, ring, seed)
    plan = plan_for(kv, hist, qsl)
    flash = ops.prefill_rows(q, k, v, kv, qsl, hist, varlen=varlen_attention_reference, plan=plan, backend="triton")
    assert torch.equal(flash, flash_prefill_rows(q, k, v, kv, plan, varlen_attention_reference))
    ref = ops.prefill_rows(q, k, v, kv, qsl, hist, backend="reference")
    loop = ops.prefill_rows(q, k, v, kv, qsl, hist, backend="triton")
    repro = ops.prefill_rows(
        q, k, v, kv, qsl, hist, varlen=varlen_attention_reference, reproducible=True, backend="triton"
    )
    for got, what in ((flash, "flash"), (loop, "Triton loop"), (repro, "reproducible")):
        assert rel_err(got, ref) <= TOL[torch.float16], f"seed={seed} {what}: {rel_err(got, ref):.2e}"
    assert not torch.equal(flash, loop)  # the two paths round differently: the loop really ran
