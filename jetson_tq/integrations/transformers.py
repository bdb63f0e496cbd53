"""TurboQuantCache: a drop-in compressed KV cache for ``model.generate()`` / forward of full-attention decoders
(Llama, Qwen2/3, Mistral, Phi-3, Gemma, Granite, OLMo-2, ...; transformers 5.17).

How it plugs in (transformers' own extension points, no patching of model code):

- ``TurboQuantCache`` is a ``transformers.Cache`` whose layers hold a ``CompressedKVCache`` each, in
  the format the YAML config gives that layer (``TurboQuantConfig.format_for_layer``).
- ``Cache.update`` does not hand back dequantized keys: it returns a ``PendingChunk`` (the new
  tokens' K/V plus the layer), which only our attention function understands.
- The attention function is registered in ``AttentionInterface`` as ``"turboquant"`` (plus a mask
  function in ``AttentionMaskInterface``). For a ``PendingChunk`` it scores the query against the
  compressed history with the rotated query (reference attention on CPU, the kernel dispatcher on
  CUDA), then appends the chunk. For any other cache it is plain SDPA, so a model switched to
  ``"turboquant"`` still runs with ``DynamicCache``.

Usage::

    from jetson_tq.integrations.transformers import TurboQuantCache
    cache = TurboQuantCache(model, "mse_k4v3")       # switches the model's attention to "turboquant"
    cache = TurboQuantCache(model, "auto")           # the 5x calibrated format: calibrated once per model, cached
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)

Convention: a ``None`` mask means causal with the query at the end of the sequence (lower-right);
padding or custom patterns arrive as a boolean [B, 1, T, kv_len] mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, prepare_padding_mask, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from .. import ops
from ..cache.compressed import CompressedKVCache
from ..codec.klt import KeyTransform, load_transforms_cached
from ..codec.rotation import derive_seed
from ..config import DEFAULT_PRESET, TurboQuantConfig, is_auto, load_config, resolve_auto
from ..errors import ConfigError, ShapeError, UnsupportedModelError
from ..format import KVFormat

ATTN_IMPLEMENTATION = "turboquant"
#: None: the process setting (``JETSON_TQ_BACKEND``, see ``jetson_tq.ops``); auto: Triton kernels for CUDA tensors,
#: the PyTorch reference on CPU; reference / triton: that one. Evaluation code may add history backends by name
#: (``register_history_backend``; ``lab.eval`` adds "cpu-decoded").
BACKENDS: tuple[str | None, ...] = (None, *ops.BACKENDS)

#: name -> factory(CompressedKVCache, sink_tokens) of an object with ``attend(query, key, value, scaling, mask=None)``
#: that replaces the ops path for one layer (an evaluation shortcut, e.g. tokens decoded once on the CPU).
HISTORY_BACKENDS: dict[str, Callable[[CompressedKVCache, int], Any]] = {}


def register_history_backend(name: str, factory: Callable[[CompressedKVCache, int], Any]) -> None:
    """Make ``backend=name`` build ``factory(store, sink_tokens)`` per layer and attend through it instead of
    ``jetson_tq.ops``."""
    if name in BACKENDS:
        raise ConfigError(f"history backend {name!r}: the name is taken by an ops backend {BACKENDS}")
    HISTORY_BACKENDS[name] = factory


def backend_names() -> tuple[str | None, ...]:
    """Every accepted ``backend`` value: the ops backends and the registered history backends."""
    return (*BACKENDS, *HISTORY_BACKENDS)


# ---------------------------------------------------------------------------------------------- model checks
def model_dims(config) -> tuple[int, int, int, int]:
    """(num_layers, num_query_heads, num_kv_heads, head_dim) of a decoder config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, heads, kv_heads, head_dim


