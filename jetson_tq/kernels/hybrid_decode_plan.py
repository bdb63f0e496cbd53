"""Fused hybrid decode, the host side: launch knobs, the split count, a printable plan, and ``run``.

FlashInfer's split: ``plan_decode`` does everything that depends only on shapes, strides, the format and the knobs
(split count, grid, the ``CFG`` bundle, the layer's device constants, the workspaces) once; ``run(plan, q, kv)``
only launches — no host sync and no allocation, so a CUDA graph can capture it. The kernel itself is
``hybrid_decode`` (``@triton.jit`` code, its steps in ``decode_*``); its runtime arguments are the call's tensors
followed by the plan's named groups (``DecodeConstants``, the workspaces, ``DecodeInts``, ``DecodeScalars``), in the
kernel's parameter order.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple, cast

import torch

from ..attention.extras import NO_EXTRAS, AttentionExtras
from ..errors import DTypeError, ShapeError, expect_same_device
from ..paged import PagedKV
from ._common import (
    INTERPRET,
    KEY_KLT,
    KEY_MSE,
    KEY_RAW,
    LOG2E,
    NO_KLT,
    VAL_GROUP,
    KltSpec,
    PageSpec,
    codec_constants,
    constexpr_bundle,
    counters,
    cuda_or_interpreter,
    klt_constants,
    next_pow2,
    page_spec,
    workspace,
)
from ._launch import FastLauncher, resident_programs
from ._masking import extras_args, extras_flags
from ._tiles import nibble_lut_asm
from .decode_reduce import _decode_reduce_kernel
from .hybrid_decode import DecodeConstexprs, _hybrid_decode_kernel
from .query_transform import query_transform

# Launch defaults from benchmarks/sweep_decode.py on the H200 (docs/benchmarks.md): small programs
# (32 tokens, 2 warps, no software pipelining) and ~16 of them per SM hide the load -> unpack -> MMA
# latency chain better than fewer, larger ones (occupancy, not instruction count, was the limit);
# formats with 3-4 bit key indices do best with 16-token, 1-warp programs, whether the indices go through a
# codebook lookup (Lloyd-Max: 693 vs 800 us) or one bit plane (uniform: 502 vs 566 us).
BLOCK_N = 32
NUM_WARPS = 2
WIDE_BLOCK_N = 16
WIDE_NUM_WARPS = 1
# and a cap of 128 registers per thread (16 one-warp programs per SM, one full wave of WAVES programs:
# mse_k4v3u 526 -> 349 us, mse_k4v3 740 -> 594 us at B=8/64k against 167 registers = 12 programs = 1.33 waves)
WIDE_MAXNREG = 128
NUM_STAGES = 1
KLT_BLOCK_N = 64  # klt keys (not yet swept on a GPU)
KLT_NUM_WARPS = 4
# one-warp programs of 3/4-bit keys pipeline their tile loads (num_stages=2: the next tile's key and value bytes go
# to shared memory by cp.async while this one is scored: 345 -> 308 us at B=8/64k, 109 -> 90.5 at B=1/128k)
WIDE_NUM_STAGES = 2
BLOCK_R = 16  # recent-buffer tokens per step: 64 set the register count (252 -> 167 per thread for mse_k4v3, sm_90)
MERGE_ELEMS = 2048  # partial-output elements merged per step in the in-launch reduction (SPB * GP * DP)
WAVES = 16.0  # programs per SM when no GPU can tell (offline compiles, interpreter); on CUDA the split count aims
# at the compiled kernel's resident programs per SM (``_one_wave``): 16 for 1-warp programs at 128 registers


@dataclass(frozen=True)
class DecodeTuning:
    """Launch knobs of the decode (results do not depend on them). None: the format's default, the best of the H200
    sweep (benchmarks/sweep_decode.py); ``for_format`` fills those in."""

    block_n: int | None = None  # compressed tokens per tile: 16 for 3/4-bit keys, else 32
    num_warps: int | None = None  # 1 for 3/4-bit keys, else 2
    num_stages: int | None = None  # software pipelining of the tile loads: 2 for one-warp 3/4-bit programs, else 1
    maxnreg: int | None = None  # register cap per thread, 0 for none: 128 for one-warp 3/4-bit programs
    block_r: int = BLOCK_R  # recent-buffer tokens per step
    num_splits: int | None = None  # splits per (sequence, KV head); None: from the SMs, one full wave
    waves: float | None = None  # programs per SM the split count aims for; None: what the compiled kernel keeps
    fused_reduce: bool = False  # merge the splits inside the decode launch (one launch per call: ~25 us less host
    # time per eager call, but 2-38 % more device time on the H200, so not the default)
    fast_keys: bool = True  # score affine-codebook keys from index bit planes (off: the centroid lookup)
    prmt_keys: bool = True  # 4-bit symmetric codebooks by byte permutes (off: the warp-shuffle gather)
    fold_values: bool = True  # fold value scales into P, codes as subnormal planes (off: dequantize per element)
    fuse_query: bool = True  # rotate the query inside the launch when it can (off: ``query_transform`` first)
    klt_select: bool = True  # klt keys: code bytes picked by a one-hot int8 product (off: a byte load each)

    def for_format(self, spec: PageSpec) -> DecodeTuning:
        """These knobs with every None that has a per-format default filled in (``num_splits``, ``waves`` stay)."""
        wide = spec.KB >= 3  # 3/4-bit keys (lookup or one wide plane): 16-token one-warp programs measured best
        if spec.KEY_MODE == KEY_KLT:  # a [BLOCK_N, D] x [D, D] decode product per tile: wider tiles, more warps
            return replace(
                self,
                block_n=self.block_n or KLT_BLOCK_N,
                num_warps=self.num_warps or KLT_NUM_WARPS,
                maxnreg=self.maxnreg if self.maxnreg is not None else 0,
                num_stages=self.num_stages if self.num_stages is not None else NUM_STAGES,
            )
        num_warps = self.num_warps or (WIDE_NUM_WARPS if wide else NUM_WARPS)
        one_warp_wide = wide and num_warps == WIDE_NUM_WARPS
        return replace(
            self,
            block_n=self.block_n or (WIDE_BLOCK_N if wide else BLOCK_N),
            num_warps=num_warps,
            maxnreg=self.maxnreg if self.maxnreg is not None else WIDE_MAXNREG if one_warp_wide else 0,
            num_stages=self.num_stages
            if self.num_stages is not None
            else WIDE_NUM_STAGES
            if one_warp_wide
            else NUM_STAGES,
        )


DEFAULT_TUNING = DecodeTuning()


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


def value_subchunks(spec: PageSpec) -> tuple[int, int]:
    """(coordinates per value sub-chunk, sub-chunks per chunk): a chunk is cut at value-group edges when it spans
    several."""
    if spec.VAL_MODE == VAL_GROUP and spec.VCW % spec.GROUP == 0 and spec.GROUP < spec.VCW:
        return spec.GROUP, spec.VCW // spec.GROUP
    return spec.VCW, 1


def choose_splits(
    batch: int, num_kv_heads: int, capacity: int, num_sms: int, block_n: int = BLOCK_N, waves: float = WAVES
) -> int:
    """Splits per sequence so that B * Hkv * splits programs give every SM at most ``waves`` programs (host-side only).

    Rounded down: with ``waves`` = programs resident per SM, a few programs past one full wave make a second, almost
    empty wave that the whole launch waits for (on the H200: 1600 programs on 1584 slots, 944 vs 740 us)."""
    tiles = max(1, -(-capacity // block_n))
    want = max(1, int(waves * num_sms) // max(1, batch * num_kv_heads))
    return max(1, min(tiles, want, 256))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def fast_key_planes(spec: PageSpec, kfit: tuple[float, float, float] | None, enabled: bool = True) -> tuple[bool, bool]:
    """(FAST_K, K_HIGH): score keys from index bit planes (affine codebook ``kfit``, one planar run) and whether the
    2-bit Lloyd-Max codebook's extra (k >> 1) plane is needed."""
    fast = enabled and spec.KEY_MODE != KEY_RAW and spec.KB > 0 and spec.KW1 == 0 and kfit is not None
    return fast, fast and kfit is not None and kfit[2] != 0.0


