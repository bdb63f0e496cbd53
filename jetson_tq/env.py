"""Every ``JETSON_TQ_*`` environment variable the package reads, with its default, in one frozen ``Settings``
(``Settings.from_env``: environment -> settings).

``read()`` takes the snapshot; each reader calls it where it read the variable before, because some change within a
process by design: the vLLM plugin writes the resolved ``auto`` into ``JETSON_TQ_CONFIG`` for the engine's child
processes, and tests point ``JETSON_TQ_SYSROOT`` at fake boards. Readers that keep a value for the process keep doing
so (the kernel backend until ``ops.configured.cache_clear()``, the preset and model folders at import). Values are
parsed and checked where they are used (a bad backend or flag is a ConfigError naming the variable there).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CONFIG = "JETSON_TQ_CONFIG"  # the vLLM switch: a preset name, a YAML path or ``auto``; unset or blank: stock vLLM
AUTO_REQUESTED = "JETSON_TQ_AUTO_REQUESTED"  # written by the plugin: the config ``auto`` resolved to in this process
REPRODUCIBLE = "JETSON_TQ_REPRODUCIBLE"  # 1/0 overrides the config's ``reproducible`` field (vLLM)
BACKEND = "JETSON_TQ_BACKEND"  # auto | reference | triton, for the whole process (``jetson_tq.ops``)
FLASH_PREFILL = "JETSON_TQ_FLASH_PREFILL"  # 0 keeps long prefill chunks on the Triton loop (vLLM)
FLASH_MIN_TOKENS = "JETSON_TQ_FLASH_MIN_TOKENS"  # history + chunk from which a prefill row takes FlashAttention (vLLM)
SYSROOT = "JETSON_TQ_SYSROOT"  # prefix of the board files the platform probe reads (default /)
CACHE = "JETSON_TQ_CACHE"  # the cache root (default ~/.cache/jetson_tq): converted models, calibrations
CALIBRATION_DIR = "JETSON_TQ_CALIBRATION_DIR"  # the calibration cache (default <cache root>/calibrations)
CONFIG_DIR = "JETSON_TQ_CONFIG_DIR"  # another folder of presets, models/ and per_layer/ (default: the shipped ones)
MODELS_DIR = "JETSON_TQ_MODELS_DIR"  # another folder of model shapes (default <config dir>/models)
TRACEBACK = "JETSON_TQ_TRACEBACK"  # any value: the CLI shows the traceback of an unexpected error

#: every variable above, in the order of the fields of ``Settings``
NAMES = (
    CONFIG,
    AUTO_REQUESTED,
    REPRODUCIBLE,
    BACKEND,
    FLASH_PREFILL,
    FLASH_MIN_TOKENS,
    SYSROOT,
    CACHE,
    CALIBRATION_DIR,
    CONFIG_DIR,
    MODELS_DIR,
    TRACEBACK,
)


@dataclass(frozen=True)
class Settings:
    """The package's environment at one moment; ``None`` where a variable is unset (or blank, for those a blank value
    means unset)."""

    config: str | None = None  #: the switch, stripped; None: off
    auto_requested: str | None = None
    reproducible: str | None = None  #: raw; parsed as a flag by the vLLM settings (ConfigError for other values)
    kernel_backend: str = ""  #: raw; "" means auto (``jetson_tq.ops.backend`` validates it)
    flash_prefill: bool = True  #: False only for "0"
    flash_min_tokens: str | None = None  #: raw; parsed by the vLLM flash module (ConfigError for non-integers)
    sysroot: Path = Path("/")
    cache: str | None = None  #: raw; see ``cache_root``
    calibration_dir: Path | None = None
    config_dir: str | None = None  #: raw (a set but empty value is the current folder, as before)
    models_dir: str | None = None  #: raw, like ``config_dir``
    traceback: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Settings from ``environ`` (default ``os.environ``)."""
        env = os.environ if environ is None else environ
        calibration = env.get(CALIBRATION_DIR, "").strip()
        return cls(
            config=env.get(CONFIG, "").strip() or None,
            auto_requested=env.get(AUTO_REQUESTED),
            reproducible=env.get(REPRODUCIBLE),
            kernel_backend=env.get(BACKEND, ""),
            flash_prefill=env.get(FLASH_PREFILL, "1") != "0",
            flash_min_tokens=env.get(FLASH_MIN_TOKENS, "").strip() or None,
            sysroot=Path(env.get(SYSROOT, "/")),
            cache=env.get(CACHE),
            calibration_dir=Path(calibration).expanduser() if calibration else None,
            config_dir=env.get(CONFIG_DIR),
            models_dir=env.get(MODELS_DIR),
            traceback=bool(env.get(TRACEBACK)),
        )

    @property
    def cache_root(self) -> Path:
        """The jetson-tq cache root: ``JETSON_TQ_CACHE`` (expanded), else ``~/.cache/jetson_tq``."""
        return Path(self.cache).expanduser() if self.cache else Path.home() / ".cache" / "jetson_tq"


def read() -> Settings:
    """The settings of this moment's environment."""
    return Settings.from_env()
