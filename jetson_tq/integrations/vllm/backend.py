"""The vLLM attention backend class: the static facts vLLM asks of it (name, dtypes, block sizes, KV cache shape,
supported features) and where its metadata builder (``builder``) and per-layer impl (``impl``) are. vLLM loads it by
``BACKEND_PATH`` (registered as CUSTOM on CUDA) or gets it from the ``Attention.__init__`` hook.

Data flow of one step for one layer:
1. ``do_kv_cache_update``: the step's keys/values are compressed into vLLM's paged blocks at
   ``slot_mapping`` (slot = block * block_size + offset; -1 = padding, skipped).
2. ``forward``: decode rows (one new token; vLLM puts them first, ``reorder_batch_threshold = 1``)
   first copy their token into the request's fp16 ring, then attend over compressed positions
   [0, L - r) plus r = ``format.exact_count(L)`` ring tokens (min(L, R); (L - 1) % R + 1 for block
   windows). Prefill / chunked-prefill rows attend over the history (compressed [0, s - r) + ring,
   r = min(s, R), or s % R for block windows) plus their own exact chunk (causal, each query under
   ``format.exact_start``, chunks may straddle block boundaries), then copy the chunk's last
   min(T, R) tokens into the ring.
Speculative decoding: a verification row (the last sampled token and its drafts, T = 1 + k tokens) is a chunk
like any other (causal inside it, history compressed + ring). When the step's leading rows (vLLM reorders rows of up
to 1 + k tokens first: ``reorder_batch_threshold``) all have the same T > 1, they take the decode path instead
(``ops.decode``'s multi-token form over device buffers the builder fills: CUDA-graph capturable, so the backend
declares ``UNIFORM_BATCH``); the ring gets their tokens after attention, as a chunk's. Its rejected tokens are
written again at the same positions by the next step: the pages are compressed per slot, so those slots are
simply overwritten; the ring columns it took are saved first (undo pool) and put back by the next step's builder
(``recent.Rewind``), so the exact window stays right after rejections, a draft crossing a ring-block boundary
included. (Write path and ``forward``: ``impl``; the read routes: ``attend``; the builder: ``builder``.)
The KV cache tensor of a layer is uint8 [num_blocks, num_kv_heads, page_bytes] (``PagedLayout``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionType, MultipleOf

from .builder import TurboQuantMetadataBuilder
from .impl import TurboQuantAttentionImpl
from .settings import preferred_block_size, reproducible

if TYPE_CHECKING:
    from vllm.config.cache import CacheDType

BACKEND_PATH = "jetson_tq.integrations.vllm.backend.TurboQuantAttentionBackend"


def registered_name() -> str:
    """The AttentionBackendEnum name this backend reports (CPU_ATTN on CPU, CUSTOM else): vLLM looks the layer's
    backend up by name; on CUDA the plugin registers CUSTOM as this class."""
    from vllm.platforms import current_platform

    return "CPU_ATTN" if current_platform.is_cpu() else "CUSTOM"


class TurboQuantAttentionBackend(AttentionBackend):
    """Paged attention over TurboQuant-compressed KV pages plus per-request fp16 recent buffers."""

    forward_includes_kv_cache_update: bool = False
    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return registered_name()

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        # block windows restart at multiples of R: vLLM's blocks (prefix-cache hit boundaries) must be too
        return preferred_block_size(default_block_size)

    @staticmethod
    def get_impl_cls() -> type[TurboQuantAttentionImpl]:
        return TurboQuantAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TurboQuantMetadataBuilder]:
        return TurboQuantMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        # The last dim (page bytes) differs per layer format; vLLM sized the raw tensor from the
        # layer's spec, so it is inferred here and checked against PagedLayout in forward.
        return (num_blocks, num_kv_heads, -1)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @staticmethod
    def use_cascade_attention(*args, **kwargs) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        # vLLM's VLLM_BATCH_INVARIANT check: our outputs are batch-invariant in the reproducible mode only
        return reproducible()