def fused_query(spec: PageSpec, codec) -> bool:
    """True when the decode launch rotates the query itself (mse keys, randomized Hadamard, D a power of two >= 16)."""
    rot = codec.key_rotation
    return spec.KEY_MODE == KEY_MSE and rot is not None and rot.kind == "hadamard" and spec.D == spec.DP


_PLANS: dict = {}
_SERIAL = itertools.count()
_DECODE = FastLauncher(_hybrid_decode_kernel)
_REDUCE = FastLauncher(_decode_reduce_kernel)


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


def _flat(q: torch.Tensor) -> torch.Tensor:
    """q [B, Q, Hq, D] as the kernel's [B * Q, Hq, D] rows (a view: one token stride); a 3-d q as it is."""
    return q.view(-1, q.shape[-2], q.shape[-1]) if q.dim() == 4 else q


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

    q [B, Q, Hq, D] (its B and Q dims one token stride: ``_flat``) with ``new`` = the Q new tokens' (k, v)
    [B, Q, Hkv, D] (equal strides): Q query tokens per sequence folded into the rows of each program's query tile
    next to the G query heads of its KV head (CFG.QN; Q = 1 compiles the one-token kernel)."""
    _check_query(q, kv, new)
    extras.check(q.shape[-2], q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qn = q.shape[1] if q.dim() == 4 else 1
    q4, q = q, _flat(q)
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
        nibble_lut_asm(consts["codebook"].cpu())
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
        fit = choose_splits(bsz, hkv, capacity, _num_sms(q.device), tuning.block_n, _one_wave(plan, q, kv, new))
        if fit != splits:
            return plan_decode(q4, kv, scale, out, replace(tuning, num_splits=fit), extras, new)
    return plan


def _recent(plan: DecodePlan, q: torch.Tensor, kv: PagedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """The recent-buffer keys and values the kernel reads (q itself when there is no buffer storage: never read)."""
    if plan.ring_fallback:
        return q.unsqueeze(2), q.unsqueeze(2)
    return kv.recent_k, kv.recent_v


def _decode_args(plan: DecodePlan, q: torch.Tensor, kv: PagedKV, out: torch.Tensor, new: tuple | None = None) -> tuple:
    """The decode kernel's runtime arguments (everything but the constexprs) for one call, in its parameter order;
    q, out as the kernel's rows (``_flat``), ``new``: the new tokens' (k, v) (CFG.QN > 1; q stands in without)."""
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


def _one_wave(plan: DecodePlan, q: torch.Tensor, kv: PagedKV, new: tuple | None = None) -> float:
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
    result, q, out = out, _flat(q), _flat(out)
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
    so padded CUDA-graph batches are safe). The plan is made on the first call of a shape and kept (``_PLANS``), and
    the kernels launch through ``FastLauncher``: an eager call costs a few µs of host time.
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
    hit = _PLANS.get(key)
    if hit is None or hit[0] is not kv.codec:
        hit = _PLANS[key] = (kv.codec, plan_decode(q, kv, scale, out, tuning, extras, new))
    return run(hit[1], q, kv, out, new)
