"""YAML configs: a default KVFormat plus a per-layer policy, validated key by key.

Schema (every key optional; unknown keys are errors)::

    name: mse_k4v3                                # omitted keys take these values (KVFormat's defaults)
    description: free text
    keys:   {mode: mse, bits: 4}                  # mse = Lloyd-Max; prod = (bits-1)-bit MSE + 1-bit QJL; codebook: lloyd_max | uniform
    values: {mode: group, bits: 3, group_size: 64}
    norm_dtype: float16
    rotation: auto                                # auto | hadamard | dense
    buffer: {recent_tokens: 128, flush_chunk: 64}
    seed: 0
    layers: {keep_fp16_first: 0, keep_fp16_last: 0, overrides: {5: {keys: {bits: 4}}}}
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError, FormatError
from .format import FP16_FORMAT, KVFormat

CONFIG_DIR = Path(os.environ.get("JETSON_TQ_CONFIG_DIR", Path(__file__).resolve().parents[1] / "configs"))
DEFAULT_PRESET = "mse_k4v3"  # chosen from docs/fidelity.md (SmolLM2: +0.98 % PPL, 4.1x)

_TOP_KEYS = {"name", "description", "keys", "values", "norm_dtype", "rotation", "buffer", "seed", "layers", "notes"}
_KEY_KEYS = {"mode": "key_mode", "bits": "key_bits", "codebook": "key_codebook"}
_VALUE_KEYS = {"mode": "value_mode", "bits": "value_bits", "group_size": "value_group"}
_BUFFER_KEYS = {"recent_tokens": "buffer_tokens", "flush_chunk": "flush_chunk"}
_LAYER_KEYS = {"keep_fp16_first", "keep_fp16_last", "overrides"}
_FORMAT_SECTIONS = {"keys", "values", "norm_dtype", "rotation", "buffer", "seed"}


@dataclass(frozen=True)
class TurboQuantConfig:
    """A named default format plus which layers stay fp16 and which get their own format."""

    name: str
    default: KVFormat
    keep_fp16_first: int = 0
    keep_fp16_last: int = 0
    overrides: dict[int, KVFormat] = field(default_factory=dict)
    description: str = ""

    def format_for_layer(self, layer: int, num_layers: int) -> KVFormat:
        """The format of layer ``layer`` (0-based) in a model of ``num_layers`` layers."""
        if not 0 <= layer < num_layers:
            raise ConfigError(f"layer {layer} out of range for a model of {num_layers} layers")
        if layer < self.keep_fp16_first or layer >= num_layers - self.keep_fp16_last:
            return FP16_FORMAT
        return self.overrides.get(layer, self.default)

    def check_model(self, num_layers: int, head_dim: int) -> None:
        """Raise ConfigError unless every layer's format fits this model."""
        for i in self.overrides:
            if not 0 <= i < num_layers:
                raise ConfigError(f"layers.overrides: layer {i} out of range for a model of {num_layers} layers")
        for i in range(num_layers):
            try:
                self.format_for_layer(i, num_layers).check_head_dim(head_dim)
            except FormatError as e:
                raise ConfigError(f"layer {i}: {e}") from e


def _reject_unknown(section: str, given: dict, allowed) -> None:
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ConfigError(f"{section}: unknown key(s) {unknown}; expected some of {sorted(allowed)}")


def _as_mapping(section: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{section}: expected a mapping, got {type(value).__name__}")
    return value


def _format_changes(raw: dict, where: str) -> dict[str, Any]:
    """Translate a YAML format section into KVFormat field changes."""
    changes: dict[str, Any] = {}
    for section, mapping in (("keys", _KEY_KEYS), ("values", _VALUE_KEYS), ("buffer", _BUFFER_KEYS)):
        if section in raw:
            sub = _as_mapping(f"{where}{section}", raw[section])
            _reject_unknown(f"{where}{section}", sub, mapping)
            changes.update({mapping[k]: v for k, v in sub.items()})
    for key in ("norm_dtype", "rotation", "seed"):
        if key in raw:
            changes[key] = raw[key]
    return changes


def _build_format(base: KVFormat, changes: dict[str, Any], where: str) -> KVFormat:
    try:
        return base.with_(**changes)
    except FormatError as e:
        raise ConfigError(f"{where or 'config'}: {e}") from e


def config_from_dict(raw: dict, name: str = "custom") -> TurboQuantConfig:
    """Validate a parsed YAML mapping and build the config (ConfigError names the bad key)."""
    raw = _as_mapping("config", raw)
    _reject_unknown("config", raw, _TOP_KEYS)
    default = _build_format(KVFormat(), _format_changes(raw, ""), "")
    layers = _as_mapping("layers", raw.get("layers", {}) or {})
    _reject_unknown("layers", layers, _LAYER_KEYS)
    keep = {}
    for key in ("keep_fp16_first", "keep_fp16_last"):
        value = layers.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"layers.{key}: expected an integer >= 0, got {value!r}")
        keep[key] = value
    overrides: dict[int, KVFormat] = {}
    for layer, sub in (_as_mapping("layers.overrides", layers.get("overrides", {}) or {})).items():
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ConfigError(f"layers.overrides: layer keys must be integers >= 0, got {layer!r}")
        sub = _as_mapping(f"layers.overrides.{layer}", sub)
        _reject_unknown(f"layers.overrides.{layer}", sub, _FORMAT_SECTIONS)
        where = f"layers.overrides.{layer}."
        overrides[layer] = _build_format(default, _format_changes(sub, where), where)
    return TurboQuantConfig(name=str(raw.get("name", name)), default=default, overrides=overrides,
                            description=str(raw.get("description", "")), **keep)


def preset_names() -> list[str]:
    """Names of the YAML presets shipped in ``configs/``."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def resolve_config_path(name_or_path: str | os.PathLike) -> Path:
    """A preset name (``k4v4``) or a path to a YAML file -> the file's path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    preset = CONFIG_DIR / f"{name_or_path}.yaml"
    if preset.exists():
        return preset
    raise ConfigError(f"no config {str(name_or_path)!r}: not a YAML file and not one of the presets {preset_names()}")


def load_config(name_or_path: str | os.PathLike = DEFAULT_PRESET) -> TurboQuantConfig:
    """Load and validate a preset by name or a YAML file by path."""
    path = resolve_config_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    return config_from_dict(raw, name=path.stem)
