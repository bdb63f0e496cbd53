"""The attention impl of one compressed layer: its format and page (``configure``, from the active config and the
model's page plan), its fp16 ring and undo pools, the write path (compress-on-write into vLLM's pages) and
``forward``, which picks a read route (``attend.ReadPath``).

vLLM makes one per attention layer our backend serves; the hooks configure it from the layer name once vLLM's
config is final, allocate its pools once vLLM's KV cache exists and warm its kernels up (``warmup``).
"""

from __future__ import annotations

from typing import cast

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from ... import ops
from ...attention.extras import AttentionExtras
from ...codec.kv import KVCodec
from ...codec.rotation import derive_seed
from ...errors import ConfigError, ShapeError, UnsupportedModelError, UnsupportedPlatformError
from ...format import KVFormat, PagedLayout, kernel_unsupported_reason
from .attend import ReadPath
from .metadata import TurboQuantMetadata, device_ints
from .plan import model_plan
from .settings import active_config, layer_key_transform, reproducible, spec_query_tokens
from .spec import LayerFacts, layer_format, layer_index, layout_for, layout_of_spec, make_spec, stock_reason


class TurboQuantAttentionImpl(ReadPath, AttentionImpl):
    """Writes compressed K/V into vLLM's pages and attends over them (one layer)."""

    is_jetson_tq = True  # the marker runtime.is_ours checks

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
        """Give this layer its format and page (block size, padding: ``plan.model_plan``); idempotent for one vLLM
        block size (vLLM sets it after loading the model: a speculative-decoding head may ask for specs before)."""
        basis = vllm_config.cache_config.block_size
        if self.layer_name == layer_name and self.layout is not None and self._block_basis == basis:
            return
        fmt, index = self.pick_format(layer_name, vllm_config)
        device = torch.device(cast("torch.device | str", vllm_config.device_config.device))
        block_size, page_stride = model_plan(vllm_config)[layer_name]
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
        R = self.fmt.recent_tokens
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
        return (rows + 1, self.num_kv_heads, self.fmt.recent_tokens, self.head_size)

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
            device_ints(md, key, device, (out, torch.int64))
        return md.device_ints[key][0]

    # ---------------------------------------------------------------- read path (routes: attend.ReadPath)
    def _check(self, kv_cache: torch.Tensor, md: TurboQuantMetadata) -> None:
        assert self.layout is not None and self.fmt is not None  # configure() ran
        if kv_cache.dim() != 3 or kv_cache.shape[1:] != (self.num_kv_heads, self.layout.page_bytes):
            raise ShapeError(
                f"{self.layer_name}: KV cache expected [blocks, {self.num_kv_heads}, "
                f"{self.layout.page_bytes}], got {tuple(kv_cache.shape)}"
            )
        if (
            md.recent_tokens != self.fmt.recent_tokens
            or md.block_window != (self.fmt.block_window and md.recent_tokens > 0)
            or self.recent_k is None
        ):
            raise ShapeError(
                f"{self.layer_name}: recent buffer of {self.fmt.recent_tokens} tokens ({self.fmt.window} "
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
