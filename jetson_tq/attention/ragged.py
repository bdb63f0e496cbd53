"""Index arithmetic of ragged (varlen) rows: a step's chunks laid one after another, as vLLM and FlashAttention's
varlen calls lay them out. Host numpy, shared by the flash prefill's plan (``kernels.prefill_flash_plan``) and the
vLLM backend's per-step indices (``integrations.vllm.flash_step``)."""

from __future__ import annotations

import numpy as np


def ragged_arange(begin: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """concat(arange(begin[i], begin[i] + lens[i])) without a Python loop (a step's rows or tokens, row by row)."""
    begin, lens = np.asarray(begin, dtype=np.int64), np.asarray(lens, dtype=np.int64)
    starts = np.cumsum(lens) - lens
    return np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(begin - starts, lens)


def index_span(idx: np.ndarray) -> tuple[int, int] | None:
    """An increasing index array as the slice [a, b) it covers, when it covers one without gaps (None otherwise or
    when empty): callers then take a view instead of a gather."""
    if idx.size == 0 or idx[-1] - idx[0] + 1 != idx.size:
        return None
    return int(idx[0]), int(idx[-1]) + 1
