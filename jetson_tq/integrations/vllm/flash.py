"""vLLM's own FlashAttention (FA3 on Hopper, FA2 elsewhere: the kernel stock vLLM's FLASH_ATTN backend runs) as the
``attention.reference.VarlenAttention`` our prefill hands its dense attention to, so prompt processing over a
compressed history runs at stock speed. ``JETSON_TQ_FLASH_PREFILL=0`` keeps prefill on our Triton loop;
``JETSON_TQ_FLASH_MIN_TOKENS`` moves the length from which a row takes FlashAttention (``FLASH_MIN_TOKENS``)."""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch

from ... import env
from ...attention.reference import VarlenAttention
from ...errors import ConfigError

logger = logging.getLogger(__name__)
ENV_VAR = env.FLASH_PREFILL
#: A chunk whose history + own tokens reach this many runs on FlashAttention, a shorter one on the Triton loop. With
#: the step's rows in one call over a plan built once per step (H100, docs/vllm.md, Speed), 8 prompts of 8k took
#: TTFT 2.21 s (last) on FlashAttention vs 2.40 s on the Triton loop (stock FA3: 1.99 s), and one layer's step of 2 x
#: 8k rows 2.39 ms vs 2.76 ms; shorter rows were not measured, so they stay on the Triton loop.
#: ``JETSON_TQ_FLASH_MIN_TOKENS`` overrides it (0: every row that FlashAttention can serve).
FLASH_MIN_TOKENS = 8192


@functools.cache
def flash_min_tokens() -> int:
    """``FLASH_MIN_TOKENS``, or ``JETSON_TQ_FLASH_MIN_TOKENS`` when set (read once per process)."""
    raw = env.read().flash_min_tokens
    if raw is None:
        return FLASH_MIN_TOKENS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{env.FLASH_MIN_TOKENS}: expected a token count >= 0, got {raw!r}")
    return value


def flash_threshold() -> int | None:
    """``flash_min_tokens()`` where FlashAttention serves prefill rows here, else None (every row on the Triton loop):
    the warm-up compiles the Triton loop's long-chunk launches below it."""
    return flash_min_tokens() if vllm_varlen() is not None else None


def prefill_varlen(history: int, chunk: int) -> VarlenAttention | None:
    """The FlashAttention call for a ``chunk``-token prefill after ``history`` tokens, or None for the Triton loop."""
    return vllm_varlen() if history + chunk >= flash_min_tokens() else None


def flash_rows(history: np.ndarray, chunk: np.ndarray) -> tuple[VarlenAttention | None, np.ndarray]:
    """``prefill_varlen`` for a step's rows at once: the FlashAttention call (None: none here) and which rows
    (``history`` + ``chunk`` tokens each) it serves."""
    varlen = vllm_varlen()
    if varlen is None:
        return None, np.zeros(np.shape(history), dtype=bool)
    return varlen, np.asarray(history) + np.asarray(chunk) >= flash_min_tokens()


@functools.cache
def vllm_varlen() -> VarlenAttention | None:
    """The varlen call of the FlashAttention version vLLM picks on this GPU, or None (no CUDA, no FlashAttention
    build in this vLLM, or switched off by ``JETSON_TQ_FLASH_PREFILL=0``); the reason is logged once."""
    if not env.read().flash_prefill:
        logger.info("jetson-tq: prefill on the Triton loop (%s=0)", ENV_VAR)
        return None
    if not torch.cuda.is_available():
        return None
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception as e:  # any import failure means: no FlashAttention here
        logger.info("jetson-tq: prefill on the Triton loop (vLLM's FlashAttention unavailable: %s)", e)
        return None
    version = get_flash_attn_version()
    if version is None:
        logger.info("jetson-tq: prefill on the Triton loop (vLLM names no FlashAttention version here)")
        return None

    def varlen(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, causal, **paged):
        """The ``VarlenAttention`` contract (typed there) on FlashAttention's own argument order; ``paged``: the
        keyword-only ``cu_seqlens_k``, ``seqused_k`` and ``block_table`` (FlashAttention's defaults are None too)."""
        out, lse = flash_attn_varlen_func(
            q,
            k,
            v,
            max_seqlen_q,
            cu_seqlens_q,
            max_seqlen_k,
            softmax_scale=softmax_scale,
            causal=causal,
            return_softmax_lse=True,
            fa_version=version,
            **paged,
        )
        return out, lse

    logger.info("jetson-tq: prefill attention on vLLM's FlashAttention %d", version)
    return varlen
