"""The KV budget the plugin takes out of vLLM's: the fp16 ring pools (with speculative decoding their undo pools) and,
on CUDA, the largest prefill chunk's kernel temporaries, which vLLM's profile run does not reach.

vLLM sizes the KV cache from the memory its worker reports as available (``kv_budget`` is applied to that report),
so what the pools and temporaries need must be taken out before it sizes the compressed pages.
"""

from __future__ import annotations

import torch

from ...errors import ConfigError
from .recent import pool_bytes
from .runtime import configure_all, recent_rows
from .settings import logger
from .spec import prefill_transient_bytes


def recent_pool_bytes(vllm_config) -> int:
    """Bytes all recent-buffer pools take (K and V, every layer, max_num_seqs + 1 rows), their undo pools for
    speculative decoding's rejected drafts included."""
    elt = torch.empty((), dtype=vllm_config.model_config.dtype).element_size()
    total = 0
    for layer in configure_all(vllm_config).values():
        impl = layer.impl
        width = impl.fmt.recent_tokens + impl.undo_tokens
        total += pool_bytes(recent_rows(vllm_config) + 1, impl.num_kv_heads, width, impl.head_size, elt)
    return total


def prefill_reserve_bytes(vllm_config) -> int:
    """Bytes the largest prefill chunk's kernel temporaries take (the worst compressed layer; layers run one after
    another and the caching allocator reuses the blocks): 0 off CUDA (the reference path) and when the user fixed
    the KV cache's bytes (``kv_cache_memory_bytes``: vLLM sizes nothing from the profile then)."""
    if getattr(vllm_config.cache_config, "kv_cache_memory_bytes", None):
        return 0
    if torch.device(vllm_config.device_config.device).type != "cuda":
        return 0
    elt = torch.empty((), dtype=vllm_config.model_config.dtype).element_size()
    tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
    max_len = int(vllm_config.model_config.max_model_len)
    return max(
        (
            prefill_transient_bytes(
                layer.impl.fmt,
                layer.impl.num_heads,
                layer.impl.num_kv_heads,
                layer.impl.head_size,
                tokens,
                max_len,
                elt,
            )
            for layer in configure_all(vllm_config).values()
        ),
        default=0,
    )


#: A share of the KV budget above which the ring pools' reserve is logged as a warning: vLLM's engine arguments
#: default ``max_num_seqs`` to 1,024 on a GPU of 70 GiB or more (an AGX Thor's 128 GB included), and every row of the
#: pools is reserved whether or not that many requests ever run (Qwen2.5-7B: 7 MiB a row, 7.2 GiB at 1,024).
RING_SHARE_WARN = 0.10


def ring_share_warning(pool: int, available: int, rows: int) -> str | None:
    """The warning for ring pools of ``pool`` bytes (``rows`` sequences + 1 scratch row) out of an ``available``-byte
    KV budget, or None when they take at most ``RING_SHARE_WARN`` of it."""
    if available <= 0 or pool <= RING_SHARE_WARN * available:
        return None
    return (
        f"jetson-tq: the fp16 recent buffers of max_num_seqs={rows} sequences take {pool / 2**30:.2f} GiB, "
        f"{100 * pool / available:.0f} % of the KV budget (one row per sequence vLLM may run at once, reserved "
        f"up front); set --max-num-seqs to the number of requests this device serves together"
    )


def kv_budget(vllm_config, available: int) -> int:
    """The bytes left for compressed pages of the ``available`` bytes vLLM's worker found (logged); ConfigError when
    the pools and temporaries need all of it."""
    transient = prefill_reserve_bytes(vllm_config)
    pool = recent_pool_bytes(vllm_config)
    reserved = pool + transient
    warning = ring_share_warning(pool, available, recent_rows(vllm_config))
    if warning:
        logger().warning(warning)
    if transient:
        logger().info(
            "jetson-tq: %.1f MiB of the KV budget set aside for prefill kernel temporaries (a %d-token chunk; "
            "vLLM's profile run does not reach them)",
            transient / 2**20,
            vllm_config.scheduler_config.max_num_batched_tokens,
        )
    if reserved:
        if reserved >= available:
            raise ConfigError(
                f"jetson-tq recent buffers and prefill temporaries need {reserved / 2**20:.1f} MiB but the KV "
                f"budget is {available / 2**20:.1f} MiB; lower max_num_seqs, buffer.recent_tokens or "
                f"max_num_batched_tokens"
            )
        logger().info(
            "jetson-tq: %.1f MiB of the KV budget reserved for fp16 recent buffers "
            "(%d rows + 1 scratch) and prefill temporaries; %.1f MiB left for compressed pages",
            reserved / 2**20,
            recent_rows(vllm_config),
            (available - reserved) / 2**20,
        )
    return available - reserved
