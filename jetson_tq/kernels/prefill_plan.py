"""Chunked prefill, the host side: launch knobs, workspace sizing, a printable plan, and ``run``.

``plan_prefill`` decides once per call everything that depends only on shapes, the format and the knobs (rows per
program, pipeline stages, the workspace segment and count, the ``CFG`` bundle) and allocates the workspaces;
``run(plan, ...)`` only launches: per segment ``prefill_dequant._dequant_kernel`` then ``prefill._prefill_kernel``.
``chunked_prefill`` is the two together (the ``ops`` entry point).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import triton

from ..attention.extras import NO_EXTRAS, AttentionExtras
from ..errors import DTypeError, ShapeError, expect_same_device
from ..format import PREFILL_WORKSPACE_BYTES
from ..paged import PagedKV
from ._common import (
    INTERPRET,
    KEY_MSE,
    KEY_PROD,
    KEY_RAW,
    LOG2E,
    VAL_RAW,
    codec_constants,
    constexpr_bundle,
    cuda_or_interpreter,
    klt_constants,
    page_spec,
)
from ._launch import FastLauncher
from ._masking import extras_args, extras_flags
from .prefill import PrefillConstexprs, _prefill_kernel
from .prefill_dequant import _dequant_kernel
from .query_transform import query_transform

BLOCK_N = 64
NUM_WARPS = 8  # 64-row warp groups: Triton emits wgmma on sm_90
NUM_STAGES = 3
SHARED_BYTES = 232448  # sm_90 shared memory per block (227 KB)
DEQUANT_TOKENS = 64  # tokens per dequantization program (4 warps); 32 above head_dim 128 (registers)
WORKSPACE_BYTES = PREFILL_WORKSPACE_BYTES  # fp16 workspace bound per call (format.py: the worker budget reads it too)


def default_block_m(head_dim: int) -> int:
    """Rows per program: 128 (two 64-row warp groups) up to head_dim 128, 64 beyond (the fp32 accumulator
    [BLOCK_M, D] must stay in registers)."""
    return 128 if head_dim <= 128 else 64


def fit_stages(
    block_m: int, block_n: int, key_width: int, dp: int, exact_bytes: int = 2, want: int = NUM_STAGES
) -> int:
    """Pipeline stages that fit in shared memory. Each loop holds one buffer per stage beside its query operand, and
    Triton's allocation on sm_90 is the larger loop's: the workspace loop stages * BLOCK_N * (KW + DP) * 2 +
    BLOCK_M * KW * 2 (fp16), the exact loops (ring, chunk) stages * BLOCK_N * 2 DP * e + BLOCK_M * DP * e with e the
    ring's element size (H200 call B: an fp32 ring at 3 stages asked for 256 KB)."""
    ws = (SHARED_BYTES - block_m * key_width * 2) // (block_n * (key_width + dp) * 2)
    exact = (SHARED_BYTES - block_m * dp * exact_bytes) // (block_n * 2 * dp * exact_bytes)
    return max(1, min(want, ws, exact))


def workspace_segment(
    batch: int, num_kv_heads: int, row_bytes: int, capacity: int, block: int, budget: int = WORKSPACE_BYTES
) -> int:
    """Tokens per workspace segment: all ``capacity`` tokens if they fit in ``budget`` bytes, else the most that fit
    (a multiple of ``block``, at least one block)."""
    fit = budget // max(1, batch * num_kv_heads * row_bytes) // block * block
    return max(block, min(fit, triton.cdiv(max(capacity, 1), block) * block))


@dataclass(frozen=True)
class PrefillTuning:
    """Launch knobs of ``chunked_prefill`` (results do not depend on them beyond float rounding; ``reproducible``
    fixes that rounding too)."""

    block_m: int | None = None  # rows (token, query head) per program; None: ``default_block_m``
    block_n: int = BLOCK_N  # tokens per tile
    num_warps: int = NUM_WARPS
    num_stages: int | None = None  # None: as many as fit in shared memory (``fit_stages``)
    workspace_tokens: int | None = None  # tokens per (sequence, KV head) dequantized at a time; None: from
    # ``WORKSPACE_BYTES`` (rounded to the tile sizes)
    reproducible: bool = False  # a row's result depends only on its position and the data, not on the chunk it
    # arrives in or the batch beside it: the exact part in position-aligned tiles and a fixed query-transform tile
    # (bitwise reproducible, not a speed knob; the vLLM backend's reproducible mode)


