"""Fused hybrid decode, the launches: ``run`` (the decode launch and, with several splits not merged in it, the
reduce launch) and ``programs_per_sm`` (the programs per SM a compiled kernel keeps resident, which the split count
aims at). Launches only: no host sync and no allocation, so a CUDA graph can capture ``run``."""

from __future__ import annotations

import torch

from ..paged import PagedKV
from ._common import INTERPRET
from ._launch import FastLauncher, resident_programs
from .decode_args import DecodePlan, _decode_args, _recent, flat_rows
from .decode_reduce import _decode_reduce_kernel
from .decode_tuning import WAVES
from .hybrid_decode import _hybrid_decode_kernel
from .query_transform import query_transform

_DECODE = FastLauncher(_hybrid_decode_kernel)
_REDUCE = FastLauncher(_decode_reduce_kernel)


def programs_per_sm(plan: DecodePlan, q: torch.Tensor, kv: PagedKV, new: tuple | None = None) -> float:
    """Programs per SM for the split count: as many as the compiled kernel keeps resident (registers, shared memory),
    so the grid is one full wave for every format and head dim; WAVES without a GPU to load the kernel on."""
    if not q.is_cuda or INTERPRET:
        return WAVES
    args = _decode_args(plan, q, kv, q, new)
    compiled = _DECODE.compile(plan.grid, args, plan.constexprs, **plan.launch_options)
    compiled.run  # noqa: B018  loads the binary: registers per thread are known from then on
    return float(resident_programs(compiled, plan.num_warps, q.device))


def run(
    plan: DecodePlan,
    q: torch.Tensor,
    kv: PagedKV,
    out: torch.Tensor | None = None,
    new: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Launch ``plan`` for q [B, Hq, D] over ``kv`` -> ``out`` [B, Hq, D] (allocated when None); q, out
    [B, Q, Hq, D] with ``new`` (the new tokens' k, v) for a multi-token plan. Launches only: the caller made ``plan``
    for these shapes and strides (``plan_decode``)."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    result, q, out = out, flat_rows(q), flat_rows(out)
    if not plan.fuse_query:
        query_transform(q, plan.qmat, plan.scalars.scale_log2, out=plan.qt)
    rk, rv = _recent(plan, q, kv)
    # the plan fixes every int argument; only the data pointers' 16-byte alignment can change between calls
    # (any misaligned pointer: the generic per-argument key)
    aligned = (
        True
        if (
            q.data_ptr()
            | kv.pages.data_ptr()
            | kv.block_table.data_ptr()
            | kv.compressed_lens.data_ptr()
            | rk.data_ptr()
            | rv.data_ptr()
            | kv.recent_lens.data_ptr()
            | kv.recent_index.data_ptr()
            | out.data_ptr()
        )
        % 16
        == 0
        else None
    )
    if new is not None and (new[0].data_ptr() | new[1].data_ptr()) % 16:
        aligned = None
    args = _decode_args(plan, q, kv, out, new)
    _DECODE(plan.grid, args, plan.constexprs, plan.key, aligned=aligned, **plan.launch_options)
    if plan.splits > 1 and not plan.fused_reduce:
        _REDUCE(
            plan.reduce_grid,
            (plan.po, plan.plse, out, out.stride(0), out.stride(1), plan.splits),
            plan.reduce_constexprs,
            plan.key,
            num_warps=4,
            aligned=aligned,
        )
    return result
