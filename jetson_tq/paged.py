"""Paged storage of compressed tokens (the layout vLLM's block tables address) and the view kernels read.

Pages are uint8 [num_blocks, num_kv_heads, page_bytes]; inside one (block, KV head) page every field
of ``PagedLayout`` has its own contiguous region of block_size * field.nbytes bytes (structure of
arrays). A token's slot is ``block_id * block_size + offset`` exactly as in vLLM's ``slot_mapping``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .codec.kv import Fields, KVCodec
from .errors import ShapeError
from .format import PagedLayout, exact_count
from .validate import FAULT_NONE


def allocate_pages(layout: PagedLayout, num_blocks: int, num_kv_heads: int, device="cpu") -> torch.Tensor:
    """Zeroed page storage for ``num_blocks`` blocks."""
    return torch.zeros(num_blocks, num_kv_heads, layout.page_bytes, dtype=torch.uint8, device=device)


def _field_region(pages: torch.Tensor, layout: PagedLayout, offset: int, nbytes: int) -> torch.Tensor:
    """View [num_blocks, H, block_size, nbytes] of one field's region in every page."""
    bs = layout.block_size
    return pages[:, :, offset : offset + bs * nbytes].unflatten(-1, (bs, nbytes))


def write_slots(pages: torch.Tensor, layout: PagedLayout, slots: torch.Tensor, fields: Fields) -> None:
    """Store encoded tokens: ``fields[name]`` [N, H, count] goes to ``slots`` [N] (slot < 0 = skip, as vLLM pads)."""
    keep = slots >= 0
    if not bool(keep.all()):
        slots = slots[keep]
        fields = {name: t[keep] for name, t in fields.items()}
    blocks, offs = slots // layout.block_size, slots % layout.block_size
    offsets = layout.offsets()
    for f in layout.fmt.fields(layout.head_dim):
        t = fields[f.name]
        if t.shape[0] != slots.shape[0] or t.shape[-1] != f.count:
            raise ShapeError(f"{f.name}: expected [{slots.shape[0]}, H, {f.count}], got {tuple(t.shape)}")
        raw = t.contiguous().view(torch.uint8)  # [N, H, nbytes]
        region = _field_region(pages, layout, offsets[f.name], f.nbytes)
        region[blocks, :, offs] = raw


def read_slots(
    pages: torch.Tensor, layout: PagedLayout, slots: torch.Tensor, raw_dtype: torch.dtype = torch.float16
) -> Fields:
    """Load encoded tokens at ``slots`` (any shape S) -> fields [*S, H, count] in their dtypes."""
    flat = slots.reshape(-1).clamp_min(0)
    blocks, offs = flat // layout.block_size, flat % layout.block_size
    offsets = layout.offsets()
    out: Fields = {}
    for f in layout.fmt.fields(layout.head_dim):
        region = _field_region(pages, layout, offsets[f.name], f.nbytes)
        raw = region[blocks, :, offs].contiguous()  # [N, H, nbytes]
        dtype = raw_dtype if f.name.endswith("_raw") else f.dtype
        out[f.name] = raw.view(dtype).reshape(*slots.shape, raw.shape[1], f.count)
    return out


