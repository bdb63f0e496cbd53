"""The fp16 recent-token buffers inside vLLM: a pool of ring buffers, one row per running request.

Every token is written compressed into vLLM's pages; the last ``R = recent_tokens`` tokens of each
request are also kept exactly (model dtype) in row ``r`` of a per-layer pool [rows, H, R, D], token at
position p in column p % R. Attention reads the compressed pages for positions [0, L - r) and the ring for
the last r = ``format.exact_count(L)`` (min(L, R); (L - 1) % R + 1 under ``window: block``, where the ring's
columns [0, r) hold the query's own block). Under ``window: block`` a request may start at any multiple of R
(a prefix-cache hit, or a recompute from cached blocks) with an empty ring: nothing before that boundary is
read exactly.

Speculative decoding: a verification step writes a request's last token and its draft tokens (T <= ``undo_tokens``
tokens); the ones the sampler rejects are written again, at the same positions, by the next step. Their ring
columns held older tokens still inside the exact window (a sliding window's previous R tokens; under ``window:
block`` the previous block's, when the draft crossed a block boundary), so a step of at most ``undo_tokens`` tokens
first saves the columns it overwrites in a per-row undo pool [rows, H, undo_tokens, D], and the next step puts the
rejected positions' columns back (``Rewind``) before anything reads the ring.

Rows are assigned on the host by the metadata builder (``RecentSlots``), keyed by vLLM request id;
the pool has ``max_num_seqs`` rows plus one scratch row for padded / dummy rows, and its bytes are
taken out of vLLM's KV budget (``pool_bytes``). A request whose ring cannot be vouched for (it
was evicted, or a step was skipped) raises ``RecentBufferLost`` instead of attending to stale data.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass

import numpy as np

from ...errors import JetsonTQError


class RecentBufferLost(JetsonTQError, RuntimeError):
    """A request's fp16 recent buffer no longer holds the tokens attention needs."""


def pool_bytes(rows: int, num_kv_heads: int, recent_tokens: int, head_dim: int, element_bytes: int) -> int:
    """Bytes of one layer's K and V ring pools (or undo pools, with ``recent_tokens`` their width)."""
    return 2 * rows * num_kv_heads * recent_tokens * head_dim * element_bytes


@dataclass(frozen=True)
class Rewind:
    """Ring row ``row`` wrote positions [start, end) in its last step, of which [kept, end) were rejected (draft
    tokens): their ring columns p % R get back, from undo column p - start, what they held before that step."""

    row: int
    start: int
    kept: int
    end: int

    def columns(self, recent_tokens: int) -> tuple[list[int], list[int]]:
        """(ring columns, undo columns) to copy back, in the order the step wrote them."""
        positions = range(self.kept, self.end)
        return [p % recent_tokens for p in positions], [p - self.start for p in positions]


class RecentSlots:
    """Host-side map request id -> ring row, shared by every layer's builder in one worker process."""

    def __init__(self, num_rows: int) -> None:
        if num_rows < 1:
            raise ValueError(f"num_rows: expected >= 1, got {num_rows}")
        self.num_rows = num_rows
        self.scratch = num_rows  # the pool has num_rows + 1 rows; the last one takes padding writes
        self._row: OrderedDict[str, int] = OrderedDict()  # LRU order: least recently seen first
        self._span: dict[str, tuple[int, int]] = {}  # req -> (start, end) of the last step it was seen in
        self._rewind: dict[str, Rewind] = {}  # req -> the rejected draft tokens its current step rewinds
        self._free = list(range(num_rows - 1, -1, -1))
        self.rewinds: list[Rewind] = []  # the last assign()'s rewinds (the step's, whichever builder asked)

    def _release(self, req: str) -> None:
        self._free.append(self._row.pop(req))
        self._span.pop(req, None)
        self._rewind.pop(req, None)

    def _take(self, live: Container[str], batch: set[str]) -> int:
        if not self._free:
            for req in [r for r in self._row if r not in live]:
                self._release(req)  # finished requests
        if not self._free:
            for req in list(self._row):
                if req not in batch:  # least recently seen request not in this step (preempted, most likely)
                    self._release(req)
                    break
        if not self._free:
            raise RecentBufferLost(f"all {self.num_rows} recent-buffer rows are held by requests of this step")
        return self._free.pop()

    def assign(
        self,
        req_ids: Sequence[str | None],
        context_lens: np.ndarray,
        query_lens: np.ndarray,
        live: Container[str],
        window_block: int = 0,
        undo_tokens: int = 0,
    ) -> np.ndarray:
        """Ring row of each batch row (scratch for padding); raise RecentBufferLost for an unvouched history.

        ``context_lens[i]`` tokens precede row i's ``query_lens[i]`` new tokens. ``window_block`` R > 0 (block
        windows): a step may start at any multiple of R with nothing from the ring. ``undo_tokens`` P > 0
        (speculative decoding): a step may start inside the previous one when that wrote at most P tokens (its
        rejected draft tokens are written again); ``self.rewinds`` then lists what to put back in the ring first.
        Calling twice for the same step (one call per metadata builder) returns the same rows and rewinds.
        """
        batch = {r for r in req_ids if r is not None}
        rows = np.full(len(req_ids), self.scratch, dtype=np.int64)
        self.rewinds = []
        for i, req in enumerate(req_ids):
            q, s = int(query_lens[i]), int(context_lens[i])
            if req is None or q <= 0:
                continue
            fresh = s == 0 or (window_block > 0 and s % window_block == 0)  # needs no earlier exact token
            if req not in self._row:
                if not fresh:
                    raise RecentBufferLost(
                        f"request {req!r} starts a step at position {s} but has no recent buffer "
                        "(prefix caching or an eviction skipped its earlier tokens)"
                        + (f"; block windows restart at multiples of {window_block}" if window_block else "")
                    )
                self._row[req] = self._take(live, batch)
            elif self._span.get(req) != (s, s + q):  # a new step (the same step again keeps its rewind)
                start, end = self._span.get(req, (0, 0))
                self._rewind.pop(req, None)
                if start < s < end and end - start <= undo_tokens:
                    self._rewind[req] = Rewind(self._row[req], start, s, end)
                elif not fresh and s not in (start, end):
                    raise RecentBufferLost(
                        f"request {req!r}: its recent buffer holds positions up to {end}, the step starts at {s}"
                    )
            self._row.move_to_end(req)
            self._span[req] = (s, s + q)
            rows[i] = self._row[req]
            if req in self._rewind:
                self.rewinds.append(self._rewind[req])
        return rows
