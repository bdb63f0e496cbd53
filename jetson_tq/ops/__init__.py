"""Operations on paged TurboQuant storage: write, decode, prefill, scores — one entry each.

Every caller (the public API, ``CompressedKVCache``, the transformers cache, the vLLM backend) goes through
these functions, and only ``ops.backend.resolve`` picks the Triton kernel or the PyTorch reference. The
kernels and the reference sit below this package and never import it. Kernels are imported lazily, so
CPU-only users never import Triton.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..attention.extras import NO_EXTRAS, AttentionExtras
from ..attention.reference import paged_attention_decode, paged_attention_prefill
from ..codec.kv import KVCodec
from ..codec.scores import expect_scores_tensors, turboquant_scores_reference
from ..format import PagedLayout
from ..paged import AppendState, AppendStep, PagedKV, append_rows_reference, write_slots
from ..validate import StoreLimits, store_fault_code
from .backend import BACKENDS, ENV_VAR, configured, graph_safe, resolve

if TYPE_CHECKING:
    from ..attention.reference import VarlenAttention
    from ..kernels.prefill_flash_plan import FlashPlan

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "configured",
    "resolve",
    "graph_safe",
    "append_rows",
    "write",
    "decode",
    "prefill",
    "prefill_rows",
    "plan_prefill_rows",
    "scores",
    "report_compiles",
    "kernel_variant",
]

#: Tokens the reference write path encodes per step: bounds its fp32 temporaries (a few MB) at any append size.
WRITE_CHUNK_ELEMENTS = 1 << 18


def append_rows(
    k: torch.Tensor, v: torch.Tensor, state: AppendState, step: AppendStep, backend: str | None = None
) -> torch.Tensor | None:
    """A ``CompressedKVCache`` append's bookkeeping (page slots, exact ring copy, lengths; ``kernels.append``) of
    k, v [nb, H, T, D] on the cache's ``state``; ``step``: the rows, what this launch does, a store fault record
    (``write``'s ``fault``) that must hold no fault for the commit, a reused buffer for the slots."""
    if resolve(k.device, None, backend) == "triton":
        from ..kernels.append import append_rows as kernel

        return kernel(k, v, state, step)
    return append_rows_reference(k, v, state, step)


def report_compiles(hook: Callable[[str, tuple, float], None] | None) -> None:
    """From now on call ``hook(kernel_name, launch_key, seconds)`` after every kernel compile (None: stop); the vLLM
    warm-up sets it when its compiles are done, so a first request that still compiles is named in the log."""
    from ..kernels._launch import report_compiles as set_hook

    set_hook(hook)


def kernel_variant(codec: KVCodec, extras: AttentionExtras, device: torch.device) -> tuple:
    """What of a layer's codec and extras its Triton launches are specialized on beyond its page layout and the step's
    shapes (``kernels.specializations.layer_variant``): two layers of one layout and variant compile the same
    kernels, so the vLLM warm-up runs one of them."""
    from ..kernels.specializations import layer_variant

    return layer_variant(codec, extras, device)


def write(
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    pages: torch.Tensor,
    layout: PagedLayout,
    codec: KVCodec,
    backend: str | None = None,
    fault: torch.Tensor | None = None,
    limits: StoreLimits | None = None,
    positions: torch.Tensor | None = None,
) -> None:
    """Compress k, v [N, H, D] and store them at ``slots`` [N] of ``pages`` (slot < 0 skipped, as vLLM pads); k, v
    may also be rows [R, T, H, D] (slots [R * T] row by row), which the kernel reads in place in one launch.
    ``positions`` (shaped like ``slots``): each token's position in its sequence, which klt keys are coded at.

    ``fault`` (int64 [2]) with ``limits``: also check the tokens against ``limits`` (``validate.check_kv_storable``'s
    bounds) and keep the smallest store fault code in fault[0] unless fault[1] (closed) is set — on the device
    inside the compress-on-write kernel (no host sync), or ``validate.store_fault_code`` on the reference path."""
    if resolve(k.device, layout, backend) == "triton":
        from ..kernels.compress_write_plan import compress_write

        compress_write(k, v, slots, pages, layout, codec, fault=fault, limits=limits, positions=positions)
        return
    if k.dim() == 4:
        k, v = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
    if fault is not None and int(fault[1]) == 0:
        assert limits is not None  # a fault record always comes with the store's limits
        fault[0] = min(int(fault[0]), store_fault_code(k, v, slots, layout.fmt, limits))
    pos = None if positions is None else positions.reshape(-1, 1)
    step = max(1, WRITE_CHUNK_ELEMENTS // max(1, k.shape[1] * k.shape[2]))
    for i in range(0, k.shape[0], step):
        at = None if pos is None else pos[i : i + step]
        write_slots(pages, layout, slots[i : i + step], codec.encode(k[i : i + step], v[i : i + step], at, 1))


def decode(
    q: torch.Tensor,
    kv: PagedKV,
    softmax_scale: float | None = None,
    backend: str | None = None,
    out: torch.Tensor | None = None,
    extras: AttentionExtras = NO_EXTRAS,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence, q [B, Hq, D], over everything ``kv`` holds -> [B, Hq, D];
    ``extras``: the layer's sinks, soft cap and sliding window (``attention.extras``). With q [B, Q, Hq, D] and the
    new tokens' k, v [B, Q, Hkv, D]: Q query tokens per sequence over the history ``kv`` describes, causal among
    themselves (speculative verification rows; ``attention.reference.paged_attention_decode``) -> [B, Q, Hq, D]."""
    extras.check(q.shape[-2], q.device)
    if resolve(q.device, kv.layout, backend) == "triton":
        from ..kernels.hybrid_decode_plan import hybrid_decode

        return hybrid_decode(q, kv, softmax_scale, out=out, extras=extras, k=k, v=v)
    res = paged_attention_decode(q, kv, softmax_scale, extras, k, v)
    if out is not None:
        out.copy_(res)
        return out
    return res


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKV,
    softmax_scale: float | None = None,
    backend: str | None = None,
    attn_mask: torch.Tensor | None = None,
    max_tokens: int | None = None,
    reproducible: bool = False,
    varlen: VarlenAttention | None = None,
    history: Sequence[int] | None = None,
    extras: AttentionExtras = NO_EXTRAS,
) -> torch.Tensor:
    """Attention of a chunk q [B, Hq, T, D] over the history in ``kv`` plus its own k, v [B, Hkv, T, D] (causal,
    window rule of ``attention.reference.paged_attention_prefill``; the pages already hold the chunk).

    ``varlen`` (a FlashAttention varlen call, e.g. vLLM's) with ``history`` (each sequence's history length, on the
    host): the dense attention runs in that kernel over the dequantized history (``kernels.prefill_flash``) wherever
    it can serve the format; the Triton loop serves the rest.

    An explicit ``attn_mask`` (padding, custom patterns) is served by the reference. ``max_tokens``: a host-side
    bound on every sequence's history + T, when the caller knows one (sizes the kernel's workspace).
    ``reproducible``: a row's result is bitwise independent of the chunk and batch it arrives in (the kernel's
    ``PrefillTuning.reproducible``; the reference computes each row the same way already, up to torch's own kernels).
    ``extras``: the layer's sinks, soft cap and sliding window (``attention.extras``), served by every path.
    """
    extras.check(q.shape[1], q.device)
    if attn_mask is None and resolve(q.device, kv.layout, backend) == "triton":
        from ..kernels.prefill_plan import DEFAULT_TUNING, PrefillTuning, chunked_prefill

        if varlen is not None and history is not None and not reproducible:
            from ..kernels.prefill_flash import flash_prefill, flash_unsupported_reason

            if flash_unsupported_reason(kv, q.dtype, extras) is None:
                return flash_prefill(q, k, v, kv, history, varlen, softmax_scale, extras=extras)
        tuning = PrefillTuning(reproducible=True) if reproducible else DEFAULT_TUNING
        return chunked_prefill(q, k, v, kv, softmax_scale, max_tokens=max_tokens, tuning=tuning, extras=extras)
    return paged_attention_prefill(q, k, v, kv, softmax_scale, attn_mask, extras)


def plan_prefill_rows(
    kv: PagedKV,
    history: Sequence[int] | np.ndarray,
    query_start_loc: Sequence[int] | np.ndarray,
    workspace_tokens: int | None = None,
) -> FlashPlan:
    """The host plan of ``prefill_rows``' FlashAttention path for chunks [query_start_loc[b], query_start_loc[b + 1])
    after ``history[b]`` tokens (``kernels.prefill_flash_plan``): it depends on the rows and on ``kv``'s ring, KV
    heads and head width only, so a step builds it once and every layer of those shapes reuses it."""
    from ..kernels.prefill_flash import plan_for

    return plan_for(kv, history, query_start_loc, workspace_tokens=workspace_tokens)


def prefill_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKV,
    query_start_loc: Sequence[int] | np.ndarray,
    history: Sequence[int] | np.ndarray,
    softmax_scale: float | None = None,
    *,
    varlen: VarlenAttention | None = None,
    plan: FlashPlan | None = None,
    reproducible: bool = False,
    extras: AttentionExtras = NO_EXTRAS,
    backend: str | None = None,
) -> torch.Tensor:
    """``prefill`` of a step's ragged chunks at once: q [N, Hq, D], k, v [N, Hkv, D] token-major (vLLM's layout),
    sequence b's rows [query_start_loc[b], query_start_loc[b + 1]) (at least one each) after ``history[b]`` tokens
    (host ints), ``kv`` holding the n sequences -> [N, Hq, D].

    With ``varlen`` on the Triton backend every row goes through FlashAttention in one call
    (``kernels.prefill_flash.flash_prefill_rows``; ``plan``: ``plan_prefill_rows``' result for these rows, built
    here if None); what that path does not serve (``flash_unsupported_reason``, ``reproducible``) runs sequence by
    sequence through ``prefill``."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    hist = np.asarray(history, dtype=np.int64)
    extras.check(q.shape[1], q.device)
    if varlen is not None and not reproducible and resolve(q.device, kv.layout, backend) == "triton":
        from ..kernels.prefill_flash import flash_prefill_rows, flash_unsupported_reason, plan_for

        if flash_unsupported_reason(kv, q.dtype, extras) is None:
            plan = plan_for(kv, hist, qsl) if plan is None else plan
            return flash_prefill_rows(q, k, v, kv, plan, varlen, softmax_scale)
    out = torch.empty_like(q)
    for b in range(len(hist)):
        qs, qe, s = int(qsl[b] - qsl[0]), int(qsl[b + 1] - qsl[0]), int(hist[b])
        one = kv.sequence(b)
        qb, kb, vb = (x[qs:qe].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        res = prefill(
            qb,
            kb,
            vb,
            one,
            softmax_scale,
            backend,
            max_tokens=s + qe - qs,
            reproducible=reproducible,
            varlen=varlen,
            history=[s],
            extras=extras,
        )
        out[qs:qe] = res[0].transpose(0, 1)
    return out


def scores(Q, K_idx, qjl_signs, gamma, Pi, S_mat, codebook, backend: str | None = None) -> torch.Tensor:
    """Raw TurboQuant_prod scores [B, S] (fp32) of queries Q [B, D] against unpacked keys (see ``codec.scores``)."""
    expect_scores_tensors(Q, K_idx, qjl_signs, gamma, Pi, S_mat, codebook)  # before the backend is picked by Q.device
    if resolve(Q.device, None, backend) == "triton":
        from ..kernels.scores import turboquant_scores_triton

        return turboquant_scores_triton(Q, K_idx, qjl_signs, gamma, Pi, S_mat, codebook)
    return turboquant_scores_reference(Q, K_idx, qjl_signs, gamma, Pi, S_mat, codebook)
