"""The few wraps of vLLM methods the plugin installs when the switch is on (no fork, no copied code).

- ``Attention.get_kv_cache_spec``: layers on our backend report ``TurboQuantPagedSpec`` (packed page size).
- worker ``determine_available_memory``: the recent-buffer pools are taken out of the KV budget.
- ``GPUModelRunner.initialize_kv_cache`` (the CPU runner inherits it): remembers the runner (request ids
  for recent-buffer rows) and allocates the pools once vLLM's own KV cache exists.
- ``EngineArgs.create_engine_config``: leaves prefix caching as vLLM set it (on by default) when every ring
  is a block window (``window: block``) whose block divides vLLM's block size, turns it off (logged) otherwise
  (sliding windows need the exact copies of tokens a hit skips), and on CUDA selects the CUSTOM backend
  (which the plugin registered).
Each wrap is installed once per process and calls the original first.
"""

from __future__ import annotations

import weakref

import torch

from ...errors import ConfigError
from .recent import RecentSlots, pool_bytes
from .settings import active_config, enabled, logger, preferred_block_size, sliding_windows, window_block

_RUNNER: weakref.ReferenceType | None = None
_SLOTS: RecentSlots | None = None


def current_runner():
    """The model runner of this worker process (None before its KV cache is initialized)."""
    return _RUNNER() if _RUNNER is not None else None


def recent_rows(vllm_config) -> int:
    """Rows of each recent-buffer pool (one per concurrently running request)."""
    return int(vllm_config.scheduler_config.max_num_seqs)


def recent_slots(vllm_config) -> RecentSlots:
    """The process-wide request -> ring-row map (shared by every layer's metadata builder)."""
    global _SLOTS
    if _SLOTS is None or _SLOTS.num_rows != recent_rows(vllm_config):
        _SLOTS = RecentSlots(recent_rows(vllm_config))
    return _SLOTS


def our_layers(vllm_config) -> dict:
    """Attention layers (name -> module) whose impl is jetson-tq's."""
    ctx = vllm_config.compilation_config.static_forward_context
    return {name: layer for name, layer in ctx.items() if is_ours(getattr(layer, "impl", None))}


def is_ours(impl) -> bool:
    """True for jetson-tq's attention impl (by its marker, so this module need not import the backend)."""
    return bool(getattr(impl, "is_jetson_tq", False))


def configure_all(vllm_config) -> dict:
    """Give every jetson-tq layer its format (idempotent); returns our layers."""
    layers = our_layers(vllm_config)
    for name, layer in layers.items():
        layer.impl.configure(name, vllm_config, vllm_config.cache_config.block_size)
    return layers


def recent_pool_bytes(vllm_config) -> int:
    """Bytes all recent-buffer pools take (K and V, every layer, max_num_seqs + 1 rows)."""
    elt = torch.empty((), dtype=vllm_config.model_config.dtype).element_size()
    total = 0
    for layer in configure_all(vllm_config).values():
        impl = layer.impl
        total += pool_bytes(recent_rows(vllm_config) + 1, impl.num_kv_heads, impl.fmt.buffer_tokens,
                            impl.head_size, elt)
    return total


# ------------------------------------------------------------------------------------- the wraps
def bound_cache(layer) -> torch.Tensor | None:
    """The KV cache tensor vLLM bound to an attention layer (a list per virtual engine in some versions)."""
    cache = getattr(layer, "kv_cache", None)
    if isinstance(cache, (list, tuple)):
        cache = cache[0] if cache else None
    return cache if isinstance(cache, torch.Tensor) and cache.numel() else None


def _wrap(cls, name: str, make):
    """Replace ``cls.name`` by ``make(original)`` once."""
    original = cls.__dict__.get(name)
    if original is None or getattr(original, "_jetson_tq", False):
        return
    wrapped = make(original)
    wrapped._jetson_tq = True
    wrapped.__wrapped__ = original
    setattr(cls, name, wrapped)


def _spec_wrap(original):
    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        if spec is None or not is_ours(self.impl):
            return spec
        self.impl.configure(self.layer_name, vllm_config, spec.block_size)
        return self.impl.kv_cache_spec(spec.block_size)
    return get_kv_cache_spec