def check_model_supported(config) -> None:
    """Raise UnsupportedModelError unless ``config`` is a decoder whose every layer is plain causal attention (by its
    features: layer types, sliding window, logit soft-capping, grouped heads; not by its name)."""
    if getattr(config, "num_attention_heads", None) is None or getattr(config, "num_hidden_layers", None) is None:
        raise UnsupportedModelError(
            f"{getattr(config, 'model_type', None)!r}: not a decoder config with attention heads"
        )
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    slides = getattr(config, "use_sliding_window", getattr(config, "sliding_window", None) is not None)
    if other or (not layer_types and slides) or getattr(config, "use_sliding_window", False):
        raise UnsupportedModelError(
            f"only full-attention layers are supported, this model has {other or ['sliding_attention']}"
        )
    if getattr(config, "attn_logit_softcapping", None):
        raise UnsupportedModelError("attention logit soft-capping is not supported by TurboQuantCache")
    _, heads, kv_heads, head_dim = model_dims(config)
    if heads % kv_heads:
        raise UnsupportedModelError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if head_dim < 2:
        raise UnsupportedModelError(f"head_dim: expected >= 2, got {head_dim}")


def resolve_config(config: str | TurboQuantConfig | KVFormat) -> TurboQuantConfig:
    """A preset name / YAML path / TurboQuantConfig / single KVFormat (every layer) -> TurboQuantConfig."""
    if isinstance(config, TurboQuantConfig):
        return config
    if isinstance(config, KVFormat):
        return TurboQuantConfig(name="custom", default=config)
    if isinstance(config, str):
        return load_config(config)
    raise ConfigError(
        f"config: expected a preset name, a YAML path, a TurboQuantConfig or a KVFormat, got {type(config).__name__}"
    )


# ---------------------------------------------------------------------------------------------- cache layer
class PendingChunk:
    """The K/V of the tokens a layer is processing now; only the ``turboquant`` attention may consume it."""

    __slots__ = ("layer", "key", "value")

    def __init__(self, layer: TurboQuantLayer, key: torch.Tensor, value: torch.Tensor) -> None:
        self.layer, self.key, self.value = layer, key, value

    def __getattr__(self, name: str):
        raise UnsupportedModelError(
            f"TurboQuantCache feeds compressed K/V only to attn_implementation={ATTN_IMPLEMENTATION!r}, but the "
            f"model's attention asked for .{name}; build the cache with the model (TurboQuantCache(model, ...)) "
            f"or call enable_turboquant(model)"
        )


