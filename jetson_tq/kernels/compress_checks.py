"""Compress-on-write, the store checks on the device (``validate.check_kv_storable``'s rules): the fault code's
constants and the helpers that find and record a launch's first store fault (``_record_fault``)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..validate import (
    FAULT_CLASS_BOUND,
    FAULT_COORD_SHIFT,
    FAULT_HEAD_SHIFT,
    FAULT_NONE,
    FAULT_RANK_SHIFT,
    FAULT_SLOT_SHIFT,
    RANK_GROUP_MIN,
    RANK_GROUP_SCALE,
    RANK_K_ABS,
    RANK_K_FINITE,
    RANK_KEY_NORM,
    RANK_V_ABS,
    RANK_V_FINITE,
    RANK_VALUE_NORM,
)
from ._tiles import K_MSE, K_PROD

# the store fault code (``validate``): constants a @triton.jit function may read
F_NONE = tl.constexpr(FAULT_NONE)
F_BOUND = tl.constexpr(FAULT_CLASS_BOUND)
F_RANK = tl.constexpr(FAULT_RANK_SHIFT)
F_SLOT = tl.constexpr(FAULT_SLOT_SHIFT)
F_HEAD = tl.constexpr(FAULT_HEAD_SHIFT)
F_COORD = tl.constexpr(FAULT_COORD_SHIFT)
NO_COORD = tl.constexpr(1 << 20)  # a coordinate past any head dim: "none" in per-token minimums
CHECK_COLS = tl.constexpr(16)  # columns per step of the fault code's second look at the tiles
R_K_FINITE = tl.constexpr(RANK_K_FINITE)
R_V_FINITE = tl.constexpr(RANK_V_FINITE)
R_K_ABS = tl.constexpr(RANK_K_ABS)
R_V_ABS = tl.constexpr(RANK_V_ABS)
R_KEY_NORM = tl.constexpr(RANK_KEY_NORM)
R_VALUE_NORM = tl.constexpr(RANK_VALUE_NORM)
R_GROUP_MIN = tl.constexpr(RANK_GROUP_MIN)
R_GROUP_SCALE = tl.constexpr(RANK_GROUP_SCALE)


@triton.jit
def _over(x, mask, BOUND: tl.constexpr):
    """Per token [T] of the tile x [T, DP]: some element fails |x| <= BOUND (compared in fp32; NaN fails)."""
    return tl.max(tl.where(mask & ~(tl.abs(x.to(tl.float32)) <= BOUND), 1, 0), 1) != 0


@triton.jit
def _record_fault(ksrc, vsrc, fault_ptr, nrm, gbad, slot, valid, h, PAGE: tl.constexpr, CFG: tl.constexpr):
    """The store checks of ``validate.check_kv_storable`` for this program's tokens, as the smallest fault code: per
    token the first failing check (lowest rank) and, for non-finite elements, the first such coordinate; the
    launch's smallest is kept with an atomic min, unless an earlier refused write already closed the record. Works
    per token ([T] vectors) beside one reloaded tile at a time, so the rare path needs few registers. ``ksrc``,
    ``vsrc``: the keys' and values' (pointer, token offsets [T, 1], head stride); the rows of KV head ``h`` are formed
    here, in the rare path."""
    k_ptr, koff, stride_kh = ksrc
    v_ptr, voff, stride_vh = vsrc
    base = (slot << F_SLOT) | (h.to(tl.int64) << F_HEAD) | F_BOUND  # [T]: slot and head bits, class "bound"
    # each failing check lowers the token's code (the rank is its top bits: the smallest code is the first check)
    code = tl.where((gbad & 2) != 0, (R_GROUP_SCALE << F_RANK) | base, F_NONE)
    code = tl.where((gbad & 1) != 0, (R_GROUP_MIN << F_RANK) | base, code)
    code = tl.where((gbad & 4) != 0, (R_VALUE_NORM << F_RANK) | base, code)
    if PAGE.KEY_MODE == K_MSE or PAGE.KEY_MODE == K_PROD:
        code = tl.where(~(nrm <= CFG.KEY_NORM), (R_KEY_NORM << F_RANK) | base, code)
    for c in tl.static_range(PAGE.DP // CHECK_COLS):  # column blocks of the reloaded tiles: few live registers
        col = c * CHECK_COLS + tl.arange(0, CHECK_COLS)
        cmask = valid[:, None] & (col[None, :] < PAGE.D)
        vt = tl.load(v_ptr + voff + h * stride_vh + col[None, :], mask=cmask, other=0.0)
        code = tl.where(_over(vt, cmask, CFG.V_ABS), tl.minimum(code, (R_V_ABS << F_RANK) | base), code)
        code = _first_nonfinite(vt, cmask, col, base ^ F_BOUND, R_V_FINITE, code)
        kt = tl.load(k_ptr + koff + h * stride_kh + col[None, :], mask=cmask, other=0.0)
        code = tl.where(_over(kt, cmask, CFG.K_ABS), tl.minimum(code, (R_K_ABS << F_RANK) | base), code)
        code = _first_nonfinite(kt, cmask, col, base ^ F_BOUND, R_K_FINITE, code)
    code = tl.min(tl.where(valid, code, F_NONE), 0)
    if tl.load(fault_ptr + 1) == 0:
        tl.atomic_min(fault_ptr, code)


@triton.jit
def _first_nonfinite(x, mask, d, base, RANK: tl.constexpr, code):
    """``code`` [T], lowered for each token that holds a non-finite element of x [T, DP] to that fault: its first
    such coordinate and its class (0 NaN, 1 +inf, 2 -inf). x - x == 0 holds exactly for finite x (compared in fp32,
    exact for every input dtype: Triton's interpreter keeps bf16 as raw bits, whose difference is 0 for inf too)."""
    x = x.to(tl.float32)
    first = tl.min(tl.where(mask & ~((x - x) == 0), d[None, :], NO_COORD), 1)  # [T] int32
    xv = tl.sum(tl.where(d[None, :] == first[:, None], x, 0.0), 1)  # that element (NaN/inf kept)
    cls = tl.where(xv != xv, 0, tl.where(xv > 0, 1, 2)).to(tl.int64)
    found = (RANK << F_RANK) | base | (first.to(tl.int64) << F_COORD) | cls
    return tl.where(first < NO_COORD, tl.minimum(code, found), code)


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
