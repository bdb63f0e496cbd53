"""Merge two partial attention results over disjoint key sets, in place (online-softmax state addition).

One program = one merged row (all its heads): out[rows[i]] and lse[:, rows[i]] (natural log-sum-exp) take in
part[i] and part_lse[:, i]. ``prefill_flash`` merges the compressed-history part of a chunk into its exact part
with it. Same contract as ``attention.reference.merge_states_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import ShapeError, expect_same_device
from ._common import cuda_or_interpreter, next_pow2


@triton.jit
def _merge_states_kernel(
    out_ptr,  # [N, H, D]: merged in place
    lse_ptr,  # fp32 [H, N]: merged in place
    part_ptr,  # [M, H, D]
    plse_ptr,  # fp32 [H, M]
    rows_ptr,  # int32 / int64 [M]: the out row each part row merges into
    M,
    N,
    stride_on,
    stride_oh,
    stride_pn,
    stride_ph,
    H: tl.constexpr,
    D: tl.constexpr,
    HP: tl.constexpr,  # H padded to a power of two
    DP: tl.constexpr,  # D padded to a power of two
):
    i = tl.program_id(0)
    r = tl.load(rows_ptr + i).to(tl.int64)
    h = tl.arange(0, HP)
    d = tl.arange(0, DP)
    hm = h < H
    la = tl.load(lse_ptr + h * N + r, mask=hm, other=float("-inf"))
    lb = tl.load(plse_ptr + h * M + i, mask=hm, other=float("-inf"))
    la = tl.where((la != la) | (la == float("inf")), float("-inf"), la)  # FlashAttention marks empty rows +inf
    lb = tl.where((lb != lb) | (lb == float("inf")), float("-inf"), lb)
    m = tl.maximum(la, lb)
    safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - safe)
    wb = tl.exp(lb - safe)
    tot = wa + wb
    keep = tot > 0
    denom = tl.where(keep, tot, 1.0)
    mask = hm[:, None] & (d[None, :] < D)
    optr = out_ptr + r * stride_on + h[:, None] * stride_oh + d[None, :]
    a = tl.load(optr, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(part_ptr + i * stride_pn + h[:, None] * stride_ph + d[None, :], mask=mask, other=0.0).to(tl.float32)
    merged = a * (wa / denom)[:, None] + b * (wb / denom)[:, None]
    tl.store(optr, merged.to(out_ptr.dtype.element_ty), mask=mask & keep[:, None])
    tl.store(lse_ptr + h * N + r, tl.where(keep, safe + tl.log(denom), la), mask=hm)


def merge_states(
    out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor, rows: torch.Tensor
) -> None:
    """out[rows[i]] [H, D] and lse[:, rows[i]] merged with part[i] and part_lse[:, i], in place (see module)."""
    cuda_or_interpreter(out)
    expect_same_device(out=out, lse=lse, part=part, part_lse=part_lse, rows=rows)
    m = part.shape[0]
    n, h, d = out.shape
    if part.shape[1:] != (h, d) or lse.shape != (h, n) or part_lse.shape != (h, m) or rows.shape != (m,):
        raise ShapeError(
            f"merge_states: expected out [N, H, D], lse [H, N], part [M, H, D], part_lse [H, M], rows [M]; got "
            f"{tuple(out.shape)}, {tuple(lse.shape)}, {tuple(part.shape)}, {tuple(part_lse.shape)}, {tuple(rows.shape)}"
        )
    if out.stride(-1) != 1 or part.stride(-1) != 1 or not lse.is_contiguous() or not part_lse.is_contiguous():
        raise ShapeError("merge_states: out and part need a contiguous last dim, lse and part_lse contiguous storage")
    if m == 0:
        return
    _merge_states_kernel[(m,)](
        out,
        lse,
        part,
        part_lse,
        rows,
        m,
        n,
        out.stride(0),
        out.stride(1),
        part.stride(0),
        part.stride(1),
        H=h,
        D=d,
        HP=next_pow2(h),
        DP=next_pow2(d),
        num_warps=8 if next_pow2(h) * next_pow2(d) > 4096 else 4,
    )
