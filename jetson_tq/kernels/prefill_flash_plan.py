"""The host plan of ``prefill_flash``: every index a step of ragged prefill rows needs, built once with numpy and sent
to the device in one pinned copy, so every layer of the step only launches.

A step holds n sequences; sequence b has ``history[b]`` tokens before its chunk and the query rows
[query_start_loc[b], query_start_loc[b + 1]) of the step's concatenated rows (vLLM's layout). Its chunk is cut into
one sub-sequence per R-token block it touches (``format.exact_start``: a row in block j reads [0, j R) compressed and
[j R, p] exactly), which gives

- part B (exact, causal): per sub-sequence its chunk rows against the ring's part of its block (first block only) and
  its chunk rows up to its own (``cu_q``, ``cu_k``); the keys are packed per sequence as [ring tokens, chunk rows]
  (``key_rows``, ``ring_dst`` / ``ring_seq`` / ``ring_col`` say where each goes);
- part A (compressed, non-causal), per workspace segment [s0, s0 + seg) of the dequantized history: the sub-sequences
  whose block starts after s0, their rows, how many workspace tokens each reads and its page table;
- when the history fits one segment (the usual step), ``OneCall``: both parts as one causal call, each sub-sequence's
  page table its sequence's dequantized blocks before its own, then one workspace page holding its own block's exact
  tokens (where each chunk row and ring token goes).

The plan depends only on (history, chunk lengths) and the layer group's shapes (R, KV heads, head width), so one plan
serves every layer of a step (the vLLM backend caches it in the step's metadata). Before, ``flash_prefill`` built
these lists in Python per layer and per request (~1-2 ms per layer at 8k-token chunks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import triton

from ..attention.ragged import index_span, ragged_arange
from ..errors import ShapeError
from .prefill_plan import DEQUANT_TOKENS, WORKSPACE_BYTES, workspace_segment


@dataclass(frozen=True)
class FlashSegment:
    """Part A over one workspace segment: the sub-sequences that read compressed tokens at or after ``s0``."""

    s0: int  # first history token of the segment
    max_q: int  # the longest sub-sequence's rows
    max_k: int  # the most workspace tokens a sub-sequence reads
    cu_q: torch.Tensor = field(repr=False)  # int32 [subs + 1]: offsets into ``rows``
    used: torch.Tensor = field(repr=False)  # int32 [subs]: workspace tokens each reads
    row_span: tuple[int, int] | None  # ``rows`` as one slice [a, b) of the step's rows, when they are one
    rows: torch.Tensor = field(repr=False)  # int32 [rows]: the step's query rows, sub-sequence by sub-sequence
    table: torch.Tensor = field(repr=False)  # int32 [subs, seg // R]: its sequence's workspace pages


@dataclass(frozen=True)
class OneCall:
    """Every row in one causal varlen call, for a history that fits one workspace segment: sub-sequence s (the rows
    of one R-token block b) reads its sequence's workspace pages [0, b) (the dequantized positions [0, b R)), then
    page ``base + s``, which holds its block's exact tokens (the ring's part of the block, then its chunk rows), so a
    causal mask from the bottom right gives a row at position p exactly [0, b R) compressed and [b R, p] exact: no
    second call, no merge."""

    pages: int  # workspace pages: the sequences' dequantized ones (``base``), then one exact page per sub-sequence
    base: int  # the first exact page (sequences x seg / R)
    max_k: int  # the most keys a sub-sequence reads (its last row's position + 1)
    used: torch.Tensor = field(repr=False)  # int32 [subs]: keys each sub-sequence reads
    table: torch.Tensor = field(repr=False)  # int32 [subs, width]: its pages (unused entries 0)
    row_dst: torch.Tensor = field(repr=False)  # int64 [rows]: each chunk row's workspace token
    ring_dst: torch.Tensor = field(repr=False)  # int64 [ring tokens]: each ring token's workspace token


@dataclass(frozen=True)
class FlashPlan:
    """Everything ``prefill_flash.flash_prefill_rows`` needs besides the tensors (printable; device parts out of
    ``repr``)."""

    sequences: int  # n
    rows: int  # query rows of the step (the sum of the chunk lengths)
    ring: int  # R: block and page size
    seg: int  # workspace tokens per sequence and segment (a multiple of R and of ``DEQUANT_TOKENS``)
    max_q: int  # part B: the longest sub-sequence's rows
    max_k: int  # part B: the longest sub-sequence's keys
    exact_keys: int  # part B: packed keys (ring tokens + chunk rows)
    keys_are_rows: bool  # part B's packed keys are the chunk rows themselves, in order (no ring tokens)
    segments: tuple[FlashSegment, ...]
    one_call: OneCall | None  # both parts in one call (one segment), else part B, then A per segment and a merge
    cu_q: torch.Tensor = field(repr=False)  # int32 [subs + 1]: part B's query offsets
    cu_k: torch.Tensor = field(repr=False)  # int32 [subs + 1]: part B's key offsets
    key_rows: torch.Tensor = field(repr=False)  # int64 [rows]: each chunk row's place among the packed keys
    ring_dst: torch.Tensor = field(repr=False)  # int64 [ring tokens]: each ring token's place among the packed keys
    ring_seq: torch.Tensor = field(repr=False)  # int64 [ring tokens]: its sequence
    ring_col: torch.Tensor = field(repr=False)  # int64 [ring tokens]: its ring column
    last: torch.Tensor = field(repr=False)  # int32 [n]: each sequence's last row position (the dequantizer's bound)
    zeros: torch.Tensor = field(repr=False)  # int32 [n]


def plan_flash_rows(
    history: Sequence[int] | np.ndarray,
    query_start_loc: Sequence[int] | np.ndarray,
    ring: int,
    num_kv_heads: int,
    head_width: int,
    device: torch.device,
    workspace_tokens: int | None = None,
    budget: int = WORKSPACE_BYTES,
) -> FlashPlan:
    """The plan of a step of ``len(history)`` sequences with chunks [query_start_loc[b], query_start_loc[b + 1]) (at
    least one row each) after ``history[b]`` tokens, for a layer of ``num_kv_heads`` KV heads whose workspace rows
    are ``head_width`` (DP) wide and whose ring (block) is ``ring`` tokens. ``workspace_tokens``: the segment length
    (default: all history tokens if ``budget`` bytes of fp16 keys and values hold them)."""
    hist = np.asarray(history, dtype=np.int64).reshape(-1)
    qsl = np.asarray(query_start_loc, dtype=np.int64).reshape(-1)
    n = hist.size
    t = np.diff(qsl)
    if qsl.size != n + 1 or (n and (t.min() < 1 or hist.min() < 0)) or ring < 1:
        raise ShapeError(
            f"plan_flash_rows: expected {n} histories >= 0, {n + 1} increasing row offsets and R >= 1; got "
            f"history={hist.tolist()}, query_start_loc={qsl.tolist()}, R={ring}"
        )
    qs = qsl[:-1] - qsl[0]
    first, last_blk = hist // ring, (hist + t - 1) // ring
    nb = last_blk - first + 1
    sub_seq = np.repeat(np.arange(n, dtype=np.int64), nb)  # each sub-sequence's sequence
    k_in = np.arange(int(nb.sum()), dtype=np.int64) - np.repeat(np.cumsum(nb) - nb, nb)
    start = (first[sub_seq] + k_in) * ring  # its block's first position
    h_s = hist[sub_seq]
    r0 = np.maximum(h_s, start) - h_s  # its chunk rows [r0, r1)
    r1 = np.minimum(h_s + t[sub_seq], start + ring) - h_s
    ring_r = hist % ring  # ring tokens of each sequence's first block: positions [s - r, s) at columns [0, r)

    # ---- part B: exact keys packed per sequence as [its r ring tokens, its chunk rows]
    cu_q = np.concatenate([[0], qs[sub_seq] + r1])
    klen = (r1 - r0) + np.where(k_in == 0, ring_r[sub_seq], 0)
    cu_k = np.concatenate([[0], np.cumsum(klen)])
    cum_r = np.cumsum(ring_r)
    key_rows = np.arange(int(t.sum()), dtype=np.int64) + np.repeat(cum_r, t)
    ring_seq = np.repeat(np.arange(n, dtype=np.int64), ring_r)
    ring_col = ragged_arange(np.zeros(n, dtype=np.int64), ring_r)
    ring_dst = ragged_arange(qs + cum_r - ring_r, ring_r)

    # ---- part A: per workspace segment, the sub-sequences whose block starts after it does
    top = int(start.max(initial=0))  # every compressed key any row reads lies below the last block start
    step = ring * DEQUANT_TOKENS // math.gcd(ring, DEQUANT_TOKENS)
    seg = workspace_tokens or workspace_segment(n, num_kv_heads, 4 * head_width, max(top, 1), step, budget)
    seg = triton.cdiv(seg, step) * step
    host: list[np.ndarray] = [cu_q, cu_k, hist + t - 1]
    seg_host = []
    for s0 in range(0, top, seg):
        sel = start > s0
        lens = (r1 - r0)[sel]
        used = np.minimum(start[sel], s0 + seg) - s0
        rows = ragged_arange(qs[sub_seq[sel]] + r0[sel], lens)
        seg_host.append((s0, int(lens.max()), int(used.max()), index_span(rows), len(host)))
        host += [np.concatenate([[0], np.cumsum(lens)]), used, sub_seq[sel], rows]
    one_at, one_base = len(host), 0
    if len(seg_host) == 1:
        one_base, *one_host = _one_call_host(
            hist, t, ring, seg, first, nb, sub_seq, start, h_s + r1, ring_seq, ring_col
        )
        host += one_host
    parts = _to_device(host + [key_rows, ring_dst, ring_seq, ring_col], device)
    pages = torch.arange(seg // ring, dtype=torch.int32, device=device)
    segments = tuple(  # every sub-sequence reads its own sequence's pages of the workspace
        FlashSegment(
            s0, mq, mk, parts[at], parts[at + 1], span, parts[at + 3], parts[at + 2][:, None] * len(pages) + pages
        )
        for s0, mq, mk, span, at in seg_host
    )
    key_rows_d, ring_dst_d, ring_seq_d, ring_col_d = (x.long() for x in parts[-4:])
    one_call = None
    if len(seg_host) == 1:
        used_d, table_d, row_dst_d, ring_ws_d = parts[one_at : one_at + 4]
        one_call = OneCall(
            pages=one_base + int(sub_seq.size),
            base=one_base,
            max_k=int(one_host[0].max()),
            used=used_d,
            table=table_d.view(int(sub_seq.size), -1),
            row_dst=row_dst_d.long(),
            ring_dst=ring_ws_d.long(),
        )
    return FlashPlan(
        sequences=n,
        rows=int(t.sum()),
        ring=ring,
        seg=seg,
        max_q=int((r1 - r0).max(initial=0)),
        max_k=int(klen.max(initial=0)),
        exact_keys=int(cu_k[-1]),
        keys_are_rows=not ring_r.any(),
        segments=segments,
        one_call=one_call,
        cu_q=parts[0],
        cu_k=parts[1],
        key_rows=key_rows_d,
        ring_dst=ring_dst_d,
        ring_seq=ring_seq_d,
        ring_col=ring_col_d,
        last=parts[2],
        zeros=torch.zeros(n, dtype=torch.int32, device=device),
    )


def _one_call_host(
    hist: np.ndarray,
    t: np.ndarray,
    ring: int,
    seg: int,
    first: np.ndarray,
    nb: np.ndarray,
    sub_seq: np.ndarray,
    start: np.ndarray,
    used: np.ndarray,
    ring_seq: np.ndarray,
    ring_col: np.ndarray,
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``OneCall``'s host arrays (first exact page, used, table [subs, width], row_dst, ring_dst) for sequences whose
    dequantized history is one segment of ``seg`` tokens each (sequence j's page i is workspace page j seg / R + i):
    sub-sequence s (block ``start[s] / R`` of sequence ``sub_seq[s]``) reads those pages below its block, then its
    exact page ``base + s``; a token at position p of that block sits at offset p % R of it."""
    per_seq = seg // ring
    base = hist.size * per_seq
    subs = sub_seq.size
    blk = start // ring  # dequantized pages each sub-sequence reads
    cols = np.arange(int(blk.max(initial=0)) + 1)
    table = sub_seq[:, None] * per_seq + cols
    table[cols > blk[:, None]] = 0
    table[np.arange(subs), blk] = base + np.arange(subs)
    # a token at position p of sequence j sits at (base + first_sub[j] + p // R - first[j]) R + p % R, i.e. at
    # p + (base + first_sub[j] - first[j]) R: each sequence's rows are one run of consecutive workspace tokens
    shift = (base + np.cumsum(nb) - nb - first) * ring
    row_dst = ragged_arange(hist + shift, t)
    ring_dst = ring_col + (hist - hist % ring + shift)[ring_seq]  # the ring's tokens open their first block
    return base, used, table.reshape(-1), row_dst, ring_dst


def _to_device(host: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int32 device copies of ``host`` in one pinned, non-blocking copy (a pageable copy makes the host wait for the
    GPU's queue); every part starts 16-byte aligned (Triton specializes the merge on its pointers' alignment)."""
    sizes = [x.size for x in host]
    starts = np.cumsum([0] + [s + (-s % 4) for s in sizes])
    packed = np.zeros(int(starts[-1]), dtype=np.int32)
    for x, at in zip(host, starts):
        packed[at : at + x.size] = x
    flat = torch.from_numpy(packed)
    flat = flat.pin_memory() if device.type == "cuda" else flat
    dev = flat.to(device, non_blocking=True)
    return [dev[at : at + s] for at, s in zip(starts.tolist(), sizes)]
