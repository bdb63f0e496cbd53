"""Cache append bookkeeping in one launch: page slots of the new tokens, the exact ring copy, the lengths.

For each appended row b (one program each, so no two programs touch one row's length) with L = lens[b] tokens
and T new ones:
- STAGE: slots[i * T + t] = b * capacity + L + t for the T positions (-1 past the capacity, and the overflow
  flag is set), which ``compress_write`` then fills;
- COMMIT: the last min(T, R) tokens are copied exactly into ring row (L + t) % R, then lens[b] = L + T,
  rec[b] = ``format.exact_count(L + T)`` (min(L + T, R); (L + T - 1) % R + 1 under BLOCK_WINDOW) and
  comp[b] = L + T - rec[b] — unless a ``guard`` (the store fault record of the compress-on-write launch before it,
  ``validate.FAULT_NONE`` when the tokens passed the checks) holds a fault: then nothing is committed and the record
  is closed (guard[1] = 1), so a refused append leaves the cache as it was.
Everything reads and writes device memory only, so it can be captured in a CUDA graph. ``paged.append_rows_reference``
is the same in PyTorch, with the same signature (CPU, or CUDA under ``JETSON_TQ_BACKEND=reference``): both take the
cache's ``paged.AppendState`` and one ``paged.AppendStep``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..paged import AppendState, AppendStep
from ..validate import FAULT_NONE
from ._common import INTERPRET, next_pow2
from ._launch import FastLauncher

FAULT_NONE_C = tl.constexpr(FAULT_NONE)


@triton.jit
def _append_kernel(
    # ---- pointers
    k_ptr,  # [nb, H, T, D]: new keys
    v_ptr,  # [nb, H, T, D]: new values
    rk_ptr,  # [B, H, R, D]: the exact ring of keys
    rv_ptr,  # [B, H, R, D]: ... of values
    lens_ptr,  # int32 [B]: tokens per sequence
    comp_ptr,  # int32 [B]: compressed tokens read per sequence
    rec_ptr,  # int32 [B]: exact tokens read per sequence
    slots_ptr,  # int64 [nb * T]: page slots of the new tokens (STAGE)
    overflow_ptr,  # bool: set when a token lies past the capacity (STAGE)
    guard_ptr,  # int64 [2]: store fault record that must be empty for the commit (GUARD)
    # ---- sizes
    row0,  # first appended row
    T,  # new tokens per row
    capacity,  # tokens a sequence holds
    ring,  # R
    # ---- strides (elements), one tuple each (Triton flattens them in order): row, head, token
    k_strides,
    v_strides,
    rk_strides,
    rv_strides,
    # ---- compile time
    H: tl.constexpr,  # KV heads
    D: tl.constexpr,  # head dim
    DP: tl.constexpr,  # head dim padded to a power of two
    STAGE: tl.constexpr,  # compute the slots
    COMMIT: tl.constexpr,  # copy into the ring and advance the lengths
    GUARD: tl.constexpr,  # ... only while ``guard_ptr`` holds no fault
    BLOCK_WINDOW: tl.constexpr,  # window rule: own R-token block (else the last R)
    BLOCK_T: tl.constexpr,  # tokens per step of the ring copy
    STAGE_T: tl.constexpr,  # tokens per step of the slots (up to 1024: a 16k-token prefill row in 16 steps)
):
    i = tl.program_id(0)
    b = row0 + i
    length = tl.load(lens_ptr + b)
    if STAGE:
        for t0 in range(0, T, STAGE_T):
            t = t0 + tl.arange(0, STAGE_T)
            m = t < T
            pos = (length + t).to(tl.int64)
            inside = pos < capacity
            tl.store(slots_ptr + i.to(tl.int64) * T + t, tl.where(inside, b.to(tl.int64) * capacity + pos, -1), mask=m)
            over = tl.max(tl.where(m & (pos >= capacity), 1, 0), 0)
            if over > 0:
                tl.store(overflow_ptr, 1)
    if COMMIT:
        go = True
        if GUARD:  # commit only over an empty fault record; a refused append closes it (later writes leave it alone)
            go = tl.load(guard_ptr) == FAULT_NONE_C
            tl.store(guard_ptr + 1, 1, mask=go == 0)
        if go:  # row b: the last min(T, R) new tokens of appended row i into the ring, then its lengths
            if ring > 0:
                skb, skh, skt = k_strides
                svb, svh, svt = v_strides
                srkb, srkh, srkt = rk_strides
                srvb, srvh, srvt = rv_strides
                r = tl.minimum(T, ring)
                d = tl.arange(0, DP)
                for h in range(H):
                    for t0 in range(T - r, T, BLOCK_T):
                        t = t0 + tl.arange(0, BLOCK_T)
                        m = (t < T)[:, None] & (d < D)[None, :]
                        col = ((length + t) % ring).to(tl.int64)
                        kk = tl.load(
                            k_ptr + i.to(tl.int64) * skb + h * skh + t[:, None].to(tl.int64) * skt + d[None, :], mask=m
                        )
                        vv = tl.load(
                            v_ptr + i.to(tl.int64) * svb + h * svh + t[:, None].to(tl.int64) * svt + d[None, :], mask=m
                        )
                        tl.store(
                            rk_ptr + b.to(tl.int64) * srkb + h * srkh + col[:, None] * srkt + d[None, :],
                            kk.to(rk_ptr.dtype.element_ty),
                            mask=m,
                        )
                        tl.store(
                            rv_ptr + b.to(tl.int64) * srvb + h * srvh + col[:, None] * srvt + d[None, :],
                            vv.to(rv_ptr.dtype.element_ty),
                            mask=m,
                        )
            new = length + T
            if BLOCK_WINDOW:  # the own block: (new - 1) % ring + 1 tokens (ring >= 1 in this mode; new >= 1 here)
                rec = (new - 1) % ring + 1
            else:
                rec = tl.minimum(new, ring)
            tl.store(lens_ptr + b, new)
            tl.store(rec_ptr + b, rec)
            tl.store(comp_ptr + b, new - rec)


_LAUNCH = FastLauncher(_append_kernel)


def append_rows(k: torch.Tensor, v: torch.Tensor, state: AppendState, step: AppendStep) -> torch.Tensor | None:
    """Bookkeeping of appending k, v [nb, H, T, D] to rows [row0, row0 + nb) of ``state`` (``paged.AppendStep``
    says which rows and what): returns the slots [nb * T] (stage), written into ``step.out`` when given; with a
    ``step.guard`` the commit runs only while that store fault record (int64 [2]) holds no fault, else closes it."""
    nb, h, t, d = k.shape
    if not step.stage:
        slots = state.lens  # never written (STAGE off): no allocation
    elif step.out is not None:
        slots = step.out
    else:
        slots = torch.empty(nb * t, dtype=torch.int64, device=k.device)
    ring = state.ring_k.shape[2]
    rk, rv = (state.ring_k, state.ring_v) if state.ring_k.numel() else (k, v)  # no ring storage: never written
    block_t = min(64, max(16, next_pow2(min(t, 64))))
    stage_t = min(1024, max(16, next_pow2(t)))
    guard = step.guard
    args = (
        *(k, v, rk, rv, state.lens, state.comp, state.rec, slots, state.overflow, slots if guard is None else guard),
        *(step.row0, t, step.capacity, ring),
        *(k.stride()[:3], v.stride()[:3], rk.stride()[:3], rv.stride()[:3]),
    )
    block_window = bool(state.block_window and ring > 0)
    gated = guard is not None and step.commit
    stage, commit = step.stage, step.commit
    kw = dict(
        H=h,
        D=d,
        DP=max(16, next_pow2(d)),
        STAGE=stage,
        COMMIT=commit,
        GUARD=gated,
        BLOCK_WINDOW=block_window,
        BLOCK_T=block_t,
        STAGE_T=stage_t,
    )
    _LAUNCH(
        (nb,), args, kw, (h, d, stage, commit, gated, block_window, block_t, stage_t), num_warps=1 if INTERPRET else 4
    )
    return slots if stage else None
