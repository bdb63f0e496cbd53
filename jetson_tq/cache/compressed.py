"""CompressedKVCache: one layer's KV cache for a batch — every token compressed into pages on append, the
``recent_tokens`` (R) most recent also kept exact in a per-sequence ring.

A sequence of L tokens is read as compressed positions [0, L - r) plus r = ``format.exact_count(L)`` exact tokens
(min(L, R) for ``window: sliding``, (L - 1) % R + 1 for ``window: block``): the same rule as the vLLM backend
(and as a decode step there), so a token's treatment does not depend on how it arrived. Appending is device-side
only — positions, page slots and ring slots come from lengths kept on the device — so an append and the attention
after it can be captured in a CUDA graph and replayed while the cache grows inside its reserved capacity
(``reserve``). Storage:

- ``pages`` uint8 [B * blocks_per_seq, H, page_bytes] (``PagedLayout``); sequence b owns blocks
  [b * blocks_per_seq, (b + 1) * blocks_per_seq), so token p of b sits at slot b * capacity + p;
- ``ring_k`` / ``ring_v`` [B, H, R, D] in the cache dtype; token p sits in ring row p % R.
Pages grow geometrically, eagerly, outside graph capture only.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import ops
from ..codec.klt import KeyTransform
from ..codec.kv import Fields, KVCodec
from ..errors import DTypeError, JetsonTQError, ShapeError, expect_float, expect_int, expect_same_device, expect_tensor
from ..format import KVFormat, PagedLayout, exact_count
from ..paged import AppendState, AppendStep, PagedKV, allocate_pages
from ..validate import (
    FAULT_NONE,
    StoreLimits,
    check_allocatable,
    check_cache_args,
    check_kv_storable,
    free_bytes,
    human_bytes,
    store_fault_error,
)

_MIN_CAPACITY = 64
DEFAULT_BLOCK_SIZE = 16


class CaptureError(JetsonTQError, RuntimeError):
    """An operation that needs the host (growing storage, reading lengths) was called during CUDA graph capture."""


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class CompressedKVCache:
    """The hybrid KV cache of one attention layer for a batch of ``batch_size`` sequences.

    ``validate=True`` (default) rejects non-finite K/V and K/V that overflow a stored field at
    ``append``, and a non-finite query at attention (``jetson_tq.validate``); ``False`` skips those
    data checks. On the reference path (CPU) the checks run before anything is stored and raise at once. On the
    kernel path (CUDA) the compress-on-write kernel computes them itself and records the first fault on the device,
    and the append's commit (ring copy, lengths) is skipped on the device when there is one: a refused append leaves
    the cache as it was, with no host sync. Its named error is raised by the next call into the cache once the device
    has got there (``append``, ``lengths``, attention's own checks), by any read that syncs (``lengths`` after CUDA
    graph replays, ``overflowed``, growing the pages) or by ``check()``; ``stage`` (prefill) checks before returning.
    """

    def __init__(
        self,
        fmt: KVFormat,
        num_kv_heads: int,
        head_dim: int,
        batch_size: int = 1,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float16,
        seed: int | None = None,
        initial_capacity: int = _MIN_CAPACITY,
        block_size: int = DEFAULT_BLOCK_SIZE,
        validate: bool = True,
        key_transform: KeyTransform | None = None,
    ) -> None:
        device = check_cache_args(
            fmt, num_kv_heads, head_dim, batch_size, device, seed, initial_capacity, block_size, validate
        )
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise DTypeError(f"dtype: expected float16, bfloat16 or float32, got {dtype}")
        self.fmt, self.num_kv_heads, self.head_dim, self.batch_size = fmt, num_kv_heads, head_dim, batch_size
        self.device, self.dtype, self.validate = torch.device(device), dtype, validate
        self.layout = PagedLayout(fmt, head_dim, block_size)
        self.recent_tokens = fmt.recent_tokens
        ring_shape = (batch_size, num_kv_heads, self.recent_tokens, head_dim)
        blocks = -(-max(int(initial_capacity), 1) // block_size)
        ring_bytes = 2 * math.prod(ring_shape) * dtype.itemsize
        page_bytes = self._pages_bytes(blocks)
        check_allocatable(
            f"CompressedKVCache(batch_size={batch_size}, num_kv_heads={num_kv_heads}, "
            f"head_dim={head_dim}, initial_capacity={initial_capacity:,} tokens): pages "
            f"{human_bytes(page_bytes)} + recent ring {human_bytes(ring_bytes)}",
            page_bytes + ring_bytes,
            self.device,
        )
        raw_dtype = dtype if dtype != torch.float32 else torch.float16
        self.codec = KVCodec(fmt, head_dim, seed, raw_dtype=raw_dtype, key_transform=key_transform)
        self.ring_k = torch.zeros(ring_shape, dtype=dtype, device=self.device)
        self.ring_v = torch.zeros(ring_shape, dtype=dtype, device=self.device)
        sink_shape = (batch_size, num_kv_heads, fmt.sink_tokens, head_dim)
        self.sink_k = torch.zeros(sink_shape, dtype=dtype, device=self.device) if fmt.sink_tokens else None
        self.sink_v = torch.zeros(sink_shape, dtype=dtype, device=self.device) if fmt.sink_tokens else None
        i32: dict[str, Any] = dict(dtype=torch.int32, device=self.device)
        self._lens = torch.zeros(batch_size, **i32)  # tokens per sequence: the truth, on the device
        self._comp = torch.zeros(batch_size, **i32)  # L - r (derived in place after every append)
        self._rec = torch.zeros(batch_size, **i32)  # r = exact_count(L)
        self._overflow = torch.zeros((), dtype=torch.bool, device=self.device)
        self._append_state = AppendState(
            self.ring_k, self.ring_v, self._lens, self._comp, self._rec, self._overflow, fmt.block_window
        )
        # the device-side store checks: fault record (code, closed flag), bounds, and the host's view of them
        self._fault = torch.tensor([FAULT_NONE, 0], dtype=torch.int64, device=self.device)
        self._limits = StoreLimits.of(fmt, dtype, self.codec.raw_dtype)
        self._fault_pending = False  # a device-checked write was issued since the record was last seen clean
        self._fault_snapshot: tuple[torch.Tensor, torch.cuda.Event] | None = None  # pinned copy + event (CUDA)
        self._fault_blind = False  # checked writes were captured in a CUDA graph: only a sync reads their faults
        self._host_lens = torch.zeros(batch_size, dtype=torch.int64)  # mirror for eager bookkeeping
        self._host_valid = True
        self._slots_buf = torch.empty(0, dtype=torch.int64, device=self.device)  # page slots of eager appends
        self._rows = torch.arange(batch_size, **i32)
        self._plans: dict = {}  # the kernels' launch plans for this cache's views (``PagedKV.plans``)
        self.blocks_per_seq = 0
        self.pages = allocate_pages(self.layout, 0, num_kv_heads, self.device)
        self._allocate_blocks(blocks)

    # ------------------------------------------------------------------ storage
    @property
    def capacity(self) -> int:
        """Tokens each sequence can hold before the pages grow."""
        return self.blocks_per_seq * self.layout.block_size

    def _pages_bytes(self, blocks_per_seq: int) -> int:
        """Bytes of page storage for ``blocks_per_seq`` blocks per sequence."""
        return self.batch_size * blocks_per_seq * self.num_kv_heads * self.layout.page_bytes

    def _allocate_blocks(self, blocks_per_seq: int) -> None:
        if self.blocks_per_seq:  # growing (the constructor checked its own first allocation, ring included)
            check_allocatable(
                f"growing the cache to {blocks_per_seq * self.layout.block_size:,} tokens per sequence "
                f"(batch {self.batch_size}, {self.num_kv_heads} KV heads)",
                self._pages_bytes(blocks_per_seq),
                self.device,
            )
        new = allocate_pages(self.layout, self.batch_size * blocks_per_seq, self.num_kv_heads, self.device)
        if self.blocks_per_seq:
            old = self.pages.unflatten(0, (self.batch_size, self.blocks_per_seq))
            new.unflatten(0, (self.batch_size, blocks_per_seq))[:, : self.blocks_per_seq] = old
        self.pages, self.blocks_per_seq = new, blocks_per_seq
        b = torch.arange(self.batch_size, device=self.device, dtype=torch.int32).unsqueeze(1)
        j = torch.arange(blocks_per_seq, device=self.device, dtype=torch.int32).unsqueeze(0)
        table = b * blocks_per_seq + j
        self._view = PagedKV(
            self.pages,
            table,
            self._comp,
            self.ring_k,
            self.ring_v,
            self._rec,
            self._rows,
            self.layout,
            self.codec,
            self.sink_k,
            self.sink_v,
            plans=self._plans,
        )

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` tokens per sequence now (e.g. before capturing a CUDA graph of appends)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ShapeError(f"reserve: expected a token count >= 0, got {tokens!r}")
        if tokens > self.capacity:
            if _capturing(self.pages):
                raise CaptureError(
                    f"the cache must grow to {tokens} tokens per sequence (capacity {self.capacity}) "
                    "during CUDA graph capture; call cache.reserve(tokens) before capturing"
                )
            self._raise_fault(block=True)  # a recorded fault names its slot at the capacity it was written with
            need = -(-tokens // self.layout.block_size)
            grow = max(need, 2 * self.blocks_per_seq)
            free = free_bytes(self.device)
            if free is not None and self._pages_bytes(grow) > free:
                grow = need  # near the device's limit: only what was asked (else the check below names it)
            self._allocate_blocks(grow)

    @property
    def block_table(self) -> torch.Tensor:
        """int32 [B, blocks_per_seq]: sequence b owns blocks b * blocks_per_seq + j."""
        return self._view.block_table

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens held per sequence, int64 on the host (one device sync after graph replays)."""
        if not self._host_valid:
            if _capturing(self._lens):
                raise CaptureError("cache.lengths reads the device during CUDA graph capture; read it after replay")
            self._raise_fault(block=True)
            self._host_lens = self._lens.to("cpu", torch.int64)
            self._host_valid = True
        else:
            self._raise_fault(block=False)
        return self._host_lens

    def has_empty_sequence(self) -> bool:
        """True when some sequence holds no token (host mirror; one sync after graph replays)."""
        return bool(self.lengths.min() == 0)

    @property
    def compressed_lens(self) -> torch.Tensor:
        """Tokens per sequence read from their compressed form (L - ``buffer_lens``), int64 on the host."""
        return self.lengths - self.buffer_lens

    @property
    def buffer_lens(self) -> torch.Tensor:
        """Tokens per sequence read exactly from the ring (``format.exact_count``: min(L, R) or (L - 1) % R + 1),
        int64 on the host."""
        return exact_count(self.lengths, self.recent_tokens, self.fmt.block_window)

    @property
    def overflowed(self) -> bool:
        """True when a replayed append ran past the reserved capacity (those tokens were dropped; a host sync)."""
        self._raise_fault(block=True)
        return bool(self._overflow)

    def check(self) -> None:
        """Raise the named error of an append the device-side checks refused, now (one device sync; nothing to do
        on the reference path, which raises at the append itself, or with ``validate=False``)."""
        if _capturing(self._fault):
            raise CaptureError("cache.check() reads the device during CUDA graph capture; call it after replay")
        self._raise_fault(block=True)

    def _device_checks(self) -> bool:
        """True when appends are checked inside the compress-on-write kernel (``validate`` on the kernel path)."""
        return self.validate and ops.resolve(self.device, self.layout) == "triton"

    def _raise_fault(self, block: bool) -> None:
        """Raise the store fault the device recorded, if any: ``block`` reads the record now (a sync); otherwise
        only a snapshot the device has already delivered is read (no wait)."""
        if not (self._fault_pending or self._fault_blind) or _capturing(self._fault):
            return
        if block or not self._fault.is_cuda:
            code = int(self._fault[0])
        else:  # the snapshot of the last checked write, once it has arrived (graph replays leave none)
            snap = self._fault_snapshot
            if self._fault_blind or snap is None or not snap[1].query():
                return
            code = int(snap[0][0])
        if code == FAULT_NONE:
            self._fault_pending = self._fault_blind = False
            return
        err = store_fault_error(code, self.capacity, self.fmt, self.dtype, self.codec.raw_dtype)
        assert err is not None  # code != FAULT_NONE names an error
        self._fault.copy_(torch.tensor([FAULT_NONE, 0], dtype=torch.int64))  # the cache goes on from before it
        self._fault_pending = self._fault_blind = False
        self._host_lens = self._lens.to("cpu", torch.int64)  # the host had counted the refused tokens
        self._host_valid = True
        raise type(err)(
            f"{err} (checked on the device: that append, and any issued after it before this error, was not stored)"
        )

    def _checked_write_issued(self, block: bool) -> None:
        """Bookkeeping after a device-checked write: ``block`` raises its fault now; on CUDA, eagerly, a snapshot of
        the record goes to pinned host memory (no wait) for the next call to read."""
        self._fault_pending = True
        if block:
            self._raise_fault(block=True)
        elif _capturing(self._fault):
            self._fault_blind = True
        elif self._fault.is_cuda:
            if self._fault_snapshot is None:
                self._fault_snapshot = (torch.empty(2, dtype=torch.int64, pin_memory=True), torch.cuda.Event())
            host, event = self._fault_snapshot
            host.copy_(self._fault, non_blocking=True)
            event.record()

    def nbytes(self) -> int:
        """Bytes of real tensor storage this cache holds (allocated, not only used)."""
        held = (self.pages, self.ring_k, self.ring_v, *(t for t in (self.sink_k, self.sink_v) if t is not None))
        return sum(t.untyped_storage().nbytes() for t in held)

    def used_bytes(self) -> int:
        """Bytes the stored tokens occupy: every token at the format's size plus the exact ring and sink copies."""
        per_token = self.fmt.bytes_per_token(self.head_dim) * self.num_kv_heads
        exact = 2 * self.head_dim * self.ring_k.element_size() * self.num_kv_heads
        held = self.lengths.clamp(max=self.recent_tokens)  # the ring holds the last R (block mode reads fewer)
        sinks = self.lengths.clamp(max=self.fmt.sink_tokens)
        return int(self.lengths.sum()) * per_token + int(held.sum() + sinks.sum()) * exact

    # ------------------------------------------------------------------ write path
    def _check_kv(self, k: torch.Tensor, v: torch.Tensor, rank: int) -> None:
        expect_tensor("k", k)
        expect_tensor("v", v)
        expect_float("k", k)
        expect_float("v", v)
        expect_same_device(k=k, v=v, cache=self.ring_k)
        if k.shape != v.shape or k.dim() != rank or k.shape[-3] != self.num_kv_heads or k.shape[-1] != self.head_dim:
            lead = "[B, " if rank == 4 else "["
            raise ShapeError(
                f"k, v: expected {lead}{self.num_kv_heads}, T, {self.head_dim}], "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )

    def append(self, k: torch.Tensor, v: torch.Tensor, seq: int | None = None) -> None:
        """Append T tokens: k, v [B, H, T, D] for every sequence, or [H, T, D] for sequence ``seq``.

        Device-side only (capturable in a CUDA graph) when the tokens fit the reserved capacity: on CUDA one
        bookkeeping launch (slots, exact ring copy, lengths; ``kernels.append``) plus the compress-on-write launch
        (with validation: slots, the checked write, then the guarded commit).
        """
        self._put(k, v, seq, stage=True, commit=True)

    def stage(self, k: torch.Tensor, v: torch.Tensor, seq: int | None = None, *, check: bool = True) -> None:
        """Write the compressed form of the next T tokens into the pages without counting them yet.

        Prefill attention reads them there (positions older than ``fmt.exact_start(p)`` are read compressed, also
        inside the chunk); ``commit`` with the same tokens then makes them part of the cache. ``check=False`` leaves
        a device-checked fault to the next call (the guarded ``commit`` then stores nothing; ``raise_store_fault``
        names it): ``attention_prefill`` checks once after its attention launch instead of between the two.
        """
        self._put(k, v, seq, stage=True, commit=False, check_now=check)

    def commit(self, k: torch.Tensor, v: torch.Tensor, seq: int | None = None) -> None:
        """Count T staged tokens: copy the last min(T, R) into the ring and advance the lengths."""
        self._put(k, v, seq, stage=False, commit=True)

    def raise_store_fault(self, wait: bool = True) -> None:
        """Raise the named error of a device-checked write issued so far: ``wait`` reads the device's record now (one
        sync when a checked write is pending; nothing during CUDA graph capture, whose replays are read by
        ``check()``); otherwise only a record that has already reached the host (a record still in flight is read by
        the next call or ``check()``; off CUDA the record is always there)."""
        self._raise_fault(block=wait)

    def max_tokens(self, extra: int = 0) -> int | None:
        """The longest sequence's tokens plus ``extra`` from the host mirror, without a sync; None when only the
        device knows them (after CUDA graph replays)."""
        return int(self._host_lens.max()) + extra if self._host_valid else None

    def _put(
        self, k: torch.Tensor, v: torch.Tensor, seq: int | None, stage: bool, commit: bool, check_now: bool = True
    ) -> None:
        rows, k, v = self._inputs(k, v, seq)
        t = k.shape[2]
        if t == 0:
            return
        self._raise_fault(block=False)  # an earlier append the device refused
        guard = self._fault if self._device_checks() else None
        if stage:
            if guard is None:
                self._validate(k, v, rows)
            self._make_room(rows, t)
        if commit and self.sink_k is not None:
            self._keep_sinks(rows, k, v)
        self._put_rows(rows, k, v, stage, commit, guard)
        if commit:
            if _capturing(self._lens):
                self._host_valid = False
            elif self._host_valid:
                self._host_lens[rows.start : rows.stop] += t
        if guard is not None and stage:
            self._checked_write_issued(block=not commit and check_now)  # staging feeds prefill: raise now (check)

    def _keep_sinks(self, rows: range, k: torch.Tensor, v: torch.Tensor) -> None:
        """Exact copies of the tokens k, v [nb, H, T, D] that land on positions < ``fmt.sink_tokens`` (formats with a
        sink are served by the reference path: the lengths are read on the host)."""
        assert self.sink_k is not None and self.sink_v is not None  # the format has a sink
        s, t = self.sink_k.shape[2], k.shape[2]
        for i, start in enumerate(self.lengths[rows.start : rows.stop].tolist()):
            n = min(t, s - int(start))
            if n > 0:
                self.sink_k[rows.start + i, :, start : start + n] = k[i, :, :n].to(self.dtype)
                self.sink_v[rows.start + i, :, start : start + n] = v[i, :, :n].to(self.dtype)

    def _slots_out(self, n: int, device_capturing: bool) -> torch.Tensor | None:
        """A reused int64 buffer for ``n`` page slots (eager calls: no allocation per append; the calls of one stream
        use it in order); None during CUDA graph capture (the graph keeps its own from its memory pool)."""
        if device_capturing:
            return None
        if self._slots_buf.numel() < n:
            self._slots_buf = torch.empty(max(n, 2 * self._slots_buf.numel()), dtype=torch.int64, device=self.device)
        return self._slots_buf[:n]

    def _put_rows(
        self, rows: range, k: torch.Tensor, v: torch.Tensor, stage: bool, commit: bool, guard: torch.Tensor | None
    ) -> None:
        """Bookkeeping (slots / ring / lengths) of k, v [nb, H, T, D] in one launch and, when staging,
        compress-on-write in one launch that reads the input in place (a flat [nb * T, H, D] view when T == 1 or
        nb == 1, else rows [nb, T, H, D]). With a ``guard`` (device-side checks) the write records its faults there
        and the commit is its own launch after it, skipped on the device when the record holds a fault (the whole
        append or nothing): one ``append_rows`` call per step, none that does nothing."""
        nb, h, t, d = k.shape
        positions = None
        if stage and self.codec.key_coder is not None:  # before the bookkeeping launch moves the lengths
            positions = self._lens[rows.start : rows.stop].long()[:, None] + torch.arange(t, device=self.device)
        plain_commit = commit and guard is None  # the commit goes with the slots (no write to wait for)
        steps: list[tuple[bool, bool, torch.Tensor | None]] = [(True, plain_commit, None)] if stage else []
        if commit and not plain_commit or not stage:
            steps.append((False, True, guard))
        for staging, committing, gate in steps:
            out = self._slots_out(nb * t, _capturing(k)) if staging else None
            step = AppendStep(rows.start, self.capacity, staging, committing, gate, out)
            slots = ops.append_rows(k, v, self._append_state, step)
            if staging:
                assert slots is not None  # append_rows returns the slots when staging
                kt, vt = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)  # [nb, T, H, D] views
                if t == 1 or nb == 1:
                    kt, vt = kt.reshape(nb * t, h, d), vt.reshape(nb * t, h, d)  # still views
                ops.write(
                    kt,
                    vt,
                    slots,
                    self.pages,
                    self.layout,
                    self.codec,
                    fault=guard,
                    limits=self._limits if guard is not None else None,
                    positions=positions,
                )

    def _inputs(self, k: torch.Tensor, v: torch.Tensor, seq: int | None) -> tuple[range, torch.Tensor, torch.Tensor]:
        """Validated (rows, k, v) with k, v as [rows, H, T, D]."""
        if seq is None:
            self._check_kv(k, v, 4)
            if k.shape[0] != self.batch_size:
                raise ShapeError(f"k: expected batch {self.batch_size}, got {k.shape[0]}")
            return range(self.batch_size), k, v
        self._check_kv(k, v, 3)
        if not 0 <= expect_int("seq", seq) < self.batch_size:
            raise ShapeError(f"seq: expected 0 <= seq < {self.batch_size}, got {seq}")
        return range(seq, seq + 1), k.unsqueeze(0), v.unsqueeze(0)

    def _validate(self, k: torch.Tensor, v: torch.Tensor, rows: range) -> None:
        """Refuse non-finite or overflowing K/V before anything is stored (``jetson_tq.validate``; the reference path:
        one device sync on CUDA, skipped in graph capture)."""
        if self.validate and not _capturing(k):
            check_kv_storable(
                k,
                v,
                self.fmt,
                self.dtype,
                self.codec.raw_dtype,
                list(rows),
                self.lengths[rows.start : rows.stop].tolist(),
            )

    def _make_room(self, rows: range, t: int) -> None:
        """Eagerly: grow the pages for ``t`` more tokens. During capture: check the room (named error if none)."""
        if _capturing(self.pages):
            known = self._host_lens  # lengths at capture time: replays beyond capacity are flagged, not written
            need = int(known[rows.start : rows.stop].max()) + t
            if need > self.capacity:
                raise CaptureError(
                    f"append of {t} tokens during CUDA graph capture needs {need} tokens of capacity, "
                    f"the cache has {self.capacity}; call cache.reserve(tokens) before capturing"
                )
            return
        self.reserve(int(self.lengths[rows.start : rows.stop].max()) + t)

    # ------------------------------------------------------------------ read helpers
    def paged(self) -> PagedKV:
        """The persistent paged view attention reads: lengths live on the device and follow every append
        (no copy, no sync, so decode over it is graph-capturable); the ring is read as an unordered set."""
        return self._view

    def recent_in_order(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact tokens of each sequence in position order, (k, v) [B, H, max r, D] (rows past r are zero)."""
        r_max = int(self.buffer_lens.max())
        if r_max == 0 or self.recent_tokens == 0:
            empty = self.ring_k[:, :, :0]
            return empty, empty
        lens = self.lengths.to(self.device)
        r = self.buffer_lens.to(self.device)
        j = torch.arange(r_max, device=self.device)
        pos = lens.unsqueeze(1) - r.unsqueeze(1) + j  # [B, r_max] positions, in order
        valid = j.unsqueeze(0) < r.unsqueeze(1)
        cols = torch.where(valid, pos % self.recent_tokens, 0)
        idx = cols[:, None, :, None].expand(-1, self.num_kv_heads, -1, self.head_dim)
        mask = valid[:, None, :, None]
        return (self.ring_k.gather(2, idx) * mask, self.ring_v.gather(2, idx) * mask)

    def compressed_fields(self, upto: int | None = None) -> Fields:
        """Fields [B, H, upto, count] of positions [0, upto) (``upto`` defaults to the longest compressed part)."""
        return self._view.gather_compressed(int(self.compressed_lens.max()) if upto is None else upto)

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dequantized (K, V) float32 [B, H, max_len, D] in token order plus lengths [B] (tests, naive paths)."""
        comp, rec = self.compressed_lens, self.buffer_lens
        f = self.compressed_fields(int(comp.max()))
        total = int(self.lengths.max())
        k = torch.zeros(self.batch_size, self.num_kv_heads, total, self.head_dim, device=self.device)
        v = torch.zeros_like(k)
        positions = torch.arange(int(comp.max()), device=self.device)
        kc = self.codec.decode_keys(f, positions, head_axis=1)
        vc = self.codec.decode_values(f, positions, head_axis=1)
        rk, rv = self.recent_in_order()
        for b in range(self.batch_size):
            c, r = int(comp[b]), int(rec[b])
            k[b, :, :c], v[b, :, :c] = kc[b, :, :c], vc[b, :, :c]
            k[b, :, c : c + r], v[b, :, c : c + r] = rk[b, :, :r].float(), rv[b, :, :r].float()
        return k, v, self.lengths.clone()
