"""The one switch: ``JETSON_TQ_CONFIG`` names a preset or a YAML file; unset means stock vLLM.

The kernels (``JETSON_TQ_BACKEND``) are chosen in one place for the whole package, ``jetson_tq.ops``.
Both variables are read in every vLLM process, so they reach spawned engine-core and worker processes
by inheritance.
"""

from __future__ import annotations

import functools
import os

from ...config import TurboQuantConfig, load_config
from ...errors import ConfigError

ENV_CONFIG = "JETSON_TQ_CONFIG"


LOGGER_NAME = "vllm.jetson_tq"  # under vLLM's namespace, so vLLM's handler and level apply


def logger():
    """vLLM's logger for the plugin's messages (INFO lines start with 'jetson-tq:')."""
    from vllm.logger import init_logger

    return init_logger(LOGGER_NAME)


def config_name() -> str | None:
    """The switch's value, or None when jetson-tq is off."""
    value = os.environ.get(ENV_CONFIG, "").strip()
    return value or None


def enabled() -> bool:
    """True when ``JETSON_TQ_CONFIG`` is set."""
    return config_name() is not None


@functools.lru_cache(maxsize=8)
def _load(name: str) -> TurboQuantConfig:
    return load_config(name)


def active_config() -> TurboQuantConfig:
    """The config named by the switch (ConfigError when off or invalid)."""
    name = config_name()
    if name is None:
        raise ConfigError(f"{ENV_CONFIG} is not set: jetson-tq's vLLM backend is off")
    return _load(name)


def uses_recent_buffer(cfg: TurboQuantConfig) -> bool:
    """True when some layer keeps recent tokens in fp16 (the default or any override has a buffer)."""
    return cfg.default.buffer_tokens > 0 or any(f.buffer_tokens > 0 for f in cfg.overrides.values())
