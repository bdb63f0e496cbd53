"""A step's attention metadata (``TurboQuantMetadata``) and the host arithmetic behind it: which leading rows the
decode path serves (``decode_rows``, ``decode_arrays``) and the per-step device copies of host index arrays
(``device_ints``).

Kept apart from the builder that fills it and the impl that reads it because both, and the warm-up, build it: the
warm-up must lay out a step exactly as the builder does, or it compiles other kernel specializations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ...format import exact_count


@dataclass
class TurboQuantMetadata:
    """Per-step tensors of one layer group: host arrays for the eager path, device buffers for graphs."""

    num_actual_tokens: int
    num_reqs: int
    num_decodes: int  # leading rows with at most one new token, or ``dec_query_tokens`` each
    recent_tokens: int
    query_start_loc: np.ndarray  # host int64 [num_reqs + 1]
    seq_lens: np.ndarray  # host int64 [num_reqs], tokens after this step
    context_lens: np.ndarray  # host int64 [num_reqs], tokens before this step
    ring_rows: np.ndarray  # host int64 [num_reqs]
    block_table: torch.Tensor  # device int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor
    dec_ring_rows: torch.Tensor  # device int64 [num_decodes] (persistent buffers)
    dec_ring_cols: torch.Tensor  # device int64 [num_decodes]: position % R of the new token
    dec_compressed_lens: torch.Tensor  # device int32 [num_decodes]
    dec_recent_lens: torch.Tensor  # device int32 [num_decodes]
    dec_positions: torch.Tensor | None = None  # device int64 [>= tokens]: the decode rows' new-token positions first
    block_window: bool = False  # window: block (exact window = the query's own recent_tokens-token block)
    dec_query_tokens: int = 1  # T > 1: the decode rows are T-token verification rows (``decode_rows``)
    dec_token_cols: torch.Tensor | None = None  # device int64 [num_decodes, T]: (s + j) % R of their new tokens
    # device copies of the eager path's host index arrays, made by the step's first layer for all (``device_ints``)
    device_ints: dict = field(default_factory=dict, repr=False, compare=False)
    # host plans of the step's batched launches, built by the first layer that needs one (``ops.plan_prefill_rows``)
    plans: dict = field(default_factory=dict, repr=False, compare=False)


def device_ints(
    md: TurboQuantMetadata, key: str, device: torch.device, *arrays, per_row: bool = False
) -> list[torch.Tensor]:
    """Device copies of host int arrays (each (array, dtype)), made once per step and shared by every layer: one
    pinned, non-blocking copy (a pageable copy makes the host wait for the GPU's queue, in every layer). Every part,
    and with ``per_row`` every row (returned as [n, 16 bytes], read as ``x[j, :1]``), starts 16-byte aligned: the
    kernels are specialized on their pointers' alignment, which the warm-up must not see differ from a request's."""
    got = md.device_ints.get(key)
    if got is None:
        host, shapes = [], []
        for a, t in arrays:
            a = np.asarray(a, dtype=np.int64).reshape(-1)
            if per_row:
                w = 16 // t.itemsize
                a = np.pad(a[:, None], ((0, 0), (0, w - 1)))
            shapes.append(a.shape)
            host.append(np.pad(a.reshape(-1), (0, a.size % 2)))  # whole 16-byte units of int64
        flat = torch.from_numpy(np.concatenate(host))
        dev = (flat.pin_memory() if device.type == "cuda" else flat).to(device, non_blocking=True)
        parts = dev.split([h.size for h in host])
        got = md.device_ints[key] = [
            (x if t == torch.int64 else x.to(t))[: int(np.prod(shape))].view(shape)
            for x, shape, (_, t) in zip(parts, shapes, arrays)
        ]
    return got


def decode_rows(q_lens: np.ndarray, spec_tokens: int) -> tuple[int, int]:
    """(rows, T): the leading rows the decode path serves: those with at most one new token (T = 1), or, with
    speculative decoding (``spec_tokens`` = 1 + k, 0 without), a leading run of verification rows that all have the
    same T in [2, spec_tokens] (vLLM puts rows of up to 1 + k tokens first; a step whose leading rows differ in
    length serves them as chunks)."""
    if q_lens.size == 0:
        return 0, 1
    t = int(q_lens[0])
    if t <= 1 or t > spec_tokens:
        short = q_lens <= 1
        return int(q_lens.size if short.all() else np.argmin(short)), 1
    same = q_lens == t
    return int(q_lens.size if same.all() else np.argmin(same)), t


@dataclass(frozen=True)
class DecodeArrays:
    """Host values of a step's decode buffers (``decode_arrays``), which the builder copies to the device."""

    rows: int  # leading rows served by the decode path
    tokens: int  # T: tokens per decode row (> 1: verification rows)
    ring_rows: np.ndarray  # [rows] each row's ring row
    ring_cols: np.ndarray  # [rows] (T = 1) the new token's ring column, (L - 1) % R
    compressed: np.ndarray  # [rows] compressed tokens the decode reads (T > 1: of the history)
    recent: np.ndarray  # [rows] ring tokens it reads (T > 1: of the history, a chunk's count)
    positions: np.ndarray  # [rows * T] the new tokens' positions
    token_cols: np.ndarray  # [rows, T] (T > 1) the new tokens' ring columns, position % R


def decode_arrays(
    q_lens: np.ndarray, seq: np.ndarray, rows: np.ndarray, R: int, block_window: bool, spec_tokens: int
) -> DecodeArrays:
    """The decode rows of a step (``decode_rows``) and what their decode reads: one-token rows over L tokens
    (the ring holds the new token, ``exact_count(L)``), or verification rows of T tokens over their s = L - T token
    history (the ring gets the T tokens after attention: s % R (block) or min(s, R) of it in the ring)."""
    nd, t = decode_rows(q_lens, spec_tokens)
    L = seq[:nd].astype(np.int64)
    if t > 1:
        s = np.maximum(L - t, 0)  # (vLLM's graph-capture runs may give rows fewer tokens than their query)
        rec = s % R if (block_window and R > 0) else np.minimum(s, R)
        new_pos = s[:, None] + np.arange(t)
        return DecodeArrays(nd, t, rows[:nd], np.zeros_like(L), s - rec, rec, new_pos.reshape(-1), new_pos % max(R, 1))
    rec = exact_count(L, R, block_window)
    cols = (L - 1) % R if R > 0 else np.zeros_like(L)
    return DecodeArrays(nd, 1, rows[:nd], cols, L - rec, rec, L - 1, np.zeros((nd, 0), dtype=np.int64))
