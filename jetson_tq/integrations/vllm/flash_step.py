"""The per-step indices of the batched FlashAttention prefill (``attend.ReadPath._prefill_flash_rows``): which of the
step's tokens its rows hold, each row's history split (compressed, ring), and where each chunk's last tokens go in
its ring, built once per step on the host (one pinned copy, ``metadata.device_ints``) and kept in the step's
metadata so every layer only looks them up.

Apart from ``attend`` because it is host arithmetic over the step (numpy over every token of the rows: tens of
thousands at 8k-token chunks), which no layer should repeat.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ...attention.ragged import index_span, ragged_arange
from .metadata import TurboQuantMetadata, device_ints


@dataclass(frozen=True)
class FlashStep:
    """The rows ``sel`` of a step that go to FlashAttention together, and the indices every layer reads."""

    sel: np.ndarray  # the rows (request indices of the step)
    history: np.ndarray  # host int64 [rows]: tokens before each chunk
    query_start_loc: np.ndarray  # host int64 [rows + 1]: the chunks' offsets among the rows' tokens
    span: tuple[int, int] | None  # the rows' tokens as one slice [a, b) of the step's, when they are one
    tokens: torch.Tensor = field(repr=False)  # int64 [tokens]: the rows' tokens among the step's (``span`` None)
    requests: torch.Tensor = field(repr=False)  # int64 [rows]: block-table rows
    compressed: torch.Tensor = field(repr=False)  # int32 [rows]: history tokens read compressed
    recent: torch.Tensor = field(repr=False)  # int32 [rows]: history tokens read from the ring
    ring_rows: torch.Tensor = field(repr=False)  # int64 [rows]
    write_tokens: torch.Tensor = field(repr=False)  # int64 [writes]: each chunk's last min(T, R) tokens
    write_rows: torch.Tensor = field(repr=False)  # int64 [writes]: their ring rows
    write_cols: torch.Tensor = field(repr=False)  # int64 [writes]: their ring columns, position % R


def flash_step(md: TurboQuantMetadata, sel: np.ndarray, device: torch.device) -> FlashStep:
    """The step's ``FlashStep`` for rows ``sel`` (at least one token each), built by the first layer that asks."""
    key = "flash-step:" + sel.tobytes().hex()  # the rows: every layer of the step selects the same ones
    got = md.plans.get(key)
    if got is not None:
        return got
    R, qsl = md.recent_tokens, md.query_start_loc
    s, t, ring_rows = md.context_lens[sel], np.diff(qsl)[sel], md.ring_rows[sel]
    ring = s % R if (md.block_window and R > 0) else np.minimum(s, R)  # history tokens read from the ring
    tok = ragged_arange(qsl[sel], t)
    n_w = np.minimum(t, R)  # ring writes: each chunk's last min(T, R) tokens
    parts = device_ints(
        md,
        key,
        device,
        (tok, torch.int64),
        (sel, torch.int64),
        (s - ring, torch.int32),
        (ring, torch.int32),
        (ring_rows, torch.int64),
        (ragged_arange(qsl[sel] + t - n_w, n_w), torch.int64),
        (np.repeat(ring_rows, n_w), torch.int64),
        (ragged_arange(s + t - n_w, n_w) % max(R, 1), torch.int64),
    )
    got = md.plans[key] = FlashStep(sel, s, np.concatenate([[0], np.cumsum(t)]), index_span(tok), *parts)
    return got
