"""Fused hybrid decode, the plan's construction: ``plan_decode``, and ``hybrid_decode`` (plans once per shape, runs).

FlashInfer's split: ``plan_decode`` does everything that depends only on shapes, strides, the format and the knobs
(split count, grid, the ``CFG`` bundle, the layer's device constants, the workspaces) once, into a ``DecodePlan``
(``decode_args``: the kernel's argument groups, in its parameter order); ``run(plan, q, kv)`` (``decode_launch``)
only launches — no host sync and no allocation, so a CUDA graph can capture it. The kernel itself is
``hybrid_decode`` (``@triton.jit`` code, its steps in ``decode_*``); the knobs and the split count are
``decode_tuning``'s (``DecodeTuning``, ``run`` and the plan's types are importable from here too).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import cast

import torch

from ..attention.extras import NO_EXTRAS, AttentionExtras
from ..errors import DTypeError, ShapeError, expect_same_device
from ..paged import PagedKV
from ._common import (
    INTERPRET,
    KEY_RAW,
    LOG2E,
    NO_KLT,
    VAL_GROUP,
    codec_constants,
    constexpr_bundle,
    counters,
    cuda_or_interpreter,
    klt_constants,
    next_pow2,
    page_spec,
    workspace,
)
from ._masking import extras_args, extras_flags
from ._tiles import nibble_lut_asm
from .decode_args import DecodeConstants, DecodeInts, DecodePlan, DecodeScalars, flat_rows
from .decode_launch import programs_per_sm, run
from .decode_tuning import (
    DEFAULT_TUNING,
    MERGE_ELEMS,
    WAVES,
    DecodeTuning,
    choose_splits,
    fast_key_planes,
    fused_query,
    value_subchunks,
)
from .decode_tuning import sm_count as _num_sms  # a module-level name: tests size the splits for an H200 through it
from .hybrid_decode import DecodeConstexprs

__all__ = [
    "DEFAULT_TUNING",
    "DecodeConstants",
    "DecodeInts",
    "DecodePlan",
    "DecodeScalars",
    "DecodeTuning",
    "choose_splits",
    "hybrid_decode",
    "plan_decode",
    "run",
]


_PLANS: dict = {}
_SERIAL = itertools.count()


def _check_query(q: torch.Tensor, kv: PagedKV, new: tuple | None = None) -> None:
    """Named errors for a query (and the new tokens' k, v of a multi-token one) that does not fit ``kv``."""
    cuda_or_interpreter(q)
    expect_same_device(q=q, pages=kv.pages)
    if q.dim() not in (3, 4) or (q.dim() == 4) != (new is not None):
        raise ShapeError(f"q: expected [B, Hq, D], or [B, Q, Hq, D] with the new tokens' k, v; got {tuple(q.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise DTypeError(f"q: expected float16, bfloat16 or float32, got {q.dtype}")
    bsz, hq, d = q.shape[0], q.shape[-2], q.shape[-1]
    hkv = kv.num_kv_heads
    if d != kv.head_dim or bsz != kv.batch_size or hq % hkv:
        raise ShapeError(f"q: expected [{kv.batch_size}, (Q,) k*{hkv}, {kv.head_dim}], got {tuple(q.shape)}")
    if new is not None:
        k, v = new
        want = (bsz, q.shape[1], hkv, d)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ShapeError(f"k, v: expected {list(want)}, got {tuple(k.shape)} and {tuple(v.shape)}")
        expect_same_device(q=q, k=k, v=v)
        if kv.layout.fmt.key_mode == "klt":
            raise ShapeError("multi-token decode: klt keys are not served (their calibrated sink is read per program)")
        R = kv.recent_k.shape[2]
        if R and q.shape[1] > R:
            raise ShapeError(f"multi-token decode: {q.shape[1]} query tokens exceed the exact ring of {R}")


def plan_decode(
    q: torch.Tensor,
    kv: PagedKV,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
    tuning: DecodeTuning = DEFAULT_TUNING,
    extras: AttentionExtras = NO_EXTRAS,
    new: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> DecodePlan:
    """The plan of a decode of queries shaped and strided like ``q`` over ``kv`` (its format, block table width and
    recent-buffer strides) into ``out``'s strides (None: a fresh contiguous output), with the layer's sinks, soft cap
    and sliding window (``extras``: constexpr-gated, so a layer without them compiles the plain kernel).

    q [B, Q, Hq, D] (its B and Q dims one token stride: ``flat_rows``) with ``new`` = the Q new tokens' (k, v)
    [B, Q, Hkv, D] (equal strides): Q query tokens per sequence folded into the rows of each program's query tile
    next to the G query heads of its KV head (CFG.QN; Q = 1 compiles the one-token kernel)."""
    _check_query(q, kv, new)
    extras.check(q.shape[-2], q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qn = q.shape[1] if q.dim() == 4 else 1
    q4, q = q, flat_rows(q)
    bsz, hq, d = q4.shape[0], q.shape[1], q.shape[2]
    hkv = kv.num_kv_heads
    spec, page = page_spec(kv.layout, kv.codec)
    consts = codec_constants(kv.codec, q.device)
    klt = klt_constants(kv.codec, q.device)
    sinks, cap2, window = extras_args(extras, consts["codebook"])  # (the codebook: a pointer never read)
    tuning = tuning.for_format(spec)
    # ``for_format`` fills these in
    assert tuning.block_n is not None and tuning.num_warps is not None and tuning.num_stages is not None
    kfit = cast("tuple[float, float, float] | None", consts["kfit"])
    fast_k, k_high = fast_key_planes(spec, kfit, tuning.fast_keys)
    # 4-bit codebook keys, two codes per byte: byte-permute lookup (inline PTX: not under the CPU interpreter)
    klut = (
        nibble_lut_asm(consts["codebook_host"])
        if tuning.prmt_keys
        and not fast_k
        and not INTERPRET
        and spec.KEY_MODE != KEY_RAW
        and spec.KB == 4
        and spec.KW1 == 0
        else None
    )
    fuse = tuning.fuse_query and fused_query(spec, kv.codec)
    qt = workspace(
        "qt_fused" if fuse else "qt",
        (bsz * qn * hq, consts["qmat"].shape[0] if not fuse else d),
        torch.float32,
        q.device,
    )
    g = hq // hkv
    rk, rv = kv.recent_k, kv.recent_v
    ring_fallback = rk.shape[2] == 0 or rk.numel() == 0  # no ring storage: point at q, never read
    # splits cut the virtual tokens [0, compressed capacity + ring capacity)
    capacity = kv.block_table.shape[1] * spec.BS + (0 if ring_fallback else rk.shape[2])
    splits = tuning.num_splits or choose_splits(
        bsz, hkv, capacity, _num_sms(q.device), tuning.block_n, tuning.waves or WAVES
    )
    fused_reduce = tuning.fused_reduce and splits > 1 and new is None  # (the in-launch merge stores one token's rows)
    group_size = math.isqrt(splits - 1) + 1 if splits > 1 else 1  # ~sqrt(splits) splits per first-level group
    po: torch.Tensor | None = None
    plse: torch.Tensor | None = None
    if splits > 1:
        po = workspace("decode_po", (bsz * qn * hq * splits, d), torch.float32, q.device)
        plse = workspace("decode_lse", (bsz * qn * hq * splits,), torch.float32, q.device)
    n_cnt = bsz * hkv * (2 + (splits - 1) // group_size) if fused_reduce else 1
    if ring_fallback:
        rk = rv = q.unsqueeze(2)
    vsub, vsc = value_subchunks(spec)
    ka, kb_, kg = kfit or (0.0, 0.0, 0.0)
    ob, oh = (out.stride(-3), out.stride(-2)) if out is not None else (hq * d, d)
    kn = new[0] if new is not None else None
    ints = DecodeInts(
        stride_qb=q.stride(0),
        stride_qh=q.stride(1),
        stride_bt=kv.block_table.stride(0),
        page_bytes=spec.PB,
        stride_rkn=rk.stride(0),
        stride_rkh=rk.stride(1),
        stride_rkt=rk.stride(2),
        stride_rvn=rv.stride(0),
        stride_rvh=rv.stride(1),
        stride_rvt=rv.stride(2),
        stride_ob=ob,
        stride_oh=oh,
        tokens_per_split=tuning.block_n,
        n_splits=splits,
        group_size=group_size,
        window=window,
        ring=max(1, rk.shape[2]),
    )
    scalars = DecodeScalars(
        scale_log2=scale * LOG2E,
        qt_scale=scale * LOG2E / math.sqrt(d),
        qjl_scale=kv.codec.qjl_scale,
        k_alpha=ka,
        k_beta=kb_,
        k_gamma=kg,
        zero_rt=0.0,
        klt_scale=klt["read"][5],
        cap2=cap2,
    )
    cfg = DecodeConstexprs(
        HKV=hkv,
        G=g,
        GP=next_pow2(g * qn),  # rows: (query token, query head) pairs
        QW=qt.shape[1],
        KCWP=max(16, next_pow2(spec.KCW)),
        CHP=max(16, next_pow2(spec.CH)),
        VSUB=vsub,
        VSUBP=max(16, next_pow2(vsub)),
        VSC=vsc,
        NGP=max(16, next_pow2(spec.NG)),
        LOG2D=max(d, 1).bit_length() - 1,
        BLOCK_N=tuning.block_n,
        BLOCK_R=tuning.block_r,
        SPB=max(1, MERGE_ELEMS // (next_pow2(g) * next_pow2(d))),
        FAST_K=fast_k,
        K_HIGH=k_high,
        LUT_PRMT=klut is not None,
        KLUT=klut or "",
        FAST_V=tuning.fold_values and spec.VAL_MODE == VAL_GROUP and spec.GROUP % vsub == 0,
        FUSE_Q=fuse,
        SINGLE=splits == 1,
        FUSED_REDUCE=fused_reduce,
        INTERP=INTERPRET,
        **extras_flags(extras),
        NEW=new is not None,
        QN=qn,
        XR=0 if new is None or ring_fallback else rk.shape[2],
        BLOCKW=new is not None and kv.layout.fmt.block_window and not ring_fallback,
    )
    klt_spec = klt.get("spec", None)
    klt_bundle = klt["bundle"]
    if klt_spec is not None and klt_spec.SELECT != tuning.klt_select:
        klt_spec = replace(klt_spec, SELECT=tuning.klt_select)
        klt_bundle = constexpr_bundle(klt_spec)
    meta, levels, dec, mean, turns, _ = klt["decode_read"]
    plan = DecodePlan(
        batch=bsz,
        q_heads=hq,
        query_tokens=qn,
        kv_heads=hkv,
        head_dim=d,
        splits=splits,
        grid=(bsz * hkv, splits),
        num_warps=tuning.num_warps,
        num_stages=tuning.num_stages,
        maxnreg=tuning.maxnreg or None,
        tuning=tuning,
        cfg=cfg,
        fuse_query=fuse,
        fused_reduce=fused_reduce,
        ring_fallback=ring_fallback,
        ints=ints,
        scalars=scalars,
        new_strides=(kn.stride(0), kn.stride(1), kn.stride(2)) if kn is not None else (0, 0, 0),
        page=spec,
        klt=klt_spec if klt_spec is not None else NO_KLT,
        consts=DecodeConstants(
            codebook=consts["codebook"],
            klt_meta=meta,
            klt_levels=levels,
            klt_dec=dec,
            klt_mean=mean,
            klt_turns=turns,
            klt_sink=klt["sink"],
            hsigns=consts["hsigns"],
            vcodebook=consts["vcodebook"],
            vpi=consts["vpi"],
            sinks=sinks,
        ),
        qmat=consts["qmat"],
        qt=qt,
        po=po,
        plse=plse,
        cnt=counters(n_cnt, q.device),
        constexprs=dict(PAGE=page, CFG=constexpr_bundle(cfg), KLT=klt_bundle),
        reduce_constexprs=dict(HQ=hq, D=d, DP=next_pow2(d), SP=max(2, next_pow2(splits))),
        key=(next(_SERIAL),),  # unique per plan (an id() could be reused by a later plan)
    )
    if tuning.waves is None and tuning.num_splits is None and splits > 1:  # one full wave of the compiled kernel
        fit = choose_splits(bsz, hkv, capacity, _num_sms(q.device), tuning.block_n, programs_per_sm(plan, q, kv, new))
        if fit != splits:
            return plan_decode(q4, kv, scale, out, replace(tuning, num_splits=fit), extras, new)
    return plan


def _plan_key(
    q: torch.Tensor,
    kv: PagedKV,
    out: torch.Tensor | None,
    scale: float,
    tuning: DecodeTuning,
    extras: AttentionExtras = NO_EXTRAS,
    new: tuple | None = None,
) -> tuple:
    """What a decode plan depends on: the codec, every shape and stride the launch bakes in, the scale, the knobs,
    the layer's extras (its sinks tensor by address: the plan holds their fp32 copy, or them), the new tokens'
    k, v strides and dtype (multi-token)."""
    rk = kv.recent_k
    sinks = extras.sinks
    return (
        None if new is None else (new[0].stride(), new[0].dtype),
        None if sinks is None else (sinks.data_ptr(), sinks.dtype),
        extras.soft_cap,
        extras.sliding_window,
        id(kv.codec),
        kv.layout.block_size,
        q.shape,
        q.dtype,
        q.stride(),
        q.device,
        kv.pages.device,
        kv.block_table.shape[1],
        kv.block_table.stride(0),
        rk.shape,
        rk.stride(),
        kv.recent_v.stride(),
        None if out is None else out.stride(),
        scale,
        tuning,
    )


def hybrid_decode(
    q: torch.Tensor,
    kv: PagedKV,
    softmax_scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    tuning: DecodeTuning = DEFAULT_TUNING,
    extras: AttentionExtras = NO_EXTRAS,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence, q [B, Hq, D] (fp16/bf16/fp32), over ``kv`` -> [B, Hq, D]; ``extras``:
    the layer's sinks, soft cap and sliding window (``attention.extras``). q [B, Q, Hq, D] with the Q new tokens'
    k, v [B, Q, Hkv, D] -> [B, Q, Hq, D]: speculative verification rows over the history ``kv`` holds, causal among
    themselves (``attention.reference.paged_attention_decode``'s multi-token form; CUDA-graph safe like Q = 1).

    ``tuning``: launch knobs (``DecodeTuning``; defaults from the H200 sweep per format). Same contract as
    ``attention.reference.paged_attention_decode`` (a sequence with nothing cached gets zeros instead of an error,
    so padded CUDA-graph batches are safe). The plan is made on the first call of a shape and kept (in ``kv.plans``,
    the view owner's store, else ``_PLANS``), and the kernels launch through ``FastLauncher``: an eager call costs a
    few µs of host time.
    """
    if q.stride(-1) != 1 or (q.dim() == 4 and q.stride(0) != q.shape[1] * q.stride(1)):
        q = q.contiguous()
    new = None
    if k is not None or v is not None:
        if k is None or v is None:
            raise ShapeError("k, v: a multi-token decode takes both")
        if k.stride() != v.stride() or k.stride(-1) != 1:
            k, v = k.contiguous(), v.contiguous()
        new = (k, v)
    if out is not None and out.dim() == 4 and out.stride(0) != out.shape[1] * out.stride(1):
        return out.copy_(hybrid_decode(q, kv, softmax_scale, tuning=tuning, extras=extras, k=k, v=v))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    key = _plan_key(q, kv, out, scale, tuning, extras, new)
    plans = _PLANS if kv.plans is None else kv.plans
    hit = plans.get(key)
    if hit is None or hit[0] is not kv.codec:  # (an id() in the key can be reused by a later codec)
        hit = plans[key] = (kv.codec, plan_decode(q, kv, scale, out, tuning, extras, new))
    return run(hit[1], q, kv, out, new)
