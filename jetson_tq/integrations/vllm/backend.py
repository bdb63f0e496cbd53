"""The vLLM attention backend: backend class (static facts), metadata builder (host), impl (write + attend).

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
included.
The KV cache tensor of a layer is uint8 [num_blocks, num_kv_heads, page_bytes] (``PagedLayout``).
"""

from __future__ import annotations

import math
from collections.abc import Container
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar, cast

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from ... import ops
from ...attention.extras import AttentionExtras
from ...codec.kv import KVCodec
from ...codec.rotation import derive_seed
from ...errors import ConfigError, ShapeError, UnsupportedModelError, UnsupportedPlatformError
from ...format import KVFormat, PagedLayout, exact_count, kernel_unsupported_reason
from ...paged import PagedKV
from . import hooks
from .flash import prefill_varlen
from .recent import Rewind
from .settings import active_config, layer_key_transform, preferred_block_size, reproducible, spec_query_tokens

if TYPE_CHECKING:
    from vllm.config.cache import CacheDType

from .spec import (
    LayerFacts,
    layer_format,
    layer_index,
    layout_for,
    layout_of_spec,
    make_spec,
    stock_reason,
)

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


@dataclass
class TurboQuantMetadata:
    """Per-step tensors of one layer group: host arrays for the eager path, device buffers for graphs."""

    num_actual_tokens: int
    num_reqs: int
    num_decodes: int  # leading rows with at most one new token, or ``dec_query_tokens`` each
    recent_tokens: int
    query_start_loc: np.ndarray  # host int64 [num_reqs + 1]
    seq_lens: np.ndarray  # host int64 [num_reqs], tokens after this step
    context_lens: np.ndarray  # host int64 [num_reqs], tokens before this step
    ring_rows: np.ndarray  # host int64 [num_reqs]
    block_table: torch.Tensor  # device int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor
    dec_ring_rows: torch.Tensor  # device int64 [num_decodes] (persistent buffers)
    dec_ring_cols: torch.Tensor  # device int64 [num_decodes]: position % R of the new token
    dec_compressed_lens: torch.Tensor  # device int32 [num_decodes]
    dec_recent_lens: torch.Tensor  # device int32 [num_decodes]
    dec_positions: torch.Tensor | None = None  # device int64 [>= tokens]: the decode rows' new-token positions first
    block_window: bool = False  # window: block (exact window = the query's own recent_tokens-token block)
    dec_query_tokens: int = 1  # T > 1: the decode rows are T-token verification rows (``decode_rows``)
    dec_token_cols: torch.Tensor | None = None  # device int64 [num_decodes, T]: (s + j) % R of their new tokens
    # device copies of the eager path's host index arrays, made by the step's first layer for all (``_device_ints``)
    device_ints: dict = field(default_factory=dict, repr=False, compare=False)


def _device_ints(
    md: TurboQuantMetadata, key: str, device: torch.device, *arrays, per_row: bool = False
) -> list[torch.Tensor]:
    """Device copies of host int arrays (each (array, dtype)), made once per step and shared by every layer: one
    pinned, non-blocking copy (a pageable copy makes the host wait for the GPU's queue, in every layer). Every part,
    and with ``per_row`` every row (returned as [n, 16 bytes], read as ``x[j, :1]``), starts 16-byte aligned: the
    kernels are specialized on their pointers' alignment, which the warm-up must not see differ from a request's."""
    got = md.device_ints.get(key)
    if got is None:
        host, shapes = [], []
        for a, t in arrays:
            a = np.asarray(a, dtype=np.int64).reshape(-1)
            if per_row:
                w = 16 // t.itemsize
                a = np.pad(a[:, None], ((0, 0), (0, w - 1)))
            shapes.append(a.shape)
            host.append(np.pad(a.reshape(-1), (0, a.size % 2)))  # whole 16-byte units of int64
        flat = torch.from_numpy(np.concatenate(host))
        dev = (flat.pin_memory() if device.type == "cuda" else flat).to(device, non_blocking=True)
        parts = dev.split([h.size for h in host])
        got = md.device_ints[key] = [
            (x if t == torch.int64 else x.to(t))[: int(np.prod(shape))].view(shape)
            for x, shape, (_, t) in zip(parts, shapes, arrays)
        ]
    return got


def decode_rows(q_lens: np.ndarray, spec_tokens: int) -> tuple[int, int]:
    """(rows, T): the leading rows the decode path serves: those with at most one new token (T = 1), or, with
    speculative decoding (``spec_tokens`` = 1 + k, 0 without), a leading run of verification rows that all have the
    same T in [2, spec_tokens] (vLLM puts rows of up to 1 + k tokens first; a step whose leading rows differ in
    length serves them as chunks)."""
    if q_lens.size == 0:
        return 0, 1
    t = int(q_lens[0])
    if t <= 1 or t > spec_tokens:
        short = q_lens <= 1
        return int(q_lens.size if short.all() else np.argmin(short)), 1
    same = q_lens == t
    return int(q_lens.size if same.all() else np.argmin(same)), t