def slots_for_positions(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of token ``positions`` [B, N] of each sequence through its block table row [B, max_blocks]."""
    block_idx = (positions // block_size).clamp_max(block_table.shape[1] - 1)
    return block_table.long().gather(1, block_idx) * block_size + positions % block_size


@dataclass
class PagedKV:
    """Everything a paged attention kernel reads for a batch of B sequences.

    Sequence b attends to positions [0, compressed_lens[b]) read from ``pages`` through
    ``block_table[b]``, plus ``recent_lens[b]`` uncompressed tokens in rows [0, recent_lens[b]) of
    ``recent_k/recent_v[recent_index[b]]`` (order inside the buffer does not matter to attention). With
    ``fmt.sink_tokens`` S, positions < S of the compressed part are read from ``sink_k/sink_v[b]`` instead.
    """

    pages: torch.Tensor  # uint8 [num_blocks, H, page_bytes]
    block_table: torch.Tensor  # int32 [B, max_blocks]
    compressed_lens: torch.Tensor  # int32 [B]
    recent_k: torch.Tensor  # [NR, H, R, D] fp16/bf16/fp32 (R may be 0)
    recent_v: torch.Tensor
    recent_lens: torch.Tensor  # int32 [B]
    recent_index: torch.Tensor  # int32 [B]
    layout: PagedLayout
    codec: KVCodec
    sink_k: torch.Tensor | None = None  # [B, H, S, D]: exact copies of positions < S (``fmt.sink_tokens``)
    sink_v: torch.Tensor | None = None
    # the owner's store of launch plans for this view's shapes (the decode kernel files its plans there, so they go
    # with the owner); None: the kernels' module-level store
    plans: dict | None = field(default=None, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return self.block_table.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.pages.shape[1]

    @property
    def head_dim(self) -> int:
        return self.layout.head_dim

    def sequence(self, b: int) -> PagedKV:
        """Sequence ``b`` alone (a batch of one over the same pages and rings), for paths that serve one sequence per
        call."""
        return replace(
            self,
            block_table=self.block_table[b : b + 1],
            compressed_lens=self.compressed_lens[b : b + 1],
            recent_lens=self.recent_lens[b : b + 1],
            recent_index=self.recent_index[b : b + 1],
            sink_k=None if self.sink_k is None else self.sink_k[b : b + 1],
            sink_v=None if self.sink_v is None else self.sink_v[b : b + 1],
        )

    def gather_compressed(self, upto: int | None = None) -> Fields:
        """Fields [B, H, upto, count] of positions [0, upto) of every sequence (garbage past its length)."""
        n = int(self.compressed_lens.max()) if upto is None else upto
        pos = torch.arange(n, device=self.block_table.device).expand(self.batch_size, n)
        fields = read_slots(
            self.pages,
            self.layout,
            slots_for_positions(self.block_table, pos, self.layout.block_size),
            raw_dtype=self.codec.raw_dtype,
        )
        return {name: t.transpose(1, 2) for name, t in fields.items()}  # [B, n, H, c] -> [B, H, n, c]


@dataclass(frozen=True)
class AppendState:
    """A cache's per-sequence bookkeeping that an append moves, made once by its owner (``CompressedKVCache``): the
    exact ring and the lengths, as the append kernel (``kernels.append``) and its reference read and write them."""

    ring_k: torch.Tensor  # [B, H, R, D]: the exact ring of keys (token p in row p % R)
    ring_v: torch.Tensor  # [B, H, R, D]: ... of values
    lens: torch.Tensor  # int32 [B]: tokens per sequence
    comp: torch.Tensor  # int32 [B]: tokens read compressed (lens - rec)
    rec: torch.Tensor  # int32 [B]: tokens read exactly (``format.exact_count(lens)``)
    overflow: torch.Tensor  # bool []: set when a token lies past the capacity
    block_window: bool = False  # window rule: a token's own R-token block (else the last R)


@dataclass(frozen=True)
class AppendStep:
    """One bookkeeping launch of an append of k, v [nb, H, T, D]: which rows, the slots a sequence owns, what it does.

    A cache with device-side checks stages (slots, then compress-on-write) and commits behind the write's store fault
    record (``guard``) in two steps; without checks one step does both."""

    row0: int  # first appended row: the rows are [row0, row0 + nb)
    capacity: int  # page slots per sequence: sequence b owns slots [b * capacity, (b + 1) * capacity)
    stage: bool = True  # compute the new tokens' page slots (-1 past the capacity, setting ``overflow``)
    commit: bool = True  # copy the last min(T, R) tokens into the ring and advance the lengths
    guard: torch.Tensor | None = None  # int64 [2]: commit only while this store fault record holds no fault
    out: torch.Tensor | None = None  # int64 [nb * T]: where the slots go (a buffer the caller reuses), else allocated


def append_rows_reference(
    k: torch.Tensor, v: torch.Tensor, state: AppendState, step: AppendStep
) -> torch.Tensor | None:
    """Bookkeeping of appending k, v [nb, H, T, D] to rows [row0, row0 + nb) of ``state``: returns the page slots
    [nb * T] of the new tokens (``step.stage``; -1 past the capacity, setting ``overflow``), copies the last min(T, R)
    exactly into ring rows (L + t) % R and advances lens / rec = ``format.exact_count(lens)`` (min(lens, R), or
    (lens - 1) % R + 1 with ``block_window``) / comp = lens - rec (``step.commit``; with a ``guard`` store fault record
    holding a fault, nothing is committed and the record is closed: guard[1] = 1). ``kernels.append.append_rows`` is
    the same in one launch."""
    row0, capacity, stage, commit, guard, out = step.row0, step.capacity, step.stage, step.commit, step.guard, step.out
    ring_k, ring_v, lens, comp, rec, overflow = (
        state.ring_k,
        state.ring_v,
        state.lens,
        state.comp,
        state.rec,
        state.overflow,
    )
    nb, _, t, _ = k.shape
    rows = slice(row0, row0 + nb)
    pos = lens[rows].long().unsqueeze(1) + torch.arange(t, device=k.device)  # [nb, T]
    slots = None
    if stage:
        inside = pos < capacity
        overflow |= ~inside.all()
        base = torch.arange(row0, row0 + nb, device=k.device).unsqueeze(1) * capacity
        slots = torch.where(inside, base + pos, -1).reshape(-1)
        if out is not None:
            slots = out.copy_(slots)
    if commit and guard is not None and int(guard[0]) != FAULT_NONE:
        guard[1] = 1
        commit = False
    if commit:
        ring = ring_k.shape[2]
        r = min(t, ring)
        if r:
            cols = pos[:, t - r :] % ring
            brow = torch.arange(row0, row0 + nb, device=k.device).unsqueeze(1).expand(nb, r)
            ring_k[brow, :, cols] = k[:, :, t - r :].transpose(1, 2).to(ring_k.dtype)  # [nb, r, H, D]
            ring_v[brow, :, cols] = v[:, :, t - r :].transpose(1, 2).to(ring_v.dtype)
        lens[rows] += t
        rec.copy_(exact_count(lens, ring, state.block_window))
        torch.sub(lens, rec, out=comp)
    return slots
