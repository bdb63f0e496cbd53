"""CompressedKVCache: per (sequence, KV head) compressed tokens plus an fp16/bf16 buffer of recent tokens.

Storage is pre-allocated and grows geometrically (never per token):
- compressed history in pages (``cache.paged``), the same layout vLLM's block tables address, with
  sequence b owning blocks [b * blocks_per_seq, (b + 1) * blocks_per_seq) — so one paged kernel
  serves both this cache and vLLM;
- ``buffer_k`` / ``buffer_v``: [B, H, buffer_tokens + flush_chunk, D] in the model dtype.
When a sequence's buffer reaches ``buffer_tokens + flush_chunk`` tokens its oldest full chunks
are compressed; across the batch that is one ``KVCodec.encode`` call.
"""

from __future__ import annotations

import torch

from ..codec.kv import Fields, KVCodec
from ..errors import DTypeError, ShapeError, expect_float, expect_int, expect_same_device
from ..format import KVFormat, PagedLayout
from ..validate import check_cache_args, check_kv_storable
from .paged import PagedKV, allocate_pages, slots_for_positions

_MIN_CAPACITY = 64
DEFAULT_BLOCK_SIZE = 16


class CompressedKVCache:
    """The hybrid KV cache of one attention layer for a batch of ``batch_size`` sequences.

    ``validate=True`` (default) rejects non-finite K/V and K/V that overflow a stored field at
    ``append``, and a non-finite query at attention (``jetson_tq.validate``); ``False`` skips those
    data checks (a few reductions and, on CUDA, one device sync per call).
    """

    def __init__(self, fmt: KVFormat, num_kv_heads: int, head_dim: int, batch_size: int = 1, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float16,
                 seed: int | None = None, initial_capacity: int = _MIN_CAPACITY,
                 block_size: int = DEFAULT_BLOCK_SIZE, validate: bool = True) -> None:
        device = check_cache_args(fmt, num_kv_heads, head_dim, batch_size, device, seed, initial_capacity, block_size)
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise DTypeError(f"dtype: expected float16, bfloat16 or float32, got {dtype}")
        self.fmt, self.num_kv_heads, self.head_dim, self.batch_size = fmt, num_kv_heads, head_dim, batch_size
        self.device, self.dtype, self.validate = torch.device(device), dtype, bool(validate)
        self.codec = KVCodec(fmt, head_dim, seed, raw_dtype=dtype if dtype != torch.float32 else torch.float16)
        self.layout = PagedLayout(fmt, head_dim, block_size)
        self.blocks_per_seq = 0
        self.pages = allocate_pages(self.layout, 0, num_kv_heads, self.device)
        self._allocate_blocks(-(-max(initial_capacity, 1) // block_size))
        buf_shape = (batch_size, num_kv_heads, fmt.buffer_capacity, head_dim)
        self.buffer_k = torch.zeros(buf_shape, dtype=dtype, device=self.device)
        self.buffer_v = torch.zeros(buf_shape, dtype=dtype, device=self.device)
        self.compressed_lens = torch.zeros(batch_size, dtype=torch.int64)  # host-side bookkeeping
        self.buffer_lens = torch.zeros(batch_size, dtype=torch.int64)

    # ------------------------------------------------------------------ storage
    @property
    def capacity(self) -> int:
        """Compressed tokens each sequence can hold before the pages grow."""
        return self.blocks_per_seq * self.layout.block_size

    @property
    def block_table(self) -> torch.Tensor:
        """int32 [B, blocks_per_seq]: sequence b owns blocks b * blocks_per_seq + j."""
        b = torch.arange(self.batch_size, device=self.device, dtype=torch.int32).unsqueeze(1)
        j = torch.arange(self.blocks_per_seq, device=self.device, dtype=torch.int32).unsqueeze(0)
        return b * self.blocks_per_seq + j

    def _allocate_blocks(self, blocks_per_seq: int) -> None:
        new = allocate_pages(self.layout, self.batch_size * blocks_per_seq, self.num_kv_heads, self.device)
        if self.blocks_per_seq:
            old = self.pages.unflatten(0, (self.batch_size, self.blocks_per_seq))
            new.unflatten(0, (self.batch_size, blocks_per_seq))[:, : self.blocks_per_seq] = old
        self.pages, self.blocks_per_seq = new, blocks_per_seq

    def _reserve(self, tokens: int) -> None:
        if tokens > self.capacity:
            need = -(-tokens // self.layout.block_size)
            self._allocate_blocks(max(need, 2 * self.blocks_per_seq))

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens held per sequence (compressed + buffered), int64 on the host."""
        return self.compressed_lens + self.buffer_lens

    def nbytes(self) -> int:
        """Bytes of real tensor storage this cache holds (allocated, not only used)."""
        return sum(t.untyped_storage().nbytes() for t in (self.pages, self.buffer_k, self.buffer_v))

    def used_bytes(self) -> int:
        """Bytes the stored tokens occupy: compressed tokens at the format's size plus buffered tokens."""
        per_token = self.fmt.bytes_per_token(self.head_dim) * self.num_kv_heads
        buffered = 2 * self.head_dim * self.buffer_k.element_size() * self.num_kv_heads
        return int(self.compressed_lens.sum()) * per_token + int(self.buffer_lens.sum()) * buffered

    # ------------------------------------------------------------------ write path
    def _check_kv(self, k: torch.Tensor, v: torch.Tensor, rank: int) -> None:
        expect_float("k", k)
        expect_float("v", v)
        expect_same_device(k=k, v=v, cache=self.buffer_k)
        if k.shape != v.shape or k.dim() != rank or k.shape[-3] != self.num_kv_heads or k.shape[-1] != self.head_dim:
            lead = "[B, " if rank == 4 else "["
            raise ShapeError(f"k, v: expected {lead}{self.num_kv_heads}, T, {self.head_dim}], "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")

    def append(self, k: torch.Tensor, v: torch.Tensor, seq: int | None = None) -> None:
        """Append T tokens: k, v [B, H, T, D] for every sequence, or [H, T, D] for sequence ``seq``."""
        if seq is None:
            self._check_kv(k, v, 4)
            if k.shape[0] != self.batch_size:
                raise ShapeError(f"k: expected batch {self.batch_size}, got {k.shape[0]}")
            self._validate(k, v, list(range(self.batch_size)))
            self._append({b: (k[b], v[b]) for b in range(self.batch_size)})
        else:
            self._check_kv(k, v, 3)
            if not 0 <= expect_int("seq", seq) < self.batch_size:
                raise ShapeError(f"seq: expected 0 <= seq < {self.batch_size}, got {seq}")
            self._validate(k, v, [seq])
            self._append({seq: (k, v)})

    def _validate(self, k: torch.Tensor, v: torch.Tensor, seqs: list[int]) -> None:
        if self.validate:
            starts = [int(self.lengths[b]) for b in seqs]
            check_kv_storable(k, v, self.fmt, self.dtype, self.codec.raw_dtype, seqs, starts)

    def _append(self, chunks: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Merge new tokens into buffers; compress every full chunk past the recent window in one call."""
        keep, chunk = self.fmt.buffer_tokens, self.fmt.flush_chunk
        flush_k, flush_v, plan = [], [], []
        for b, (k, v) in chunks.items():
            nb = int(self.buffer_lens[b])
            all_k = torch.cat([self.buffer_k[b, :, :nb], k.to(self.dtype)], dim=1)
            all_v = torch.cat([self.buffer_v[b, :, :nb], v.to(self.dtype)], dim=1)
            total = all_k.shape[1]
            n_flush = ((total - keep) // chunk) * chunk if total >= keep + chunk else 0
            if n_flush:
                flush_k.append(all_k[:, :n_flush])
                flush_v.append(all_v[:, :n_flush])
                plan.append((b, n_flush))
            rest = total - n_flush
            self.buffer_k[b, :, :rest] = all_k[:, n_flush:]
            self.buffer_v[b, :, :rest] = all_v[:, n_flush:]
            self.buffer_lens[b] = rest
        if not plan:
            return
        self._reserve(max(int(self.compressed_lens[b]) + n for b, n in plan))
        flush_k_all, flush_v_all = torch.cat(flush_k, dim=1), torch.cat(flush_v, dim=1)  # [H, N, D]
        positions, rows = [], []
        for b, n in plan:
            c0 = int(self.compressed_lens[b])
            positions.append(torch.arange(c0, c0 + n, device=self.device))
            rows.append(torch.full((n,), b, device=self.device, dtype=torch.long))
            self.compressed_lens[b] = c0 + n
        pos, row = torch.cat(positions), torch.cat(rows)
        slots = slots_for_positions(self.block_table[row], pos.unsqueeze(1), self.layout.block_size)[:, 0]
        # encode + store in one step: the Triton compress-on-write kernel on CUDA, codec + write_slots on CPU
        from ..attention.dispatch import write  # lazy: attention sits above cache

        write(flush_k_all.transpose(0, 1), flush_v_all.transpose(0, 1), slots, self.pages, self.layout, self.codec)

    # ------------------------------------------------------------------ read helpers
    def paged(self) -> PagedKV:
        """The paged view attention kernels read (lengths as int32 on the cache's device)."""
        ar = torch.arange(self.batch_size, device=self.device, dtype=torch.int32)
        return PagedKV(self.pages, self.block_table, self.compressed_lens.to(self.device, torch.int32),
                       self.buffer_k, self.buffer_v, self.buffer_lens.to(self.device, torch.int32), ar,
                       self.layout, self.codec)

    def compressed_fields(self, upto: int | None = None) -> Fields:
        """Fields [B, H, upto, count] of the compressed history (``upto`` defaults to the longest sequence)."""
        return self.paged().gather_compressed(upto)

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dequantized (K, V) float32 [B, H, max_len, D] in token order plus lengths [B] (tests, naive paths)."""
        nc = int(self.compressed_lens.max())
        f = self.compressed_fields(nc)
        total = int(self.lengths.max())
        k = torch.zeros(self.batch_size, self.num_kv_heads, total, self.head_dim, device=self.device)
        v = torch.zeros_like(k)
        kc, vc = self.codec.decode_keys(f), self.codec.decode_values(f)
        for b in range(self.batch_size):
            c, r = int(self.compressed_lens[b]), int(self.buffer_lens[b])
            k[b, :, :c], v[b, :, :c] = kc[b, :, :c], vc[b, :, :c]
            k[b, :, c : c + r] = self.buffer_k[b, :, :r].float()
            v[b, :, c : c + r] = self.buffer_v[b, :, :r].float()
        return k, v, self.lengths.clone()
