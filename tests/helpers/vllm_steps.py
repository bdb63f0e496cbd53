"""One model-runner step laid out as vLLM 0.27 lays it out for an attention backend, for tests that drive
``TurboQuantAttentionImpl`` without an engine: block tables of arbitrary physical blocks, slot = block * block_size +
offset, flattened tokens with ``query_start_loc``, and the host metadata the builder would make."""

from __future__ import annotations

import numpy as np
import torch

from jetson_tq.format import KVFormat
from jetson_tq.integrations.vllm.metadata import TurboQuantMetadata, decode_arrays


def step_layout(
    reqs: list[str], q_lens: np.ndarray, ctx: np.ndarray, tables: dict[str, list[int]], free: list, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """(block table [reqs, width] int32, slot mapping [tokens], query_start_loc) of one step; each request's table
    grows from ``free`` (popped) to hold its context plus this step's tokens."""
    for r, n, c in zip(reqs, q_lens, ctx):
        tables.setdefault(r, [])
        while len(tables[r]) < -(-(int(c) + int(n)) // block_size):
            tables[r].append(int(free.pop()))
    width = max(len(tables[r]) for r in reqs)
    block_table = torch.tensor([tables[r] + [0] * (width - len(tables[r])) for r in reqs], dtype=torch.int32)
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(ctx, q_lens)])
    owner = np.repeat(np.arange(len(reqs)), q_lens)
    slots = [tables[reqs[o]][p // block_size] * block_size + p % block_size for o, p in zip(owner, positions)]
    return block_table, torch.tensor(slots), np.concatenate([[0], np.cumsum(q_lens)])


def host_metadata(
    fmt: KVFormat,
    q_lens: np.ndarray,
    ctx: np.ndarray,
    rows: np.ndarray,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    dec_positions: torch.Tensor | None = None,
    spec_tokens: int = 0,
) -> TurboQuantMetadata:
    """The eager path's metadata of one step: leading one-token rows are decodes (no decode device buffers), or,
    with ``spec_tokens`` (1 + k), the builder's decode rows (``decode_arrays``: a leading run of uniform verification
    rows included) with its decode buffers, as CPU tensors."""
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    nd = int(np.argmin(q_lens <= 1)) if not (q_lens <= 1).all() else len(q_lens)
    empty32, empty64 = torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int64)
    dec_rows, dec_cols, dec_comp, dec_rec, t, tcols = empty64, empty64, empty32, empty32, 1, None
    if spec_tokens:
        dec = decode_arrays(q_lens, ctx + q_lens, rows, fmt.recent_tokens, fmt.block_window, spec_tokens)
        nd, t = dec.rows, dec.tokens
        dec_rows, dec_cols = torch.from_numpy(dec.ring_rows).long(), torch.from_numpy(dec.ring_cols).long()
        dec_comp, dec_rec = torch.from_numpy(dec.compressed).int(), torch.from_numpy(dec.recent).int()
        tcols = torch.from_numpy(dec.token_cols).long() if t > 1 else None
    return TurboQuantMetadata(
        num_actual_tokens=int(qsl[-1]),
        num_reqs=len(q_lens),
        num_decodes=nd,
        recent_tokens=fmt.recent_tokens,
        block_window=fmt.block_window,
        query_start_loc=qsl,
        seq_lens=ctx + q_lens,
        context_lens=ctx,
        ring_rows=rows,
        block_table=block_table,
        slot_mapping=slot_mapping,
        dec_ring_rows=dec_rows,
        dec_ring_cols=dec_cols,
        dec_compressed_lens=dec_comp,
        dec_recent_lens=dec_rec,
        dec_positions=dec_positions,
        dec_query_tokens=t,
        dec_token_cols=tcols,
    )