DEFAULT_TUNING = PrefillTuning()
_DEQUANT = FastLauncher(_dequant_kernel)
_PREFILL = FastLauncher(_prefill_kernel)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV) -> None:
    """Named errors for a chunk that does not fit ``kv``."""
    cuda_or_interpreter(q)
    expect_same_device(q=q, k=k, v=v, pages=kv.pages)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ShapeError(f"{name}: expected a 4-d tensor [B, H, T, D], got {tuple(t.shape)}")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise DTypeError(f"{name}: expected float16, bfloat16 or float32, got {t.dtype}")
    bsz, hq, t_len, d = q.shape
    hkv = kv.num_kv_heads
    if d != kv.head_dim or bsz != kv.batch_size or hq % hkv:
        raise ShapeError(f"q: expected [{kv.batch_size}, k*{hkv}, T, {kv.head_dim}], got {tuple(q.shape)}")
    if k.shape != v.shape or k.shape != (bsz, hkv, t_len, d):
        raise ShapeError(f"k, v: expected [{bsz}, {hkv}, {t_len}, {d}], got {tuple(k.shape)} and {tuple(v.shape)}")


def dequantize_segment(
    kv: PagedKV,
    codebook: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    s0: int,
    seg: int,
    t_len: int,
    ring: int,
    block_window: bool,
    tokens_per_program: int,
    token_major: bool,
    window: int = 0,
    unrotate_keys: bool = False,
) -> None:
    """Decompress the compressed tokens [s0, s0 + seg) that a ``t_len``-token chunk reads into the workspace ``wk``,
    ``wv`` (``_dequant_kernel``; rows (sequence, KV head, token), or (sequence, token, KV head) if ``token_major``).
    ``window``: a sliding window W (0: none): tokens before the first chunk row's window start are not read.
    ``unrotate_keys``: mse keys written in the original domain (scored against the raw query, not Pi q); prod keys
    cannot be (their second product needs S q)."""
    hkv = kv.num_kv_heads
    spec, page = page_spec(kv.layout, kv.codec)
    if unrotate_keys and spec.KEY_MODE == KEY_PROD:
        raise ShapeError("dequantize_segment: prod keys are scored against S q too; they cannot be rotated back")
    unrotate_keys = unrotate_keys and spec.KEY_MODE == KEY_MSE
    klt = klt_constants(kv.codec, kv.pages.device)
    meta, levels, dec, mean, turns, klt_scale = klt["read"]
    consts = codec_constants(kv.codec, kv.pages.device)
    _DEQUANT(
        (kv.batch_size * hkv, seg // tokens_per_program),
        (
            kv.pages,
            kv.block_table,
            kv.compressed_lens,
            kv.recent_lens,
            codebook,
            consts["vcodebook"],
            consts["vpi"],
            *consts["write_mats"][0],
            meta,
            levels,
            dec,
            mean,
            turns,
            wk,
            wv,
            s0,
            seg,
            t_len,
            ring,
            kv.block_table.stride(0),
            kv.codec.qjl_scale,
            klt_scale,
            window,
        ),
        dict(
            HKV=hkv,
            KW=wk.shape[-1],
            BLOCK_WINDOW=block_window,
            WINDOW=window > 0,
            BLOCK_T=tokens_per_program,
            TOKEN_MAJOR=token_major,
            UNROTATE_KEYS=unrotate_keys,
            PAGE=page,
            KLT=klt["bundle"],
            INTERP=INTERPRET,
        ),
        (
            spec,
            klt.get("spec"),
            hkv,
            wk.shape[-1],
            block_window,
            tokens_per_program,
            token_major,
            window > 0,
            unrotate_keys,
        ),
        num_warps=4,
    )
    if s0 == 0 and kv.codec.has_sink:  # workspace row 0 is position 0: where it reads compressed, the sink is read
        sink, d = klt["sink16"], kv.layout.head_dim
        shape = (kv.batch_size, seg, hkv, -1) if token_major else (kv.batch_size, hkv, seg, -1)
        for w, constant in ((wk, sink[0]), (wv, sink[1])):
            w.view(shape).select(1 if token_major else 2, 0)[..., :d] = constant


@dataclass(frozen=True)
class PrefillWorkspaces:
    """The tensors one prefill call writes between its launches: the dequantized segment (keys ``wk``
    [B * HKV, seg, KW], values ``wv`` [B * HKV, seg, DP]) and, with several segments, the running state of every row
    (``state`` fp32 [rows, DP + 4]: output, max at DP, sum at DP + 1, rows 16-byte aligned; else the output,
    never touched)."""

    wk: torch.Tensor
    wv: torch.Tensor
    state: torch.Tensor


@dataclass(frozen=True)
class PrefillPlan:
    """Everything a prefill call fixes before its first launch (printable: the workspaces stay out of ``repr``)."""

    grid: tuple[int, int]  # (B * HKV, row blocks)
    seg: int  # workspace tokens per (sequence, KV head) and segment
    nseg: int  # segments (flash launches)
    dq_tokens: int  # tokens per dequantization program
    ring: int  # the recent window R
    block_window: bool  # window rule: own R-token block
    scale: float  # softmax scale
    window: int  # sliding window W (0: none)
    cap2: float  # soft cap * log2(e)
    num_warps: int
    num_stages: int
    cfg: PrefillConstexprs  # the flash kernel's bundle (LOAD_STATE / FINAL set per segment by ``run``)
    ws: PrefillWorkspaces = field(repr=False)
    sinks: torch.Tensor = field(repr=False)


def plan_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    kv: PagedKV,
    softmax_scale: float | None,
    out: torch.Tensor,
    max_tokens: int | None = None,
    tuning: PrefillTuning = DEFAULT_TUNING,
    extras: AttentionExtras = NO_EXTRAS,
) -> PrefillPlan:
    """The plan of one ``chunked_prefill`` call for query ``q`` [B, Hq, T, D] and the chunk's keys ``k`` over ``kv``
    (see there for ``max_tokens``, ``tuning`` and ``extras``); the workspaces are allocated here."""
    bsz, hq, t_len, d = q.shape
    hkv = kv.num_kv_heads
    spec, _ = page_spec(kv.layout, kv.codec)
    ring = kv.recent_k.shape[2]  # the window R: positions older than exact_start(p) are read compressed
    rk_bytes = (k if ring == 0 or kv.recent_k.numel() == 0 else kv.recent_k).element_size()  # the exact operands
    block_window = kv.layout.fmt.block_window and ring > 0
    block_m, block_n = tuning.block_m or default_block_m(d), tuning.block_n
    dp, prod = spec.DP, spec.KEY_MODE == KEY_PROD
    raw_t = torch.bfloat16 if spec.RAW_BF16 else torch.float16
    kw = 2 * dp if prod else dp
    num_stages = tuning.num_stages or fit_stages(block_m, block_n, kw, dp, rk_bytes)
    # workspace segments: the pages hold at most block-table width x block size tokens per sequence (a host-side
    # bound, no sync); programs past a sequence's compressed range exit at once
    capacity = kv.block_table.shape[1] * spec.BS
    if max_tokens is not None:
        capacity = min(capacity, max(int(max_tokens), 1))
    dq_tokens = DEQUANT_TOKENS if dp <= 128 else DEQUANT_TOKENS // 2
    step = max(block_n, dq_tokens)
    seg = tuning.workspace_tokens or workspace_segment(bsz, hkv, 2 * (kw + dp), capacity, step)
    seg = triton.cdiv(seg, step) * step
    nseg = max(1, triton.cdiv(capacity, seg))
    g = hq // hkv
    grid = (bsz * hkv, triton.cdiv(t_len * g, block_m))
    dev = q.device
    wk = torch.empty(bsz * hkv, seg, kw, dtype=raw_t if spec.KEY_MODE == KEY_RAW else torch.float16, device=dev)
    wv = torch.empty(bsz * hkv, seg, dp, dtype=raw_t if spec.VAL_MODE == VAL_RAW else torch.float16, device=dev)
    if nseg > 1:  # the running (acc, max, sum) of every row between the segments' flash launches
        state = torch.empty(grid[0] * grid[1] * block_m, dp + 4, dtype=torch.float32, device=dev)
        ws = PrefillWorkspaces(wk, wv, state)
    else:
        ws = PrefillWorkspaces(wk, wv, out)  # never read or written (FINAL, no LOAD_STATE)
    sinks, cap2, window = extras_args(extras, out)
    cfg = PrefillConstexprs(
        HKV=hkv,
        G=g,
        QW=codec_constants(kv.codec, q.device)["qmat"].shape[0],
        KW=kw,
        D=d,
        DP=dp,
        PROD=prod,
        KQ_BF16=spec.KEY_MODE == KEY_RAW and spec.RAW_BF16,
        BLOCK_WINDOW=block_window,
        LOAD_STATE=False,
        FINAL=False,
        ALIGNED=tuning.reproducible,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        INTERP=INTERPRET,
        **extras_flags(extras),
    )
    return PrefillPlan(
        grid=grid,
        seg=seg,
        nseg=nseg,
        dq_tokens=dq_tokens,
        ring=ring,
        block_window=block_window,
        scale=softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d),
        window=window,
        cap2=cap2,
        num_warps=tuning.num_warps,
        num_stages=num_stages,
        cfg=cfg,
        ws=ws,
        sinks=sinks,
    )


