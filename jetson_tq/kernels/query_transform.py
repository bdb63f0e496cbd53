"""Query transform: ``qt = scale * q @ M^T`` for M = [Pi; S] (once per query, before any key is scored).

TurboQuant scores a compressed key without rebuilding it: <q, k~> = ||k|| <Pi q, c[idx]> +
qjl * ||r|| <S q, signs>. Decode and prefill therefore need (Pi q, S q) once per query row; this
kernel writes them (times the softmax scale and log2(e), so the attention kernels use exp2) into a
workspace the attention kernels read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import ShapeError
from ._common import INTERPRET, next_pow2
from ._launch import FastLauncher


@triton.jit
def _query_transform_kernel(
    # ---- pointers
    q_ptr,  # [A, H, D]: queries (last dim contiguous)
    m_ptr,  # fp32 [QW, D]: M = [Pi; S] (or Pi, or I); with SPLIT16 fp16 [2, QW, D]: (hi, lo), hi + lo = M
    out_ptr,  # fp32 or fp16 [A * H, QW]: scale * q @ M^T (the store casts to its dtype)
    # ---- sizes, strides, scalars
    rows,  # A * H
    heads,  # H
    stride_qa,
    stride_qh,
    scale,  # softmax scale * log2(e) (1 for raw scores)
    # ---- compile time
    D: tl.constexpr,  # head dim
    DP: tl.constexpr,  # head dim padded to a power of two
    QW: tl.constexpr,  # output row width
    BLOCK_R: tl.constexpr,  # query rows per program
    BLOCK_W: tl.constexpr,  # output columns per program
    PRECISION: tl.constexpr,  # tl.dot input precision ("tf32x3"; "ieee" in the interpreter)
    SPLIT16: tl.constexpr,  # fp16 / bf16 queries against M's fp16 (hi, lo) pair: two exact-input fp16 products
):
    # Each program: BLOCK_R query rows (row = a * heads + h) x BLOCK_W output columns.
    pid_r, pid_w = tl.program_id(0), tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    d = tl.arange(0, DP)
    q_off = (r // heads).to(tl.int64) * stride_qa + (r % heads).to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=(r[:, None] < rows) & (d[None, :] < D), other=0.0)
    m_off = w[:, None] * D + d[None, :]
    m_mask = (w[:, None] < QW) & (d[None, :] < D)
    if SPLIT16:  # fp16 q is exact in fp16 and M = hi + lo to ~22 bits: fp32 sums of two fp16 products
        # a bf16 q is too (8 of fp16's 11 mantissa bits) within fp16's range: clamped to it, never inf (below it,
        # fp16's subnormals are off by < 3e-8 absolute)
        if q.dtype == tl.bfloat16:  # fp16 queries are in range already: no clamp instructions for them
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        m_hi = tl.load(m_ptr + m_off, mask=m_mask, other=0.0)
        m_lo = tl.load(m_ptr + QW * D + m_off, mask=m_mask, other=0.0)
        qt = tl.dot(q, tl.trans(m_hi), out_dtype=tl.float32)
        qt = tl.dot(q, tl.trans(m_lo), acc=qt, out_dtype=tl.float32) * scale
    else:
        m = tl.load(m_ptr + m_off, mask=m_mask, other=0.0)
        qt = tl.dot(q.to(tl.float32), tl.trans(m), input_precision=PRECISION) * scale
    tl.store(out_ptr + r[:, None].to(tl.int64) * QW + w[None, :], qt, mask=(r[:, None] < rows) & (w[None, :] < QW))


_LAUNCH = FastLauncher(_query_transform_kernel)
PREFILL_ROWS = 4096  # query rows from which a launch takes the 64-row programs


def query_transform(
    q: torch.Tensor,
    qmat: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    reproducible: bool = False,
    qmat16: torch.Tensor | None = None,
) -> torch.Tensor:
    """``scale * q @ qmat.T`` in fp32 for q [A, H, D] (last dim contiguous) -> [A * H, QW], stored in ``out``'s dtype
    (fp32 by default; an fp16 ``out`` for a caller that reads fp16, the products stay fp32). Without ``out`` the
    result is a fresh tensor (the caching allocator reuses it; a per-shape workspace grew without bound under
    ragged prefill chunks). ``reproducible``: the same tile shape at any row count and exact fp32 products
    ("ieee"), so a query row's result does not depend on how many rows share the launch. ``qmat16``: qmat as an
    fp16 (hi, lo) pair [2, QW, D] (``codec_constants``' ``qmat16``): fp16 queries of prefill-sized calls then take
    two fp16 products instead of three tf32 ones (same ~22-bit accuracy); bf16 queries too (exact in fp16 within its
    range; clamped to it), whose tf32x3 transform took 322 us of a 16k-token layer step in vLLM on an H100."""
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ShapeError(f"q: expected [A, H, D] with a contiguous last dim, got {tuple(q.shape)} strides {q.stride()}")
    a, h, d = q.shape
    qw = qmat.shape[0]
    if qmat.shape[1] != d:
        raise ShapeError(f"qmat: expected [QW, {d}], got {tuple(qmat.shape)}")
    rows = a * h
    if out is None:
        out = torch.empty(rows, qw, dtype=torch.float32, device=q.device)
    elif (
        out.dim() != 2
        or out.shape[0] < rows
        or out.shape[1] != qw
        or not out.is_contiguous()
        or out.dtype not in (torch.float32, torch.float16)
    ):
        raise ShapeError(
            f"out: expected a contiguous fp32 or fp16 [>= {rows}, {qw}], got {out.dtype} {tuple(out.shape)}"
        )
    # 16 rows per program for decode; prefill-sized calls take 64 (each program reloads M: H200 call B spent 91 us on
    # 65536 rows at 16; offline sm_90 at 64: 186 registers, no spills, 2.7x fewer instructions per row)
    prefill_sized = rows >= PREFILL_ROWS and d <= 128 and not reproducible
    block_r = 64 if prefill_sized else 16
    block_w = min(64, next_pow2(qw))
    split16 = prefill_sized and qmat16 is not None and q.dtype in (torch.float16, torch.bfloat16)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(qw, block_w))
    _LAUNCH(
        grid,
        (q, qmat16 if split16 else qmat, out, rows, h, q.stride(0), q.stride(1), float(scale)),
        dict(
            D=d,
            DP=max(16, next_pow2(d)),
            QW=qw,
            BLOCK_R=block_r,
            BLOCK_W=block_w,
            PRECISION="ieee" if INTERPRET or reproducible else "tf32x3",
            SPLIT16=split16,
        ),
        (d, qw, block_r, block_w, reproducible, split16),
        num_warps=4,
    )
    return out