@dataclass(frozen=True)
class DecodeArrays:
    """Host values of a step's decode buffers (``decode_arrays``), which the builder copies to the device."""

    rows: int  # leading rows served by the decode path
    tokens: int  # T: tokens per decode row (> 1: verification rows)
    ring_rows: np.ndarray  # [rows] each row's ring row
    ring_cols: np.ndarray  # [rows] (T = 1) the new token's ring column, (L - 1) % R
    compressed: np.ndarray  # [rows] compressed tokens the decode reads (T > 1: of the history)
    recent: np.ndarray  # [rows] ring tokens it reads (T > 1: of the history, a chunk's count)
    positions: np.ndarray  # [rows * T] the new tokens' positions
    token_cols: np.ndarray  # [rows, T] (T > 1) the new tokens' ring columns, position % R


def decode_arrays(
    q_lens: np.ndarray, seq: np.ndarray, rows: np.ndarray, R: int, block_window: bool, spec_tokens: int
) -> DecodeArrays:
    """The decode rows of a step (``decode_rows``) and what their decode reads: one-token rows over L tokens
    (the ring holds the new token, ``exact_count(L)``), or verification rows of T tokens over their s = L - T token
    history (the ring gets the T tokens after attention: s % R (block) or min(s, R) of it in the ring)."""
    nd, t = decode_rows(q_lens, spec_tokens)
    L = seq[:nd].astype(np.int64)
    if t > 1:
        s = np.maximum(L - t, 0)  # (vLLM's graph-capture runs may give rows fewer tokens than their query)
        rec = s % R if (block_window and R > 0) else np.minimum(s, R)
        new_pos = s[:, None] + np.arange(t)
        return DecodeArrays(nd, t, rows[:nd], np.zeros_like(L), s - rec, rec, new_pos.reshape(-1), new_pos % max(R, 1))
    rec = exact_count(L, R, block_window)
    cols = (L - 1) % R if R > 0 else np.zeros_like(L)
    return DecodeArrays(nd, 1, rows[:nd], cols, L - rec, rec, L - 1, np.zeros((nd, 0), dtype=np.int64))


class TurboQuantMetadataBuilder(AttentionMetadataBuilder[TurboQuantMetadata]):
    """Builds per-step metadata on the host; assigns each request its recent-buffer row."""

    reorder_batch_threshold: int | None = 1

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec) -> AttentionCGSupport:
        device = torch.device(cast("torch.device | str", vllm_config.device_config.device))  # resolved by vLLM
        if reproducible():  # decode rows run the prefill kernel eagerly (vLLM keeps piecewise graphs around it)
            return AttentionCGSupport.NEVER
        if not ops.graph_safe(device):
            return AttentionCGSupport.NEVER
        if _spec_as_decode(vllm_config, kv_cache_spec):  # uniform verification rows take the decode path
            return AttentionCGSupport.UNIFORM_BATCH
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.recent_tokens = int(getattr(kv_cache_spec, "tq_recent_tokens", 0))
        self.block_window = bool(getattr(kv_cache_spec, "tq_block_window", False)) and self.recent_tokens > 0
        self.undo_tokens = spec_query_tokens(vllm_config) if self.recent_tokens > 0 else 0
        # verification rows of up to 1 + k tokens come first and, when uniform, take the decode path
        self.spec_tokens = spec_query_tokens(vllm_config) if _spec_as_decode(vllm_config, kv_cache_spec) else 0
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=self.spec_tokens > 0)
        sched = vllm_config.scheduler_config
        cap = max(sched.max_num_seqs, sched.max_num_batched_tokens) + 1
        self._tcols = torch.zeros(cap * max(1, self.spec_tokens), dtype=torch.int64, device=device)
        self._rows = torch.zeros(cap, dtype=torch.int64, device=device)
        self._cols = torch.zeros(cap, dtype=torch.int64, device=device)
        self._comp = torch.zeros(cap, dtype=torch.int32, device=device)
        self._rec = torch.zeros(cap, dtype=torch.int32, device=device)
        self._pos = torch.zeros(cap, dtype=torch.int64, device=device)
        self._slots = hooks.recent_slots(vllm_config)
        if self.recent_tokens > 0 and hooks.current_runner() is None:
            raise UnsupportedPlatformError(
                "jetson-tq's recent buffers need vLLM's GPUModelRunner (or CPUModelRunner); another model "
                "runner is in use (VLLM_USE_V2_MODEL_RUNNER?). Set buffer.recent_tokens: 0 or use the default runner."
            )

    def _request_ids(self, num_reqs: int) -> tuple[list[str | None], Container[str]]:
        runner = hooks.current_runner()
        if runner is None:
            return [None] * num_reqs, ()
        ids = list(runner.input_batch.req_ids)[: min(num_reqs, runner.input_batch.num_reqs)]
        return ids + [None] * (num_reqs - len(ids)), runner.requests

    def _rewind(self, rewinds: list[Rewind]) -> None:
        """Put back the ring columns of rejected draft tokens in every compressed layer this builder serves (before
        the step's forward reads or writes any ring; the same again from another builder changes nothing)."""
        rows, ring_cols, undo_cols = [], [], []
        for rw in rewinds:
            ring, undo = rw.columns(self.recent_tokens)
            rows += [rw.row] * len(ring)
            ring_cols += ring
            undo_cols += undo
        ctx = self.vllm_config.compilation_config.static_forward_context
        index = torch.tensor([rows, ring_cols, undo_cols], dtype=torch.int64).to(self.device, non_blocking=True)
        for name in self.layer_names:
            impl = getattr(ctx.get(name), "impl", None)
            if impl is not None and hooks.is_ours(impl):
                impl.rewind_ring(index[0], index[1], index[2])

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> TurboQuantMetadata:
        cm = common_attn_metadata
        n = cm.num_reqs
        qsl = cm.query_start_loc_cpu[: n + 1].to(torch.int64).numpy()
        q_lens = np.diff(qsl)
        host = getattr(cm, "seq_lens_cpu_upper_bound", None)  # exact without async speculative decoding (0.27)
        if host is None or getattr(hooks.current_runner(), "use_async_spec_decode", False):
            host = None  # optimistic there (every draft accepted): the device lengths are the exact ones
        if host is None:
            host = getattr(cm, "_seq_lens_cpu", None)
        if host is None:
            host = cm.seq_lens[:n].cpu()  # a host sync, outside any graph (builders run eagerly)
        seq = host[:n].to(torch.int64).numpy()
        ctx = seq - q_lens
        R = self.recent_tokens
        if R > 0:
            req_ids, live = self._request_ids(n)
            rows = self._slots.assign(req_ids, ctx, q_lens, live, R if self.block_window else 0, self.undo_tokens)
            if self._slots.rewinds:
                self._rewind(self._slots.rewinds)
        else:
            rows = np.full(n, self._slots.scratch, dtype=np.int64)
        dec = decode_arrays(q_lens, seq, rows, R, self.block_window, self.spec_tokens)
        nd, t = dec.rows, dec.tokens
        tcols = None
        if t > 1:
            tcols = self._tcols[: nd * t].view(nd, t)
            tcols.copy_(torch.from_numpy(dec.token_cols), non_blocking=True)
        bufs = (
            (self._rows, dec.ring_rows),
            (self._cols, dec.ring_cols),
            (self._comp, dec.compressed),
            (self._rec, dec.recent),
            (self._pos, dec.positions),
        )
        for buf, values in bufs:
            buf[: len(values)].copy_(torch.from_numpy(np.ascontiguousarray(values)).to(buf.dtype), non_blocking=True)
        return TurboQuantMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_reqs=n,
            num_decodes=nd,
            recent_tokens=R,
            block_window=self.block_window,
            query_start_loc=qsl,
            seq_lens=seq,
            context_lens=ctx,
            ring_rows=rows,
            block_table=cm.block_table_tensor[:n],
            slot_mapping=cm.slot_mapping,
            dec_ring_rows=self._rows[:nd],
            dec_ring_cols=self._cols[:nd],
            dec_compressed_lens=self._comp[:nd],
            dec_recent_lens=self._rec[:nd],
            dec_positions=self._pos,
            dec_query_tokens=t,
            dec_token_cols=tcols,
        )


