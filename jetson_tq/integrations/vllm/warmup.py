"""Kernel warm-up at engine start: one layer of every compressed layer variant (``layer_variant``: format, heads,
block table, window and other extras) runs its write, prefill and decode launches once on vLLM's null block and the
scratch ring row, in the shapes a request's launches take, so Triton compiles before the first request instead of
inside its time to first token; a compile that still happens while serving is logged.

``warm_up`` runs one layer; ``warm_up_layer`` is what the runner hook calls per layer (CUDA only, once per
``layer_variant``, failures logged, not raised); ``late_compile`` is the warning for a kernel compiled after it.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from ... import ops
from .flash import flash_threshold
from .metadata import TurboQuantMetadata, decode_arrays
from .settings import logger

if TYPE_CHECKING:
    from .impl import TurboQuantAttentionImpl

#: a launch slower than this on a new launch key compiled (Triton's in-memory and disk caches answer in ms)
LATE_COMPILE_S = 0.05


def warm_up_lengths(num_heads: int, budget: int, flash_from: int | None = None) -> list[int]:
    """Chunk lengths whose launches cover every int specialization class (== 1 aside: vLLM puts one-token rows
    first, as decodes) a prefill chunk of up to ``budget`` tokens gets: Triton keys ints on divisibility by 16, and
    the query transform takes both T and T * heads, so a short and a long chunk (long ones take other tiles) each
    come as T % 16 == 0, T odd, and T not divisible by 16 with T * heads divisible by 16 (when the head count
    allows one). ``flash_from``: rows of that many tokens take FlashAttention (``flash.flash_threshold``), so the
    longest chunks on the Triton loop stop below it and get a set of their own (without it an 8 x 8k step on an
    H100 compiled the loop's long-chunk query transform while serving: 0.67 s)."""
    step = 16 // math.gcd(num_heads, 16)  # the least T with T * heads % 16 == 0
    tops = {budget} | ({flash_from} if flash_from is not None and 32 < flash_from < budget else set())
    out: set[int] = set()
    for base in [16] + sorted({b for b in (16 * ((top - 1) // 16) for top in tops) if b > 16}):
        out |= {base, base + 1}
        if 1 < step < 16:
            out.add(base + step if base == 16 else base - 16 + step)
    return sorted(n for n in out if n <= max(budget, 17))


@torch.inference_mode()  # vLLM allocates its caches as inference tensors: outside it, in-place writes are refused
def warm_up(
    impl: TurboQuantAttentionImpl,
    kv_cache: torch.Tensor,
    max_rows: int = 16,
    table_width: int | None = None,
    max_len: int | None = None,
    budget: int = 2048,
) -> None:
    """Run ``impl``'s write, prefill and eager decode paths on vLLM's null block (block 0, never a request's)
    and the scratch ring row, so Triton compiles at engine start, not in the first request's TTFT (on an H200
    without it the first 32k prompt waited 12.3 s, later ones ~6 s; with a warm-up that missed specializations
    the first 8k request took 2.48 s vs FA3's 0.61 s).

    The launches take the shapes a request's do, so they compile the same specializations
    (tests/integrations/vllm/test_vllm_warmup.py checks it): block tables ``table_width`` columns wide (vLLM's
    ``cdiv(max_model_len, block_size)``: their row stride is a kernel argument); chunks of ``warm_up_lengths``
    tokens, each first, over a short history and ending at the table's capacity (the prefill workspace's segment
    flags), each also as a step's second request (its block-table row's alignment); decode batches of every row
    count 1..``max_rows`` (max_num_seqs: the split count, hence its int classes and the reduce width, follows the
    batch); with speculative decoding, batches of 1..``max_rows`` verification rows of each length
    2..``undo_tokens`` and a one-token chunk. Row counts that share a specialization launch again without
    compiling."""
    if impl.layout is None or impl.recent_k is None or kv_cache.numel() == 0:
        return
    fmt = impl.fmt
    assert fmt is not None  # set with the layout
    dev, dtype, bs = kv_cache.device, impl.recent_k.dtype, impl.layout.block_size
    scratch = impl.recent_k.shape[0] - 1
    hist = -(-(bs + fmt.recent_tokens) // bs) * bs  # enough that some history is read compressed
    flash_from = flash_threshold()  # the loop's longest chunks stay below it over ``hist`` tokens too
    lengths = warm_up_lengths(
        impl.num_heads, min(budget, max_len or budget), None if flash_from is None else flash_from - hist
    )
    width = table_width or -(-max(max_len or 0, hist + max(lengths)) // bs)
    table = torch.zeros(max(1, max_rows), width, dtype=torch.int32, device=dev)
    empty32, empty64 = (torch.zeros(0, dtype=t, device=dev) for t in (torch.int32, torch.int64))

    def meta(q_lens, ctx_lens, n_dec: int) -> TurboQuantMetadata:
        q_lens, ctx_lens = np.asarray(q_lens), np.asarray(ctx_lens)
        n = int(q_lens.sum())
        return TurboQuantMetadata(
            num_actual_tokens=n,
            num_reqs=len(q_lens),
            num_decodes=n_dec,
            recent_tokens=fmt.recent_tokens,
            query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]),
            seq_lens=ctx_lens + q_lens,
            context_lens=ctx_lens,
            ring_rows=np.full(len(q_lens), scratch),
            block_table=table[: len(q_lens)],
            slot_mapping=torch.arange(n, dtype=torch.int64, device=dev) % bs,  # block 0's slots only
            dec_ring_rows=empty64,
            dec_ring_cols=empty64,
            dec_compressed_lens=empty32,
            dec_recent_lens=empty32,
            block_window=fmt.block_window,
        )

    def verify_meta(t: int, rows: int, ctx: int) -> TurboQuantMetadata:
        """``rows`` verification rows of ``t`` tokens over ``ctx`` history tokens, as the builder routes a step of
        them to the decode path (``decode_arrays``: device lengths, ring and token columns)."""
        md = meta([t] * rows, [ctx] * rows, rows)
        dec = decode_arrays(
            np.diff(md.query_start_loc), md.seq_lens, md.ring_rows, fmt.recent_tokens, md.block_window, t
        )
        ints = [torch.as_tensor(a, device=dev) for a in (dec.ring_rows, dec.compressed, dec.recent, dec.token_cols)]
        return replace(
            md,
            dec_ring_rows=ints[0].to(torch.int64),
            dec_compressed_lens=ints[1].to(torch.int32),
            dec_recent_lens=ints[2].to(torch.int32),
            dec_query_tokens=dec.tokens,
            dec_token_cols=ints[3].to(torch.int64).view(rows, t),
        )

    def step(md: TurboQuantMetadata) -> None:
        n = md.num_actual_tokens
        q = torch.zeros(n, impl.num_heads, impl.head_size, dtype=dtype, device=dev)
        kv = torch.zeros(n, impl.num_kv_heads, impl.head_size, dtype=dtype, device=dev)
        impl._write(kv, kv, kv_cache, md.slot_mapping, md)
        impl._forward_eager(q, kv, kv, kv_cache, md, torch.empty_like(q))

    # a chunk of a step's second request reads its block-table row at width * 4 bytes, which Triton keys as a pointer
    # not 16-byte aligned unless width % 4 == 0 (a first 8 x 2k step compiled the dequantizer again, 0.96 s)
    misaligned = width % 4 != 0
    first = max(2, impl.undo_tokens + 1)  # the first request's chunk: longer than a verification row, never T == 1
    for n in lengths:  # a first chunk, one over a short history, one ending at the table's capacity
        for ctx in sorted({c for c in (0, hist, width * bs - n) if 0 <= c <= width * bs - n}):
            step(meta([n], [ctx], 0))
            if misaligned:
                step(meta([first, n], [ctx, ctx], 0))
    if impl.undo_tokens:  # with speculation a one-token row after verification rows stays a chunk (T == 1 keys)
        step(meta([1], [hist + 1], 0))
        if misaligned:
            step(meta([first, 1], [hist + 1, hist + 1], 0))
    for rows in range(1, max(1, max_rows) + 1):
        step(meta([1] * rows, [hist + 1] * rows, rows))
    as_decode = fmt.key_mode != "klt" and not impl.reproducible  # the builder's rule (``_spec_as_decode``)
    for t in range(2, impl.undo_tokens + 1):  # speculative verification rows: one launch per length, any count
        for rows in range(1, max(1, max_rows) + 1):
            step(meta([t] * rows, [hist + 1] * rows, 0))  # a row among prefill chunks: the prefill kernel
            if as_decode:  # a step of uniform verification rows: the multi-token decode kernel
                step(verify_meta(t, rows, hist + 1))


def bound_cache(layer) -> torch.Tensor | None:
    """The KV cache tensor vLLM bound to an attention layer (a list per virtual engine in some versions)."""
    cache = getattr(layer, "kv_cache", None)
    if isinstance(cache, (list, tuple)):
        cache = cache[0] if cache else None
    return cache if isinstance(cache, torch.Tensor) and cache.numel() else None


def block_table_width(runner, block_size: int, layer_name: str | None = None) -> int:
    """Columns of the runner's block table of ``layer_name``'s KV-cache group (the row stride our kernels get), else
    of the first table of ``block_size``-token blocks; vLLM sizes it ``cdiv(max_model_len, block_size)`` (rounded up
    for alignment in some versions), which is the fallback."""
    tables = getattr(getattr(getattr(runner, "input_batch", None), "block_table", None), "block_tables", None) or []
    groups = getattr(getattr(runner, "kv_cache_config", None), "kv_cache_groups", None) or []
    if layer_name is not None and len(groups) == len(tables):  # one table per group, in the groups' order
        for group, table in zip(groups, tables):
            if layer_name in getattr(group, "layer_names", ()) and getattr(table, "block_size", None) == block_size:
                return int(table.max_num_blocks_per_req)
    for table in tables:
        if getattr(table, "block_size", None) == block_size:
            return int(table.max_num_blocks_per_req)
    return -(-int(runner.model_config.max_model_len) // block_size)


def layer_variant(impl: TurboQuantAttentionImpl, table_width: int, device: torch.device) -> tuple:
    """What the warm-up's launches for ``impl`` are keyed on beyond the step shapes it runs: the page layout (format,
    block size, padding), the raw dtype, the head counts and size, the speculative row length, reproducible mode,
    the block table's width and what the kernels see of the layer's codec and extras (``ops.kernel_variant``: klt
    facts, the sinks / soft cap / sliding window flags, the window's int class). A model's layers of one variant
    launch the same kernel specializations, so one of them is warmed up; a sliding-window layer and a global one
    are two variants (the global layers of a model whose first layer slides compiled while serving otherwise)."""
    assert impl.codec is not None  # set with the layout
    return (
        impl.layout,
        impl.codec.raw_dtype,
        impl.num_heads,
        impl.num_kv_heads,
        impl.head_size,
        impl.undo_tokens,
        impl.reproducible,
        table_width,
        ops.kernel_variant(impl.codec, impl.extras, device),
    )


def late_compile(kernel: str, key: tuple, seconds: float) -> None:
    """A kernel compiled after the warm-up: a request waited for it (the warm-up's coverage missed this key)."""
    if seconds < LATE_COMPILE_S:
        return
    logger().warning(
        "jetson-tq: %s compiled while serving (%.2f s, a request waited): not covered by the warm-up, key %s",
        kernel,
        seconds,
        short_key(key),
    )


def short_key(key: tuple, limit: int = 400) -> str:
    """``key`` as text of at most about ``limit`` characters, its start and its end: a launch key opens with the
    layer's long page spec, which is the same for every launch of a format, and the shape classes that tell two
    launches apart come last."""
    text = str(key)
    if len(text) <= limit:
        return text
    head = limit // 4
    return f"{text[:head]} ... {text[-(limit - head) :]}"


def warm_up_layer(runner, layer, warmed: set) -> None:
    """Warm up ``layer`` (on the runner's device, in the runner's sizes) unless a layer of the same
    ``layer_variant`` in ``warmed`` already did; only where kernels compile (``compiles_on``)."""
    impl = layer.impl
    cache = bound_cache(layer)
    device = torch.device(runner.device)
    if not compiles_on(device) or cache is None or impl.layout is None:
        return
    width = block_table_width(runner, impl.layout.block_size, impl.layer_name)
    key = layer_variant(impl, width, cache.device)
    if key in warmed:
        return
    try:  # Triton compiles now, not in the first request (once per variant)
        sched, start = runner.vllm_config.scheduler_config, time.perf_counter()
        warm_up(
            impl,
            cache,
            max_rows=int(sched.max_num_seqs),
            table_width=width,
            max_len=int(runner.model_config.max_model_len),
            budget=int(sched.max_num_batched_tokens),
        )
        logger().info(
            "jetson-tq: kernel warm-up of %s and the layers like it (%d/%d heads of %d, block %d, %s) took %.2f s",
            impl.layer_name,
            impl.num_heads,
            impl.num_kv_heads,
            impl.head_size,
            impl.layout.block_size,
            impl.extras,
            time.perf_counter() - start,
        )
    except Exception as exc:  # the first request then compiles, and raises if the path is broken
        logger().warning("jetson-tq: kernel warm-up skipped (%s: %s)", type(exc).__name__, exc)
    warmed.add(key)


def compiles_on(device: torch.device) -> bool:
    """True where the kernels compile at their first launch: CUDA (on CPU ``ops`` runs the PyTorch reference)."""
    return device.type == "cuda"
