"""Triton helpers for a layer's masking and softmax extras (``attention.extras``) on log2-domain scores.

The kernels score s2 = scale * log2(e) * <q, k>; the extras map onto that domain without leaving it:
- soft cap c: c * tanh(s / c) on the scaled score s is ``cap2 * tanh(s2 / cap2)`` with cap2 = c * log2(e);
- sink logit z (scaled-score domain): z * log2(e) joins the final softmax denominator;
- sliding window W: a query at p reads positions >= p - W + 1.
Every helper is a no-op behind its constexpr flag, so a layer without extras compiles the plain kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention.extras import AttentionExtras
from ._common import LOG2E


@triton.jit
def soft_cap(s, cap2, SOFT_CAP: tl.constexpr):
    """cap2 * tanh(s / cap2) elementwise (``s`` unchanged without SOFT_CAP); stable at any |s| (exp of -2|x|)."""
    if SOFT_CAP:
        x = s / cap2
        e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        s = cap2 * tl.where(x < 0, -t, t)
    return s


@triton.jit
def window_start(pos, window, WINDOW: tl.constexpr):
    """First position a query at ``pos`` may read (pos - W + 1; 0 without WINDOW)."""
    if WINDOW:
        return pos - window + 1
    return pos * 0


@triton.jit
def add_sink(l_i, m_i, sinks_ptr, heads, hmask, SINKS: tl.constexpr):
    """The running softmax sum ``l_i`` (relative to the running max ``m_i``, log2 domain) plus each row's sink
    term 2^(z log2 e - m) of query heads ``heads`` (rows off ``hmask`` unchanged)."""
    if SINKS:
        z = tl.load(sinks_ptr + heads, mask=hmask, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        l_i = l_i + tl.exp2(z - m_safe)
    return l_i


def extras_args(extras: AttentionExtras, fallback) -> tuple:
    """(sinks pointer (``fallback`` when none), cap2, window) runtime arguments of a kernel with extras."""
    sinks = fallback if extras.sinks is None else extras.sinks.to(torch.float32).contiguous()
    cap2 = float(extras.soft_cap) * LOG2E if extras.soft_cap is not None else 1.0
    return sinks, cap2, int(extras.sliding_window or 0)


def extras_flags(extras: AttentionExtras) -> dict:
    """The constexpr flags of ``extras`` (part of every launch key)."""
    return dict(
        SINKS=extras.sinks is not None, SOFT_CAP=extras.soft_cap is not None, WINDOW=extras.sliding_window is not None
    )