def _spec_as_decode(vllm_config: VllmConfig, kv_cache_spec) -> bool:
    """True when speculative decoding is on and this group's verification rows can take the decode path (the
    multi-token decode serves every key mode but klt; the reproducible mode runs every row as a chunk)."""
    fmt = dict(getattr(kv_cache_spec, "tq_format", ()) or ())
    return spec_query_tokens(vllm_config) > 1 and fmt.get("key_mode") != "klt" and not reproducible()


def _warm_up_lengths(num_heads: int, budget: int) -> list[int]:
    """Chunk lengths whose launches cover every int specialization class (== 1 aside: vLLM puts one-token rows
    first, as decodes) a prefill chunk of up to ``budget`` tokens gets: Triton keys ints on divisibility by 16, and
    the query transform takes both T and T * heads, so a short and a long chunk (long ones take other tiles) each
    come as T % 16 == 0, T odd, and T not divisible by 16 with T * heads divisible by 16 (when the head count
    allows one)."""
    step = 16 // math.gcd(num_heads, 16)  # the least T with T * heads % 16 == 0
    big = 16 * ((budget - 1) // 16)
    out: set[int] = set()
    for base in [16] + ([big] if big > 16 else []):
        out |= {base, base + 1}
        if 1 < step < 16:
            out.add(base + step if base == 16 else base - 16 + step)
    return sorted(n for n in out if n <= max(budget, 17))


class TurboQuantAttentionImpl(AttentionImpl):
    """Writes compressed K/V into vLLM's pages and attends over them (one layer)."""

    is_jetson_tq = True  # the marker hooks.is_ours checks

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra,
    ) -> None:
        facts = LayerFacts(
            name="",
            head_size=head_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads or num_heads,
            attn_type=str(getattr(attn_type, "value", attn_type)),
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap or None,
            alibi=alibi_slopes is not None,
            sinks=extra.get("sinks") is not None,
            kv_sharing_target=kv_sharing_target_layer_name,
            kv_cache_dtype=kv_cache_dtype,
            extra=tuple(sorted(k for k, v in extra.items() if k != "sinks" and v not in (None, False))),
        )
        why = stock_reason(facts, None)
        if why is None and kv_cache_dtype != "auto":
            why = f"kv_cache_dtype {kv_cache_dtype!r} (the TurboQuant pages are the KV cache format)"
        if why:  # the Attention.__init__ wrap gives such layers stock attention; this backend was forced on one
            raise UnsupportedModelError(f"jetson-tq's vLLM backend cannot serve this layer: {why}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        # the layer's sinks (the model's parameter itself: its weights load after this), soft cap and window
        self.extras = AttentionExtras(
            sinks=extra.get("sinks"), soft_cap=logits_soft_cap or None, sliding_window=sliding_window
        )
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ShapeError(f"{num_heads} query heads is not a multiple of {self.num_kv_heads} KV heads")
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        self.layer_name: str | None = None
        self.fmt: KVFormat | None = None
        self.index: int | None = None
        self.layout: PagedLayout | None = None
        self.codec: KVCodec | None = None
        self.recent_k: torch.Tensor | None = None
        self.recent_v: torch.Tensor | None = None
        self.undo_tokens = 0  # speculative decoding: the longest verification row (1 + draft tokens), else 0
        self.undo_k: torch.Tensor | None = None  # [rows + 1, H, undo_tokens, D]: ring columns a short step overwrote
        self.undo_v: torch.Tensor | None = None
        self._checked_pages = False
        self._block_basis: int | None = None  # vLLM's block size ``configure`` planned this layer's page for
        # reproducible mode: every query row (decode or prompt) runs the prefill kernel with position-aligned tiles
        self.reproducible = reproducible()

    # ---------------------------------------------------------------- startup
    def pick_format(self, layer_name: str, vllm_config: VllmConfig) -> tuple[KVFormat, int]:
        """(format, layer index) of this layer under the active config (named errors for misfits)."""
        model_config = vllm_config.model_config
        num_layers = int(model_config.hf_text_config.num_hidden_layers)
        index = layer_index(layer_name)
        return layer_format(active_config(), index, num_layers, self.head_size), index

    def configure(self, layer_name: str, vllm_config: VllmConfig) -> None:
        """Give this layer its format and page (block size, padding: ``hooks.model_plan``); idempotent for one vLLM
        block size (vLLM sets it after loading the model: a speculative-decoding head may ask for specs before)."""
        basis = vllm_config.cache_config.block_size
        if self.layer_name == layer_name and self.layout is not None and self._block_basis == basis:
            return
        fmt, index = self.pick_format(layer_name, vllm_config)
        device = torch.device(cast("torch.device | str", vllm_config.device_config.device))
        block_size, page_stride = hooks.model_plan(vllm_config)[layer_name]
        why = kernel_unsupported_reason(layout_for(fmt, self.head_size, block_size, page_stride))
        if device.type == "cuda" and why:
            raise UnsupportedPlatformError(
                f"{layer_name}: this format runs inside vLLM on its CPU backend only, no Triton kernel serves it: "
                f"{why} (use TurboQuantCache on the GPU, or another config)"
            )
        dtype = cast(torch.dtype, vllm_config.model_config.dtype)  # a torch.dtype once vLLM resolved the config
        self.set_format(fmt, index, block_size, dtype, page_stride)
        self.set_undo_tokens(spec_query_tokens(vllm_config))
        self.layer_name, self._block_basis = layer_name, basis

    def set_format(
        self, fmt: KVFormat, index: int, block_size: int, model_dtype: torch.dtype, page_stride: int = 0
    ) -> None:
        """Use ``fmt`` for this layer (codec seeded per layer index; raw fields in the model's 16-bit dtype)."""
        self.layout = layout_for(fmt, self.head_size, block_size, page_stride)
        raw = model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.float16
        transform = layer_key_transform(index) if fmt.key_mode == "klt" else None
        self.codec = KVCodec(
            fmt, self.head_size, seed=derive_seed(fmt.seed, index), raw_dtype=raw, key_transform=transform
        )
        self.fmt = fmt
        self.index = index
        self._checked_pages = False

    def set_undo_tokens(self, tokens: int) -> None:
        """Speculative decoding's longest verification row (0: none): steps of up to this many tokens save the ring
        columns they overwrite, so the next step can put back those of rejected draft tokens."""
        assert self.fmt is not None  # set_format ran
        R = self.fmt.buffer_tokens
        if R and tokens > R:
            raise ConfigError(
                f"layer {self.index}: speculative decoding verifies up to {tokens} tokens per step, more than the "
                f"exact window of {R} tokens (buffer.recent_tokens) can take back; use fewer speculative tokens"
            )
        self.undo_tokens = tokens if R else 0

    def adopt(self, spec) -> None:
        """Take the page vLLM finally grouped this layer with (it may scale the block size of a spec)."""
        layout = layout_of_spec(spec, self.head_size)
        if layout != self.layout:
            assert self.fmt is not None and self.index is not None and self.codec is not None  # configured first
            self.set_format(self.fmt, self.index, layout.block_size, self.codec.raw_dtype, layout.page_stride)

    def kv_cache_spec(self):
        """The spec vLLM sizes this layer's cache from."""
        assert self.layout is not None and self.fmt is not None  # configure() ran
        return make_spec(
            self.layout.block_size,
            self.num_kv_heads,
            self.head_size,
            self.fmt,
            self.layout,
            self.extras.sliding_window,
        )

    def recent_pool_shape(self, rows: int) -> tuple[int, int, int, int]:
        """[rows + 1 scratch, H, R, D]."""
        assert self.fmt is not None  # configure() ran
        return (rows + 1, self.num_kv_heads, self.fmt.buffer_tokens, self.head_size)

    def allocate_recent(self, rows: int, device: torch.device, dtype: torch.dtype) -> None:
        """Allocate the fp16 ring pools (once per shape)."""
        shape = self.recent_pool_shape(rows)
        if self.recent_k is None or tuple(self.recent_k.shape) != shape or self.recent_k.device != device:
            self.recent_k = torch.zeros(shape, dtype=dtype, device=device)
            self.recent_v = torch.zeros(shape, dtype=dtype, device=device)
        undo = (shape[0], shape[1], self.undo_tokens, shape[3])
        if not self.undo_tokens:
            self.undo_k = self.undo_v = None
        elif self.undo_k is None or tuple(self.undo_k.shape) != undo or self.undo_k.device != device:
            self.undo_k = torch.zeros(undo, dtype=dtype, device=device)
            self.undo_v = torch.zeros(undo, dtype=dtype, device=device)

    def rewind_ring(self, rows: torch.Tensor, ring_cols: torch.Tensor, undo_cols: torch.Tensor) -> None:
        """Ring column ``ring_cols[i]`` of row ``rows[i]`` gets back its undo column ``undo_cols[i]`` (a Rewind)."""
        if self.undo_k is None or self.recent_k is None or self.recent_v is None or self.undo_v is None:
            return
        self.recent_k[rows, :, ring_cols] = self.undo_k[rows, :, undo_cols]
        self.recent_v[rows, :, ring_cols] = self.undo_v[rows, :, undo_cols]

    @torch.inference_mode()  # vLLM allocates its caches as inference tensors: outside it, in-place writes are refused
    def warm_up(
        self,
        kv_cache: torch.Tensor,
        max_rows: int = 16,
        table_width: int | None = None,
        max_len: int | None = None,
        budget: int = 2048,
    ) -> None:
        """Run this layer's write, prefill and eager decode paths on vLLM's null block (block 0, never a request's)
        and the scratch ring row, so Triton compiles at engine start, not in the first request's TTFT (on an H200
        without it the first 32k prompt waited 12.3 s, later ones ~6 s; with a warm-up that missed specializations
        the first 8k request took 2.48 s vs FA3's 0.61 s).

        The launches take the shapes a request's do, so they compile the same specializations
        (tests/integrations/vllm/test_vllm_warmup.py checks it): block tables ``table_width`` columns wide (vLLM's
        ``cdiv(max_model_len, block_size)``: their row stride is a kernel argument); chunks of ``_warm_up_lengths``
        tokens, each first, over a short history and ending at the table's capacity (the prefill workspace's segment
        flags); decode batches
        of every row count 1..``max_rows`` (max_num_seqs: the split count, hence its int classes and the reduce
        width, follows the batch); with speculative decoding, batches of 1..``max_rows`` verification rows of each
        length 2..``undo_tokens``. Row counts that share a specialization launch again without compiling."""
        if self.layout is None or self.recent_k is None or kv_cache.numel() == 0:
            return
        fmt = self.fmt
        assert fmt is not None  # set with the layout
        dev, dtype, bs = kv_cache.device, self.recent_k.dtype, self.layout.block_size
        scratch = self.recent_k.shape[0] - 1
        hist = -(-(bs + fmt.buffer_tokens) // bs) * bs  # enough that some history is read compressed
        lengths = _warm_up_lengths(self.num_heads, min(budget, max_len or budget))
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
                recent_tokens=fmt.buffer_tokens,
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
                np.diff(md.query_start_loc), md.seq_lens, md.ring_rows, fmt.buffer_tokens, md.block_window, t
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
            q = torch.zeros(n, self.num_heads, self.head_size, dtype=dtype, device=dev)
            kv = torch.zeros(n, self.num_kv_heads, self.head_size, dtype=dtype, device=dev)
            self._write(kv, kv, kv_cache, md.slot_mapping, md)
            self._forward_eager(q, kv, kv, kv_cache, md, torch.empty_like(q))

        for n in lengths:  # a first chunk, one over a short history, one ending at the table's capacity
            for ctx in sorted({c for c in (0, hist, width * bs - n) if 0 <= c <= width * bs - n}):
                step(meta([n], [ctx], 0))
        for rows in range(1, max(1, max_rows) + 1):
            step(meta([1] * rows, [hist + 1] * rows, rows))
        as_decode = fmt.key_mode != "klt" and not self.reproducible  # the builder's rule (``_spec_as_decode``)
        for t in range(2, self.undo_tokens + 1):  # speculative verification rows: one launch per length, any count
            for rows in range(1, max(1, max_rows) + 1):
                step(meta([t] * rows, [hist + 1] * rows, 0))  # a row among prefill chunks: the prefill kernel
                if as_decode:  # a step of uniform verification rows: the multi-token decode kernel
                    step(verify_meta(t, rows, hist + 1))

    # ---------------------------------------------------------------- write path
    def do_kv_cache_update(
        self,
        layer: torch.nn.Module | None,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        self._write(key, value, kv_cache, slot_mapping, None)

    def _write(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        md: TurboQuantMetadata | None,
    ) -> None:
        """Compress-on-write of the step's tokens; ``md``: the step's metadata (None: vLLM's forward context)."""
        n = min(key.shape[0], slot_mapping.shape[0])
        assert self.layout is not None and self.codec is not None  # configure() ran
        positions = self._write_positions(n, key.device, md) if self.codec.key_coder is not None else None
        ops.write(key[:n], value[:n], slot_mapping[:n], kv_cache, self.layout, self.codec, positions=positions)

    def _write_positions(self, n: int, device: torch.device, md: TurboQuantMetadata | None) -> torch.Tensor:
        """Each written token's position in its request (klt keys are coded at it), from the step's metadata: in a
        decode-only step (the one CUDA graphs capture) the builder's persistent device buffer, else one device copy
        per step shared by every layer; zeros in the profile run (no metadata: nothing is kept)."""
        if md is None:
            from vllm.forward_context import get_forward_context

            raw = get_forward_context().attn_metadata
            if raw is None:
                return torch.zeros(n, dtype=torch.int64, device=device)
            per_layer = raw[0] if isinstance(raw, list) else raw
            found = per_layer.get(self.layer_name or "") if isinstance(per_layer, dict) else None
            if not isinstance(found, TurboQuantMetadata):
                raise ShapeError(f"{self.layer_name}: no jetson-tq metadata in this step to place its klt keys")
            md = found
        if md.dec_positions is not None and md.num_decodes == md.num_reqs and n <= md.dec_positions.shape[0]:
            return md.dec_positions[:n]  # padding rows past num_decodes write to slot -1: never stored
        key = f"positions{n}"
        if key not in md.device_ints:  # the step's first klt layer: every later one reuses the device copy
            qsl = md.query_start_loc
            q_lens = np.diff(qsl)
            req = np.repeat(np.arange(md.num_reqs), q_lens)
            pos = md.context_lens[req] + (np.arange(req.size) - qsl[req])
            out = np.zeros(n, dtype=np.int64)
            out[: min(n, pos.size)] = pos[:n]
            _device_ints(md, key, device, (out, torch.int64))
        return md.device_ints[key][0]

    # ---------------------------------------------------------------- read path
    def _paged(self, pages, block_table, comp, rec, rows) -> PagedKV:
        assert self.recent_k is not None and self.recent_v is not None  # _check ran (pool allocated)
        assert self.layout is not None and self.codec is not None
        return PagedKV(pages, block_table, comp, self.recent_k, self.recent_v, rec, rows, self.layout, self.codec)

    def _check(self, kv_cache: torch.Tensor, md: TurboQuantMetadata) -> None:
        assert self.layout is not None and self.fmt is not None  # configure() ran
        if kv_cache.dim() != 3 or kv_cache.shape[1:] != (self.num_kv_heads, self.layout.page_bytes):
            raise ShapeError(
                f"{self.layer_name}: KV cache expected [blocks, {self.num_kv_heads}, "
                f"{self.layout.page_bytes}], got {tuple(kv_cache.shape)}"
            )
        if (
            md.recent_tokens != self.fmt.buffer_tokens
            or md.block_window != (self.fmt.block_window and md.recent_tokens > 0)
            or self.recent_k is None
        ):
            raise ShapeError(
                f"{self.layer_name}: recent buffer of {self.fmt.buffer_tokens} tokens ({self.fmt.window} "
                f"window) expected, metadata has {md.recent_tokens} (block window {md.block_window}), "
                f"pool {'missing' if self.recent_k is None else 'ok'}"
            )
        self._checked_pages = True

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TurboQuantMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedPlatformError("jetson-tq's vLLM backend does not fuse output quantization")
        if attn_metadata is None:  # profiling / warm-up run without a KV cache
            return output.zero_()
        md = attn_metadata
        if not self._checked_pages:
            self._check(kv_cache, md)
        if md.num_decodes and ops.graph_safe(query.device) and md.num_decodes == md.num_reqs and not self.reproducible:
            self._decode_graph_safe(query, key, value, kv_cache, md, output)
        else:
            self._forward_eager(query, key, value, kv_cache, md, output)
        return output

    def _decode_graph_safe(self, query, key, value, kv_cache, md: TurboQuantMetadata, output) -> None:
        """A decode-only batch with device tensors only (capturable): token i belongs to row i (T tokens of
        verification rows: tokens [i T, (i + 1) T), ``_verify_rows``)."""
        nd = md.num_decodes
        if md.dec_query_tokens > 1:
            self._verify_rows(query, key, value, kv_cache, md, output)
            return
        if md.recent_tokens > 0:
            assert self.recent_k is not None and self.recent_v is not None  # _check ran
            self.recent_k[md.dec_ring_rows, :, md.dec_ring_cols] = key[:nd].to(self.recent_k.dtype)
            self.recent_v[md.dec_ring_rows, :, md.dec_ring_cols] = value[:nd].to(self.recent_v.dtype)
        kv = self._paged(kv_cache, md.block_table[:nd], md.dec_compressed_lens, md.dec_recent_lens, md.dec_ring_rows)
        output[:nd] = ops.decode(query[:nd], kv, self.scale, extras=self.extras)

    def _verify_rows(self, query, key, value, kv_cache, md: TurboQuantMetadata, output) -> None:
        """The leading ``num_decodes`` verification rows of T = ``dec_query_tokens`` tokens each in one multi-token
        decode over their histories (device buffers only: capturable), then the ring columns their tokens take go to
        the undo pool (rejected drafts: ``recent.Rewind``) and their tokens into the ring."""
        nd, t, R = md.num_decodes, md.dec_query_tokens, md.recent_tokens
        n = nd * t
        kv = self._paged(kv_cache, md.block_table[:nd], md.dec_compressed_lens, md.dec_recent_lens, md.dec_ring_rows)
        q = query[:n].view(nd, t, *query.shape[1:])
        k, v = key[:n].view(nd, t, *key.shape[1:]), value[:n].view(nd, t, *value.shape[1:])
        out = ops.decode(q, kv, self.scale, extras=self.extras, k=k, v=v)
        output[:n] = out.reshape(n, *out.shape[2:]).to(output.dtype)
        if R > 0:
            assert self.recent_k is not None and self.recent_v is not None  # _check ran
            assert md.dec_token_cols is not None  # the builder fills it with dec_query_tokens > 1
            ring_rows, cols = md.dec_ring_rows[:, None].expand(nd, t), md.dec_token_cols
            if self.undo_k is not None and self.undo_v is not None:
                undo_cols = torch.arange(t, device=query.device).expand(nd, t)
                self.undo_k[ring_rows, :, undo_cols] = self.recent_k[ring_rows, :, cols]
                self.undo_v[ring_rows, :, undo_cols] = self.recent_v[ring_rows, :, cols]
            self.recent_k[ring_rows, :, cols] = k.to(self.recent_k.dtype)
            self.recent_v[ring_rows, :, cols] = v.to(self.recent_v.dtype)

    def _forward_eager(self, query, key, value, kv_cache, md: TurboQuantMetadata, output) -> None:
        dev, R = query.device, md.recent_tokens
        qsl, seq, ctx, rows = md.query_start_loc, md.seq_lens, md.context_lens, md.ring_rows
        q_lens = np.diff(qsl)
        if md.dec_query_tokens > 1 and md.num_decodes:  # leading uniform verification rows: the decode path
            self._verify_rows(query, key, value, kv_cache, md, output)
        dec = np.nonzero((q_lens[: md.num_decodes] == 1) & (seq[: md.num_decodes] > 0))[0]
        if dec.size and self.reproducible:
            self._decode_as_prefill(query, key, value, kv_cache, md, output, dec)
        elif dec.size:
            L = seq[dec]
            rec = exact_count(L, R, md.block_window)
            tok, ring_rows, cols, idx, comp_d, rec_d = _device_ints(
                md,
                "decode",
                dev,
                (qsl[dec], torch.int64),
                (rows[dec], torch.int64),
                ((L - 1) % max(R, 1), torch.int64),
                (dec, torch.int64),
                (L - rec, torch.int32),
                (rec, torch.int32),
            )
            if R > 0:
                assert self.recent_k is not None and self.recent_v is not None  # _check ran
                self.recent_k[ring_rows, :, cols] = key[tok].to(self.recent_k.dtype)
                self.recent_v[ring_rows, :, cols] = value[tok].to(self.recent_v.dtype)
            kv = self._paged(kv_cache, md.block_table[idx], comp_d, rec_d, ring_rows)
            output[tok] = ops.decode(query[tok], kv, self.scale, extras=self.extras).to(output.dtype)
        pre = np.arange(md.num_decodes, md.num_reqs)
        if self.undo_tokens:  # speculative verification rows: one launch per row length, not one per request
            short = (q_lens[pre] > 1) & (q_lens[pre] <= self.undo_tokens)
            for t in np.unique(q_lens[pre][short]).tolist():
                self._forward_rows(query, key, value, kv_cache, md, output, pre[short & (q_lens[pre] == t)], t)
            pre = pre[~short]
        ctx_p = ctx[pre]
        ring_p = ctx_p % R if md.block_window else np.minimum(ctx_p, R)  # history tokens read from the ring
        comp_all, rec_all, row_all = _device_ints(
            md,
            "prefill",
            dev,
            (ctx_p - ring_p, torch.int32),
            (ring_p, torch.int32),
            (rows[pre], torch.int64),
            per_row=True,
        )
        for j, i in enumerate(pre.tolist()):
            qs, qe, s = int(qsl[i]), int(qsl[i + 1]), int(ctx[i])
            if qe <= qs:
                continue
            row = int(rows[i])
            kv = self._paged(
                kv_cache,
                md.block_table[i : i + 1],
                comp_all[j, :1],
                rec_all[j, :1],
                row_all[j, :1],
            )
            q = query[qs:qe].transpose(0, 1).unsqueeze(0)
            k = key[qs:qe].transpose(0, 1).unsqueeze(0)
            v = value[qs:qe].transpose(0, 1).unsqueeze(0)
            out = ops.prefill(
                q,
                k,
                v,
                kv,
                self.scale,
                max_tokens=s + qe - qs,
                reproducible=self.reproducible,
                varlen=prefill_varlen(s, qe - qs),
                history=[s],
                extras=self.extras,
            )
            output[qs:qe] = out[0].transpose(0, 1).to(output.dtype)
            if R > 0:
                assert self.recent_k is not None and self.recent_v is not None  # _check ran
                j0 = max(0, (qe - qs) - R)
                cols = torch.arange(s + j0, s + qe - qs, device=dev) % R
                row_idx = torch.full_like(cols, row)  # two index tensors around ':' -> [n, H, D], as key rows are
                if self.undo_k is not None and self.undo_v is not None and qe - qs <= self.undo_tokens:
                    undo_cols = torch.arange(qe - qs, device=dev)  # a verification row: its drafts may be rejected
                    self.undo_k[row_idx, :, undo_cols] = self.recent_k[row_idx, :, cols]
                    self.undo_v[row_idx, :, undo_cols] = self.recent_v[row_idx, :, cols]
                self.recent_k[row_idx, :, cols] = key[qs + j0 : qe].to(self.recent_k.dtype)
                self.recent_v[row_idx, :, cols] = value[qs + j0 : qe].to(self.recent_v.dtype)

    def _forward_rows(self, query, key, value, kv_cache, md: TurboQuantMetadata, output, sel: np.ndarray, t: int):
        """Rows ``sel`` of ``t`` tokens each (speculative verification rows: the last sampled token and its drafts)
        in one prefill launch: each a chunk over its own history (compressed + ring), causal inside, as the
        per-request loop computes it; then the ring columns they overwrite go to the undo pool and their tokens to
        the ring."""
        dev, R, n = query.device, md.recent_tokens, len(sel)
        s = md.context_lens[sel]
        r = s % R if (md.block_window and R > 0) else np.minimum(s, R)  # history tokens the ring holds
        tok, idx, comp, rec, rows, cols = _device_ints(
            md,
            f"rows{t}",
            dev,
            (md.query_start_loc[sel][:, None] + np.arange(t), torch.int64),
            (sel, torch.int64),
            (s - r, torch.int32),
            (r, torch.int32),
            (md.ring_rows[sel], torch.int64),
            ((s[:, None] + np.arange(t)) % max(R, 1), torch.int64),
        )
        tok, cols = tok.view(n, t), cols.view(n, t)
        kv = self._paged(kv_cache, md.block_table[idx], comp, rec, rows)
        q, k, v = (x[tok].permute(0, 2, 1, 3) for x in (query, key, value))  # [rows, H, t, D]
        out = ops.prefill(q, k, v, kv, self.scale, max_tokens=int(s.max()) + t, reproducible=self.reproducible)
        output[tok] = out.permute(0, 2, 1, 3).to(output.dtype)
        if R > 0:
            assert self.recent_k is not None and self.recent_v is not None  # _check ran
            ring_rows = rows[:, None].expand(n, t)
            if self.undo_k is not None and self.undo_v is not None:
                undo_cols = torch.arange(t, device=dev).expand(n, t)
                self.undo_k[ring_rows, :, undo_cols] = self.recent_k[ring_rows, :, cols]
                self.undo_v[ring_rows, :, undo_cols] = self.recent_v[ring_rows, :, cols]
            self.recent_k[ring_rows, :, cols] = key[tok].to(self.recent_k.dtype)
            self.recent_v[ring_rows, :, cols] = value[tok].to(self.recent_v.dtype)

    def _decode_as_prefill(self, query, key, value, kv_cache, md: TurboQuantMetadata, output, dec: np.ndarray) -> None:
        """Reproducible mode: decode rows ``dec`` as one-token prefill chunks in one launch, so a position's output
        is bitwise what a prompt chunk holding it computes (after a preemption vLLM recomputes generated tokens as
        a prompt) and does not depend on the other rows. The ring gets the new token after attention, as for a
        chunk."""
        dev, R = query.device, md.recent_tokens
        tok = torch.from_numpy(md.query_start_loc[dec]).to(dev)
        s = md.seq_lens[dec] - 1  # history before the new token
        r = s % R if (md.block_window and R > 0) else np.minimum(s, R)  # history tokens the ring holds
        ring_rows = torch.from_numpy(md.ring_rows[dec]).to(dev)
        kv = self._paged(
            kv_cache,
            md.block_table[torch.from_numpy(dec).to(dev)],
            torch.from_numpy(s - r).to(dev, torch.int32),
            torch.from_numpy(r).to(dev, torch.int32),
            ring_rows,
        )
        q, k, v = (x[tok].unsqueeze(2) for x in (query, key, value))  # [rows, H, 1, D]
        out = ops.prefill(q, k, v, kv, self.scale, max_tokens=int(s.max()) + 1, reproducible=True, extras=self.extras)
        output[tok] = out[:, :, 0].to(output.dtype)
        if R > 0:
            assert self.recent_k is not None and self.recent_v is not None  # _check ran
            cols = torch.from_numpy(s % R).to(dev)
            self.recent_k[ring_rows, :, cols] = key[tok].to(self.recent_k.dtype)
            self.recent_v[ring_rows, :, cols] = value[tok].to(self.recent_v.dtype)