def _memory_wrap(original):
    def determine_available_memory(self, *args, **kwargs):
        available = original(self, *args, **kwargs)
        reserved = recent_pool_bytes(self.vllm_config)
        if reserved:
            if reserved >= available:
                raise ConfigError(
                    f"jetson-tq recent buffers need {reserved / 2**20:.1f} MiB but the KV budget is "
                    f"{available / 2**20:.1f} MiB; lower max_num_seqs or buffer.recent_tokens")
            logger().info("jetson-tq: %.1f MiB of the KV budget reserved for fp16 recent buffers "
                           "(%d rows + 1 scratch); %.1f MiB left for compressed pages",
                           reserved / 2**20, recent_rows(self.vllm_config), (available - reserved) / 2**20)
        return available - reserved
    return determine_available_memory


def _runner_wrap(original):
    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        global _RUNNER
        _RUNNER = weakref.ref(self)
        out = original(self, kv_cache_config, *args, **kwargs)
        warmed: set = set()
        for layer in configure_all(self.vllm_config).values():
            layer.impl.allocate_recent(recent_rows(self.vllm_config), torch.device(self.device),
                                       self.model_config.dtype)
            key = (layer.impl.fmt, layer.impl.num_heads, layer.impl.num_kv_heads, layer.impl.head_size)
            cache = bound_cache(layer)
            if torch.device(self.device).type == "cuda" and cache is not None and key not in warmed:
                try:  # Triton compiles now, not in the first request (once per format)
                    layer.impl.warm_up(cache)
                except Exception as exc:  # the first request then compiles, and raises if the path is broken
                    logger().warning("jetson-tq: kernel warm-up skipped (%s: %s)", type(exc).__name__, exc)
                warmed.add(key)
        return out
    return initialize_kv_cache


def _config_wrap(original):
    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        if not enabled():  # installed by an earlier engine of this process whose switch was on
            return config
        log = logger()
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        why = prefix_caching_blocker(active_config(), config.cache_config, current_platform.is_cpu())
        if config.cache_config.enable_prefix_caching and why:
            log.info("jetson-tq: prefix caching switched off: %s", why)
            config.cache_config.enable_prefix_caching = False

        if not current_platform.is_cpu():
            chosen = config.attention_config.backend
            if chosen not in (None, AttentionBackendEnum.CUSTOM):
                log.warning("jetson-tq: attention backend %s replaced by CUSTOM (JETSON_TQ_CONFIG is set)", chosen)
            config.attention_config.backend = AttentionBackendEnum.CUSTOM
        return config
    return create_engine_config


def prefix_caching_blocker(cfg, cache_config, is_cpu: bool) -> str | None:
    """Why prefix caching must be off under ``cfg`` (None when hits are safe): a hit starts a request at a block
    boundary with nothing in its fp16 ring, which only a block window restarting at that boundary expects."""
    if sliding_windows(cfg):
        return ("a sliding window (buffer.window: sliding) reads the last recent_tokens exactly, and a prefix-cache "
                "hit would start attention without the cached tokens' exact copies (buffer.window: block allows hits)")
    from vllm.config.cache import CacheConfig

    w = window_block(cfg)
    # the block size is final here on CPU or when the user set it; else the backend will ask for a multiple of w
    final = is_cpu or cache_config.user_specified_block_size
    size = cache_config.block_size if final else preferred_block_size(CacheConfig.DEFAULT_BLOCK_SIZE, cfg)
    if size and size % w:
        return (f"block windows restart every {w} tokens but vLLM's block size is {size} (a hit may start inside a "
                f"window); set --block-size to a multiple of {w}")
    unit = getattr(cache_config, "prefix_match_unit", None)  # vLLM 0.27: hits at finer boundaries than a block
    if unit and unit % w:
        return f"block windows restart every {w} tokens but prefix_match_unit is {unit}; set it to a multiple of {w}"
    return None


def install() -> None:
    """Install every wrap (idempotent)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap(Attention, "get_kv_cache_spec", _spec_wrap)
    _wrap(GPUModelRunner, "initialize_kv_cache", _runner_wrap)
    _wrap(EngineArgs, "create_engine_config", _config_wrap)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
        from vllm.v1.worker.cpu_worker import CPUWorker

        _wrap(CPUModelRunner, "initialize_kv_cache", _runner_wrap)
        _wrap(CPUWorker, "determine_available_memory", _memory_wrap)
    else:
        from vllm.v1.worker.gpu_worker import Worker

        _wrap(Worker, "determine_available_memory", _memory_wrap)