def run(
    plan: PrefillPlan,
    qt: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKV,
    out: torch.Tensor,
) -> None:
    """Launch ``plan``: per segment the dequantization, then the flash loop (the last one writes ``out``). ``qt``:
    the transformed query rows [B * Hq * T, QW] (``query_transform``)."""
    ws, t_len = plan.ws, q.shape[2]
    codebook = codec_constants(kv.codec, q.device)["codebook"]
    rk, rv = kv.recent_k, kv.recent_v
    if rk.shape[2] == 0 or rk.numel() == 0:  # no buffer storage: point at k, never read (recent_lens are 0)
        rk, rv = k, v
    workspaces = (ws.wk, ws.wv, ws.state)
    tensors = (qt, q, k, v, *workspaces, kv.compressed_lens, rk, rv, kv.recent_lens, kv.recent_index, out, plan.sinks)
    strides = tuple(t.stride()[:3] for t in (q, k, v, rk, rv, out))  # the kernel's q_strides .. out_strides
    scalars = (plan.scale * LOG2E, plan.ring, plan.cap2, plan.window)
    for i in range(plan.nseg):
        s0 = i * plan.seg
        dequantize_segment(
            kv,
            codebook,
            ws.wk,
            ws.wv,
            s0,
            plan.seg,
            t_len,
            plan.ring,
            plan.block_window,
            plan.dq_tokens,
            False,
            plan.window,
        )
        cfg = replace(plan.cfg, LOAD_STATE=i > 0, FINAL=i == plan.nseg - 1)
        _PREFILL(
            plan.grid,
            (*tensors, s0, plan.seg, t_len, *strides, *scalars),
            dict(CFG=constexpr_bundle(cfg)),
            (cfg,),
            num_warps=plan.num_warps,
            num_stages=plan.num_stages,
        )