class TurboQuantLayer(CacheLayerMixin):
    """One attention layer's compressed cache (a ``CompressedKVCache`` created on the first update)."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(
        self,
        fmt: KVFormat,
        layer_idx: int,
        seed: int,
        backend: str | None = None,
        center: tuple[torch.Tensor, torch.Tensor] | None = None,
        sink_tokens: int = 0,
        key_transform: KeyTransform | None = None,
    ) -> None:
        super().__init__()
        if backend not in backend_names():
            raise ConfigError(f"backend: expected one of {backend_names()}, got {backend!r}")
        self.fmt, self.layer_idx, self.seed, self.backend = fmt, layer_idx, seed, backend
        self.center = center  # (key, value) offsets [H, D] subtracted from every token stored (KVCenters)
        if sink_tokens and backend != "cpu-decoded":
            raise ConfigError(f"sink_tokens: only the cpu-decoded backend reads sinks exactly, got backend {backend!r}")
        self.sink_tokens = sink_tokens
        self.key_transform = key_transform  # klt keys: the layer's calibrated transform
        self.store: CompressedKVCache | None = None
        self.decoded: Any = None

    def __repr__(self) -> str:
        fmt = self.fmt
        return f"TurboQuantLayer({self.layer_idx}, {fmt.key_mode}{fmt.key_bits}/{fmt.value_mode}{fmt.value_bits})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.store = CompressedKVCache(
            self.fmt,
            h,
            d,
            b,
            device=key_states.device,
            dtype=key_states.dtype,
            seed=self.seed,
            key_transform=self.key_transform,
        )
        factory = HISTORY_BACKENDS.get(self.backend) if self.backend is not None else None
        sinks = max(self.sink_tokens, self.fmt.sink_tokens)
        self.decoded = factory(self.store, sinks) if factory is not None else None
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Hold the new tokens for the attention call; they are appended after attention reads the history."""
        if key_states.dim() != 4 or key_states.shape != value_states.shape:
            raise ShapeError(
                f"key/value states: expected one shape [B, H, T, D], got "
                f"{tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        s = self.store
        assert s is not None  # lazy_initialization built it
        if (key_states.shape[0], key_states.shape[1], key_states.shape[3]) != (
            s.batch_size,
            s.num_kv_heads,
            s.head_dim,
        ):
            raise ShapeError(
                f"layer {self.layer_idx}: expected K/V [{s.batch_size}, {s.num_kv_heads}, T, {s.head_dim}] "
                f"(batch fixed at the first forward), got {tuple(key_states.shape)}"
            )
        chunk = PendingChunk(self, *self._centered(key_states, value_states))
        return chunk, chunk

    def _centered(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [B, H, T, D] minus the layer's offsets: every key the attention reads moves by the same vector per
        head, so the softmax is unchanged; the value offset is added back to the output (``attend``)."""
        if self.center is None:
            return k, v
        ck, cv = (c.to(k.device, k.dtype)[None, :, None, :] for c in self.center)
        return k - ck, v - cv

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store K/V [B, H, T, D] directly (e.g. a prompt prefilled elsewhere), compressing past the buffer."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k, v = self._centered(key_states, value_states)
        if self.decoded is not None:
            self.decoded.note_exact(k, v)
        assert self.store is not None  # lazy_initialization built it
        self.store.append(k, v)

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float
    ) -> torch.Tensor:
        """Attention of query [B, Hq, T, D] over history + chunk, then the chunk is stored -> [B, Hq, T, D].

        Positions older than ``fmt.exact_start(p)`` (p + 1 - R, or p's own R-token block) are read compressed, the
        rest exactly (decode and prefill alike).
        """
        out = self._attend(query, key, value, mask, scaling)
        if self.center is None:
            return out
        cv = self.center[1].to(out.device, out.dtype)
        return out + cv.repeat_interleave(query.shape[1] // cv.shape[0], 0)[None, :, None, :]

    def _attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float
    ) -> torch.Tensor:
        store = self.store
        assert store is not None  # update() initialized the layer before attention runs
        if self.decoded is not None:
            self.decoded.note_exact(key, value)
        if mask is None and query.shape[2] == 1:
            store.append(key, value)
            if self.decoded is not None:
                return self.decoded.attend(query, None, None, scaling)
            return ops.decode(query[:, :, 0], store.paged(), scaling, self.backend).unsqueeze(2)
        store.stage(key, value)
        if self.decoded is not None:
            out = self.decoded.attend(query, key, value, scaling, mask)
        else:
            out = ops.prefill(query, key, value, store.paged(), scaling, self.backend, mask)
        store.commit(key, value)
        return out

    def get_seq_length(self) -> int:
        return 0 if self.store is None else int(self.store.lengths.max())

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store, self.decoded, self.is_initialized = None, None, False

    def used_bytes(self) -> int:
        return 0 if self.store is None else self.store.used_bytes()

    def _unsupported(self, what: str):
        raise UnsupportedModelError(f"TurboQuantCache does not support {what} (greedy/sampling generation only)")

    def reorder_cache(self, beam_idx) -> None:
        self._unsupported("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("cropping (assisted / speculative decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("expanding the batch of a filled cache (num_return_sequences > 1 / beams)")

    def batch_select_indices(self, indices) -> None:
        self._unsupported("selecting batch rows of a filled cache")

    def offload(self) -> None:
        self._unsupported("offloading")


# ---------------------------------------------------------------------------------------------- the cache
def append_prefilled(cache: Cache, layers: int, append: Callable[[int, torch.Tensor, torch.Tensor], None]) -> None:
    """Every layer of a prefilled (Dynamic-layer) ``cache`` of ``layers`` layers through ``append(layer_idx, keys,
    values)``: how a cache of ours (or the lab's simulated one) takes over an exact prefill."""
    if len(cache.layers) != layers:
        raise ShapeError(f"cache: expected {layers} layers, got {len(cache.layers)}")
    for i, layer in enumerate(cache.layers):
        filled = cast(DynamicLayer, layer)  # a prefilled (Dynamic-layer) cache, as the docstring says
        append(i, cast(torch.Tensor, filled.keys), cast(torch.Tensor, filled.values))


class TurboQuantCache(Cache):
    """A transformers ``Cache`` storing every layer's K/V in its TurboQuant format (per-layer from the YAML config)."""

    def __init__(
        self,
        model_or_config,
        config: str | TurboQuantConfig | KVFormat = DEFAULT_PRESET,
        *,
        backend: str | None = None,
        enable: bool = True,
        centers: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        sink_tokens: int = 0,
        key_transforms: list[KeyTransform | None] | None = None,
        tokenizer: Any = None,
    ) -> None:
        """``centers``: per-layer (key, value) offsets [H, D] subtracted from every stored token (exact under the
        softmax; the value offset is added back; klt layers take only the value offset, their transform centers the
        keys) and ``sink_tokens``: the first positions read exactly (cpu-decoded backend only) are the measurement
        levers of docs/fidelity.md "Quality at 5x", not served by the kernels. ``key_transforms``: per-layer
        calibrated key transforms for klt formats (default: the config's ``key_transform`` file).

        ``config="auto"``: the model's calibrated format, calibrated on first use from its weights and the text
        shipped with the package (``tokenizer``: default the model's own, from its ``name_or_path``) and cached by
        model identity; a model that cannot be calibrated gets ``config.FALLBACK_PRESET`` with one log line."""
        model = model_or_config if hasattr(model_or_config, "config") and hasattr(model_or_config, "forward") else None
        hf_config = model.config if model is not None else model_or_config
        hf_config = hf_config.get_text_config(decoder=True) if hasattr(hf_config, "get_text_config") else hf_config
        check_model_supported(hf_config)
        n_layers, _, _, head_dim = model_dims(hf_config)
        if is_auto(config):
            if model is None:
                raise ConfigError("config 'auto' calibrates from the model's weights: pass the model, not its config")
            config = resolve_auto("model", model, tokenizer=tokenizer)
        self.tq_config = resolve_config(config)
        self.tq_config.check_model(n_layers, head_dim)
        self.head_dim = head_dim
        transforms = _key_transforms(self.tq_config, hf_config, model, key_transforms)
        layers: list[TurboQuantLayer] = []
        for i in range(n_layers):
            fmt = self.tq_config.format_for_layer(i, n_layers)
            center = None if centers is None or fmt.is_passthrough else centers[i]
            if center is not None and fmt.key_mode == "klt":
                center = (torch.zeros_like(center[0]), center[1])
            sinks = 0 if fmt.is_passthrough else sink_tokens
            transform = transforms[i] if fmt.key_mode == "klt" else None
            layers.append(TurboQuantLayer(fmt, i, derive_seed(fmt.seed, layer=i), backend, center, sinks, transform))
        super().__init__(layers=cast(list, layers))  # Cache types its list as the base layer classes
        if model is not None and enable:
            enable_turboquant(model)

    @property
    def formats(self) -> list[KVFormat]:
        """The format of each layer."""
        return [layer.fmt for layer in self._tq_layers]

    @property
    def _tq_layers(self) -> list[TurboQuantLayer]:
        """The layers, as built in __init__ (typed as such)."""
        return cast("list[TurboQuantLayer]", self.layers)

    def append(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store precomputed K/V [B, H, T, D] of one layer (e.g. copied from a DynamicCache after a shared prefill)."""
        self._tq_layers[layer_idx].append(key_states, value_states)

    def load_from(self, cache: Cache) -> TurboQuantCache:
        """Compress every layer of another cache (e.g. a ``DynamicCache`` filled by an exact prefill) into this one."""
        append_prefilled(cache, len(self.layers), self.append)
        return self

    def used_bytes(self) -> int:
        """Bytes the stored tokens occupy (compressed tokens at their format's size + fp buffers)."""
        return sum(layer.used_bytes() for layer in self._tq_layers)


def _key_transforms(
    cfg: TurboQuantConfig, hf_config, model, given: list[KeyTransform | None] | None
) -> list[KeyTransform | None]:
    """Per layer the calibrated key transform of the klt layers (None elsewhere), from ``given`` or the config's
    file, checked against the model's layers, KV heads, head dim and RoPE frequencies."""
    n_layers, _, kv_heads, head_dim = model_dims(hf_config)
    if not cfg.needs_key_transform:
        return [None] * n_layers
    if given is None:
        if not cfg.key_transform:
            raise ConfigError(
                f"config {cfg.name!r} codes keys by a calibrated transform (keys.mode klt) but names no key_transform "
                f"file; make one with `python -m jetson_tq calibrate --model DIR --out FILE` and set key_transform"
            )
        given = load_transforms_cached(cfg.key_transform)
    if len(given) != n_layers:
        raise ConfigError(f"key transforms: {len(given)} layers for a model of {n_layers}")
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    for i, t in enumerate(given):
        if cfg.format_for_layer(i, n_layers).key_mode != "klt":
            continue
        if t is None:
            raise ConfigError(f"key transforms: layer {i} codes klt keys but the calibration has no transform for it")
        if (t.num_heads, t.head_dim) != (kv_heads, head_dim):
            raise ConfigError(
                f"key transforms: layer {i} was calibrated for {t.num_heads} KV heads of dim {t.head_dim}, "
                f"the model has {kv_heads} of dim {head_dim}"
            )
        freq = getattr(rotary, "inv_freq", None)
        if freq is not None and (
            freq.numel() != t.rotary.inv_freq.numel()
            or not torch.allclose(freq.detach().float().cpu(), t.rotary.inv_freq.float(), rtol=1e-6)
        ):
            raise ConfigError("key transforms: calibrated for other RoPE frequencies than this model's")
    return given


# ---------------------------------------------------------------------------------------------- attention + mask
def turboquant_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window=None,
    **kwargs,
):
    """The ``"turboquant"`` attention: compressed history for a TurboQuantCache, plain SDPA for any other cache."""
    if not isinstance(key, PendingChunk):
        if attention_mask is None and query.shape[2] > 1 and key.shape[2] != query.shape[2]:
            attention_mask = _lower_right_causal(query.shape[2], key.shape[2], query.device)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if sliding_window is not None:
        raise UnsupportedModelError(
            f"sliding-window attention (window {sliding_window}) is not supported by TurboQuantCache"
        )
    if dropout and module.training:
        raise UnsupportedModelError("attention dropout in training mode is not supported by TurboQuantCache")
    if kwargs.get("output_attentions"):
        raise UnsupportedModelError("output_attentions is not supported by TurboQuantCache")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    out = key.layer.attend(query, key.key, key.value, attention_mask, scale)
    return out.transpose(1, 2).contiguous(), None


def _lower_right_causal(q_len: int, kv_len: int, device) -> torch.Tensor:
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
    return (torch.arange(kv_len, device=device).unsqueeze(0) <= q_pos).view(1, 1, q_len, kv_len)


def turboquant_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs,
):
    """``None`` for a plain causal mask without padding (our kernels are causal by contract), else SDPA's bool mask."""
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    plain = (
        mask_function is causal_mask_function
        and local_size is None
        and kv_offset == 0
        and q_offset + q_length == kv_length
    )
    if allow_is_causal_skip and plain and (padding is None or bool(padding[:, :kv_length].all())):
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=False,
        **kwargs,
    )


def register() -> None:
    """Make ``attn_implementation="turboquant"`` known to transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, turboquant_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, turboquant_mask)


def enable_turboquant(model) -> None:
    """Switch ``model`` to the ``"turboquant"`` attention (SDPA for non-TurboQuant caches, so nothing else changes)."""
    check_model_supported(model.config.get_text_config(decoder=True))
    register()
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise UnsupportedModelError(
            f"{type(model).__name__} refused attn_implementation={ATTN_IMPLEMENTATION!r} "
            f"(kept {model.config._attn_implementation!r})"
        )


register()
