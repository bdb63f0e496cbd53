"""Fused hybrid decode, the launch's arguments: ``DecodePlan`` and its groups, in the kernel's parameter order.

The groups a plan holds (``DecodeConstants``: the layer's device constants; ``DecodeInts``, ``DecodeScalars``: the
kernel's ``ints`` and ``scalars`` tuples), the printable ``DecodePlan`` (made by ``hybrid_decode_plan.plan_decode``)
and ``_decode_args``: a call's tensors followed by the plan's groups, in the kernel's parameter order (a splice, so a
new per-layer constant is one field in one group: ``hybrid_decode``'s docstring lists the places)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..paged import PagedKV
from ._common import KltSpec, PageSpec
from .decode_tuning import DecodeTuning
from .hybrid_decode import DecodeConstexprs


class DecodeConstants(NamedTuple):
    """One layer's device constants the kernel reads, in its parameter order (``cb_ptr`` .. ``sinks_ptr``)."""

    codebook: torch.Tensor  # fp32 [>= 4]: key centroids
    klt_meta: torch.Tensor  # int32 [H, 2, DP]: klt code bit offsets and widths (placeholders without klt keys)
    klt_levels: torch.Tensor  # fp32: level tables, or cubic levels' coefficients (KLT.CUBIC)
    klt_dec: torch.Tensor  # fp16 [H, DP, DP]: decode matrix
    klt_mean: torch.Tensor  # fp32 [H, DP]
    klt_turns: torch.Tensor  # fp64 [RHP]: RoPE frequencies in turns per position
    klt_sink: torch.Tensor  # fp32 [2, H, D]: the calibrated sink's key and value (KLT.SINK)
    hsigns: torch.Tensor  # fp32 [D]: the randomized Hadamard rotation's signs (FUSE_Q)
    vcodebook: torch.Tensor  # fp32 [>= 4]: value centroids (mse values)
    vpi: torch.Tensor  # fp32 [D, D]: the value rotation Pi_v (mse values)
    sinks: torch.Tensor  # fp32 [Hq]: the layer's sink logits (CFG.SINKS; a placeholder without)


class DecodeInts(NamedTuple):
    """The kernel's int arguments (its ``ints`` tuple): strides the plan bakes in, the split sizes."""

    stride_qb: int
    stride_qh: int
    stride_bt: int
    page_bytes: int
    stride_rkn: int
    stride_rkh: int
    stride_rkt: int
    stride_rvn: int
    stride_rvh: int
    stride_rvt: int
    stride_ob: int
    stride_oh: int
    tokens_per_split: int  # the smallest split (a BLOCK_N multiple): the kernel sizes splits per sequence
    n_splits: int
    group_size: int  # splits per first-level group of the in-launch merge
    window: int  # the sliding window W in tokens (CFG.WINDOW; 0 without)
    ring: int  # the recent buffer's capacity R (row p % R holds token p)


class DecodeScalars(NamedTuple):
    """The kernel's float arguments (its ``scalars`` tuple)."""

    scale_log2: float  # softmax scale * log2(e)
    qt_scale: float  # the same / sqrt(D): the fused rotation's scale
    qjl_scale: float  # sqrt(pi / 2) / D
    k_alpha: float  # affine key codebook c[k] = alpha + beta k + gamma (k >> 1)
    k_beta: float
    k_gamma: float
    zero_rt: float  # 0.0 at run time
    klt_scale: float  # klt keys: RoPE's attention scaling
    cap2: float  # the soft cap * log2(e) (CFG.SOFT_CAP; 1.0 without)