def chunked_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKV,
    softmax_scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    max_tokens: int | None = None,
    tuning: PrefillTuning = DEFAULT_TUNING,
    extras: AttentionExtras = NO_EXTRAS,
) -> torch.Tensor:
    """Attention of q [B, Hq, T, D] over ``kv``'s history plus the chunk's own k, v [B, Hkv, T, D] (causal, window
    rule; ``kv.pages`` already hold the chunk's compressed tokens). ``max_tokens``: a host-side bound on every
    sequence's history + T (vLLM knows it), else the block table's capacity; it sizes the workspace and the segment
    count, so it must not be too small. ``tuning``: launch knobs (``PrefillTuning``). ``extras``: sinks, soft cap and
    sliding window (``attention.extras``; constexpr-gated). Both kernels launch through ``FastLauncher``."""
    _check_inputs(q, k, v, kv)
    extras.check(q.shape[1], q.device)
    bsz, hq, t_len, d = q.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if out is None:
        out = torch.empty_like(q)
    if t_len == 0:
        return out
    plan = plan_prefill(q, k, kv, softmax_scale, out, max_tokens, tuning, extras)
    consts = codec_constants(kv.codec, q.device)
    qt = query_transform(
        q.reshape(bsz * hq, t_len, d),
        consts["qmat"],
        plan.scale * LOG2E,
        reproducible=tuning.reproducible,
        qmat16=consts["qmat16"],
    )
    run(plan, qt, q, k, v, kv, out)
    return out
