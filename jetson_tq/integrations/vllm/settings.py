"""The one switch: ``JETSON_TQ_CONFIG`` names a preset or a YAML file; unset means stock vLLM.

``JETSON_TQ_REPRODUCIBLE`` (1/0; default: the config's ``reproducible`` field, false) switches on the
reproducible mode: greedy outputs that do not depend on batch composition, chunk size or preemption.

The kernels (``JETSON_TQ_BACKEND``) are chosen in one place for the whole package, ``jetson_tq.ops``.
Both variables are read in every vLLM process, so they reach spawned engine-core and worker processes
by inheritance.
"""

from __future__ import annotations

import functools
import math
import os

from ... import env
from ...codec.klt import KeyTransform, load_transforms_cached
from ...config import TurboQuantConfig, load_config
from ...errors import ConfigError

ENV_CONFIG = env.CONFIG
ENV_REPRODUCIBLE = env.REPRODUCIBLE
ENV_BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"  # vLLM's own batch-invariant kernels (matmul, softmax, norms, cuBLAS)
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


LOGGER_NAME = "vllm.jetson_tq"  # under vLLM's namespace, so vLLM's handler and level apply


def logger():
    """vLLM's logger for the plugin's messages (INFO lines start with 'jetson-tq:')."""
    from vllm.logger import init_logger

    return init_logger(LOGGER_NAME)


def config_name() -> str | None:
    """The switch's value, or None when jetson-tq is off."""
    return env.read().config


def enabled() -> bool:
    """True when ``JETSON_TQ_CONFIG`` is set."""
    return config_name() is not None


@functools.lru_cache(maxsize=8)
def _load(name: str) -> TurboQuantConfig:
    cfg = load_config(name)
    if any(f.sink_tokens for f in cfg.named_formats):
        raise ConfigError(
            f"config {cfg.name!r}: exact sink tokens (buffer.sink_tokens) are served by TurboQuantCache "
            f"(transformers), not yet inside vLLM, whose prefix cache shares pages between requests; pick another "
            f"config for vLLM"
        )
    return cfg


def active_config() -> TurboQuantConfig:
    """The config named by the switch (ConfigError when off or invalid)."""
    name = config_name()
    if name is None:
        raise ConfigError(f"{ENV_CONFIG} is not set: jetson-tq's vLLM backend is off")
    return _load(name)


def layer_key_transform(index: int) -> KeyTransform:
    """The active config's calibrated key transform of layer ``index`` (klt keys; ConfigError when it has none)."""
    cfg = active_config()
    if not cfg.key_transform:
        raise ConfigError(f"config {cfg.name!r} codes keys by a calibrated transform but names no key_transform file")
    layers = load_transforms_cached(cfg.key_transform)
    transform = layers[index] if index < len(layers) else None
    if transform is None:
        raise ConfigError(f"{cfg.key_transform}: no key transform for layer {index} ({len(layers)} layers calibrated)")
    return transform


def _ringed(cfg: TurboQuantConfig) -> list:
    """The formats with a recent ring that our kernels serve (a passthrough format's layers run stock)."""
    return [f for f in cfg.named_formats if f.recent_tokens > 0 and not f.is_passthrough]


def compresses(cfg: TurboQuantConfig) -> bool:
    """True when some layer's format under ``cfg`` compresses (one that stores keys and values exactly runs on
    stock attention, ``spec.stock_reason``): else the plugin leaves vLLM exactly as it is."""
    return any(not f.is_passthrough for f in cfg.named_formats)


def sliding_windows(cfg: TurboQuantConfig) -> bool:
    """True when some layer reads the last R tokens exactly (``window: sliding`` with a ring): a prefix-cache hit
    would start such a layer without the cached tokens' exact copies, so prefix caching must stay off."""
    return any(not f.block_window for f in _ringed(cfg))


def window_block(cfg: TurboQuantConfig) -> int:
    """The token boundary every block-window layer's exact window restarts at (lcm of their R; 1 when none):
    vLLM's block size must be a multiple of it for prefix-cache hits to start with empty windows."""
    return math.lcm(1, *(f.recent_tokens for f in _ringed(cfg) if f.block_window))


def preferred_block_size(default: int, cfg: TurboQuantConfig | None = None) -> int:
    """vLLM's block size the backend asks for when the user sets none: a multiple of the window block of ``cfg``
    (default: the active config; ``default`` itself when the switch is off)."""
    if cfg is None and not enabled():
        return default
    return math.lcm(default, window_block(cfg or active_config()))


def spec_query_tokens(vllm_config) -> int:
    """The most tokens a speculative-decoding verification row holds (the last sampled token plus the drafts, as
    vLLM's builders count them for ``reorder_batch_threshold``), 0 without speculative decoding."""
    spec = getattr(vllm_config, "speculative_config", None)
    k = getattr(spec, "num_speculative_tokens", None) if spec is not None else None
    if not k:
        return 0
    return 1 + (2 if getattr(spec, "parallel_drafting", False) else 1) * int(k)


def env_flag(name: str) -> bool | None:
    """A boolean environment variable: None when unset or empty, ConfigError for a value that is not one."""
    return parse_flag(name, os.environ.get(name))


def parse_flag(name: str, value: str | None) -> bool | None:
    """``value`` of the boolean variable ``name``: None when unset or empty, ConfigError for a value that is not one."""
    raw = (value or "").strip().lower()
    if not raw:
        return None
    if raw in _TRUE or raw in _FALSE:
        return raw in _TRUE
    raise ConfigError(f"{name}={value!r}: expected one of {_TRUE + _FALSE}")


def reproducible() -> bool:
    """True when the reproducible mode is on: ``JETSON_TQ_REPRODUCIBLE`` when set, else the active config's field."""
    flag = parse_flag(ENV_REPRODUCIBLE, env.read().reproducible)
    if flag is not None:
        return flag
    return enabled() and active_config().reproducible


def require_batch_invariant_vllm() -> bool:
    """Reproducible mode needs vLLM's batch-invariant mode too: set ``VLLM_BATCH_INVARIANT=1`` (inherited by vLLM's
    engine-core and worker processes) unless it is set; True when this call set it. ConfigError when the user
    turned it off explicitly (the two settings contradict each other)."""
    flag = env_flag(ENV_BATCH_INVARIANT)
    if flag is None:
        os.environ[ENV_BATCH_INVARIANT] = "1"
        return True
    if not flag:
        raise ConfigError(
            f"{ENV_REPRODUCIBLE} (or the config's reproducible: true) asks for batch-invariant outputs but "
            f"{ENV_BATCH_INVARIANT}={os.environ[ENV_BATCH_INVARIANT]!r} turns vLLM's batch-invariant kernels off; "
            f"unset {ENV_BATCH_INVARIANT} or set it to 1"
        )
    return False