@dataclass(frozen=True)
class DecodePlan:
    """Everything a decode launch needs that depends only on shapes, strides, format and knobs, made once
    (``plan_decode``); ``run`` launches it. Printing it shows the shape, the split count, the launch options and the
    ``CFG`` bundle; tensors (the layer's constants, the workspaces) are left out of the repr."""

    batch: int
    q_heads: int
    query_tokens: int  # query tokens per sequence (Q > 1: speculative verification rows, causal among themselves)
    kv_heads: int
    head_dim: int
    splits: int
    grid: tuple[int, int]  # (B * Hkv, splits)
    num_warps: int
    num_stages: int
    maxnreg: int | None  # register cap per thread (None: none)
    tuning: DecodeTuning  # with the format's defaults filled in
    cfg: DecodeConstexprs
    fuse_query: bool  # the query rotation runs inside the decode launch (else ``query_transform`` first)
    fused_reduce: bool  # the splits merge inside the decode launch (else ``_decode_reduce_kernel``)
    ring_fallback: bool  # no recent-buffer storage: the kernel's recent pointers point at q (never read)
    ints: DecodeInts
    scalars: DecodeScalars
    new_strides: tuple[int, int, int]  # the new tokens' k, v strides (multi-token form; zeros without)
    page: PageSpec = field(repr=False)
    klt: KltSpec = field(repr=False)
    consts: DecodeConstants = field(repr=False)
    qmat: torch.Tensor = field(repr=False)  # fp32 [QW, D]: the query transform (when not fused)
    qt: torch.Tensor = field(repr=False)  # fp32 [B * Hq, QW]: workspace of the transformed query rows
    po: torch.Tensor | None = field(repr=False)  # fp32 [B * Hq * splits, D]: split partial outputs (splits > 1)
    plse: torch.Tensor | None = field(repr=False)  # fp32 [B * Hq * splits]: their log2-sum-exp
    cnt: torch.Tensor = field(repr=False)  # int32: arrival counters (fused_reduce)
    constexprs: dict = field(repr=False)  # PAGE, CFG, KLT bundles of the decode launch
    reduce_constexprs: dict = field(repr=False)  # HQ, D, DP, SP of the reduce launch
    key: tuple = field(repr=False)  # unique per plan: the launcher's compiled-kernel key

    @property
    def reduce_grid(self) -> tuple[int]:
        return (self.batch * self.query_tokens * self.q_heads,)

    @property
    def launch_options(self) -> dict:
        """num_warps, num_stages, maxnreg of the decode launch."""
        return dict(num_warps=self.num_warps, num_stages=self.num_stages, maxnreg=self.maxnreg)


def flat_rows(q: torch.Tensor) -> torch.Tensor:
    """q [B, Q, Hq, D] as the kernel's [B * Q, Hq, D] rows (a view: one token stride); a 3-d q as it is."""
    return q.view(-1, q.shape[-2], q.shape[-1]) if q.dim() == 4 else q


def _recent(plan: DecodePlan, q: torch.Tensor, kv: PagedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """The recent-buffer keys and values the kernel reads (q itself when there is no buffer storage: never read)."""
    if plan.ring_fallback:
        return q.unsqueeze(2), q.unsqueeze(2)
    return kv.recent_k, kv.recent_v


def _decode_args(plan: DecodePlan, q: torch.Tensor, kv: PagedKV, out: torch.Tensor, new: tuple | None = None) -> tuple:
    """The decode kernel's runtime arguments (everything but the constexprs) for one call, in its parameter order;
    q, out as the kernel's rows (``flat_rows``), ``new``: the new tokens' (k, v) (CFG.QN > 1; q stands in without)."""
    rk, rv = _recent(plan, q, kv)
    po, plse = (plan.po, plan.plse) if plan.splits > 1 else (out, out)
    kn, vn = new if new is not None else (q, q)
    return (
        plan.qt,
        q,
        kv.pages,
        kv.block_table,
        kv.compressed_lens,
        rk,
        rv,
        kv.recent_lens,
        kv.recent_index,
        *plan.consts,
        out,
        po,
        plse,
        plan.cnt,
        plan.ints,
        plan.scalars,
        kn,
        vn,
        plan.new_strides,
    )
