"""YAML configs: a default KVFormat plus a per-layer policy, validated key by key.

Schema (every key optional; unknown keys are errors)::

    name: mse_k4v3                                # omitted keys take these values (KVFormat's defaults)
    description: free text
    keys:   {mode: mse, bits: 4}                  # mse = Lloyd-Max; prod = (bits-1)-bit MSE + 1-bit QJL;
                                                  # codebook: lloyd_max | uniform; klt = calibrated transform
                                                  # code of code_bytes bytes at head dim 128 (needs key_transform)
    key_transform: ~/.cache/jetson_tq/model.kt    # klt keys: the calibration file (python -m jetson_tq calibrate);
                                                  # a relative path is read from the YAML file's folder
    values: {mode: group, bits: 3, group_size: 64}
    norm_dtype: float16
    rotation: auto                                # auto | hadamard | dense
    buffer: {recent_tokens: 128, window: block, flush_chunk: 64}   # window: block (own block exact) | sliding;
                                                  # sink_tokens: S first positions always read exactly
    seed: 0
    layers: {keep_fp16_first: 0, keep_fp16_last: 0, overrides: {5: {keys: {bits: 4}}}}
    reproducible: false                           # vLLM: greedy outputs independent of batch, chunking, preemption
                                                  # (docs/vllm.md; env JETSON_TQ_REPRODUCIBLE overrides it)
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from . import env
from .errors import ConfigError, FormatError, expect_int
from .format import FP16_FORMAT, KVFormat


def shipped_dir(name: str) -> Path:
    """A data folder shipped inside the package (``jetson_tq/<name>``), found through ``importlib.resources``.

    ``jetson_tq/presets`` is a link to the checkout's top-level ``configs/`` (the one copy of every preset and
    model file): a checkout, an editable install and a container read it through the link, and the wheel build
    copies the files behind it into the wheel, so a pip-installed package reads them from ``site-packages``.
    """
    return Path(str(resources.files(__package__ or "jetson_tq").joinpath(name)))


#: presets (``*.yaml``), model shapes (``models/``) and per-layer policies (``per_layer/``); JETSON_TQ_CONFIG_DIR
#: points at another folder of the same layout
_CONFIG_DIR = env.read().config_dir
CONFIG_DIR = Path(shipped_dir("presets") if _CONFIG_DIR is None else _CONFIG_DIR)
#: The calibration-free preset, and what ``auto`` serves when a model cannot be calibrated. Chosen from
#: docs/fidelity.md: on held-out essays / Opticks +1.44 % / +1.27 % PPL at 122 B/token/head (D=128, 4.2x), own-block
#: window, served by every path.
FALLBACK_PRESET = "mse_k4v3"
#: ``auto``: the 5x calibrated format (``AUTO_FORMAT``), calibrated for the model on first use and cached
#: (``jetson_tq.calibration``); FALLBACK_PRESET, with one log line saying why, for a model that cannot be calibrated.
AUTO = "auto"
#: The one default of the package (TurboQuantCache, the CLI, reports, the vLLM tools). Not ``AUTO`` yet: its decode
#: is slower than the fallback's on the GPU (docs/fidelity.md); flipping the default is this line.
DEFAULT_PRESET = FALLBACK_PRESET
#: The calibrated format ``auto`` serves, as a config mapping (the calibration adds ``key_transform``): keys coded by a
#: calibrated transform in 52 B at D=128, 3-bit TurboQuant_mse values, the own 256-token block exact (102 B/token/head
#: at D=128, 5.0x; docs/fidelity.md "Quality at 5x").
AUTO_FORMAT: dict[str, Any] = {
    "keys": {"mode": "klt", "code_bytes": 52},
    "values": {"mode": "mse", "bits": 3},
    "buffer": {"recent_tokens": 256, "window": "block", "sink_tokens": 0},
}

_TOP_KEYS = {
    "name",
    "description",
    "keys",
    "values",
    "norm_dtype",
    "rotation",
    "buffer",
    "seed",
    "layers",
    "notes",
    "reproducible",
    "key_transform",
}
_KEY_KEYS = {"mode": "key_mode", "bits": "key_bits", "codebook": "key_codebook", "code_bytes": "key_code_bytes"}
_VALUE_KEYS = {"mode": "value_mode", "bits": "value_bits", "group_size": "value_group"}
_BUFFER_KEYS = {
    "recent_tokens": "recent_tokens",
    "window": "window",
    "flush_chunk": "flush_chunk",
    "sink_tokens": "sink_tokens",
}
_LAYER_KEYS = {"keep_fp16_first", "keep_fp16_last", "overrides"}
_FORMAT_SECTIONS = {"keys", "values", "norm_dtype", "rotation", "buffer", "seed"}
MAX_LAYERS = 4096  # more than any model has: a larger keep_fp16_* count is a typo, not a policy
MAX_YAML_BYTES = 256 * 1024  # presets and model files are < 2 KB; a cap keeps a hostile file from costing memory
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")  # a preset / model name: no path separators, no '..'


@dataclass(frozen=True)
class TurboQuantConfig:
    """A named default format plus which layers stay fp16 and which get their own format."""

    name: str
    default: KVFormat
    keep_fp16_first: int = 0
    keep_fp16_last: int = 0
    overrides: dict[int, KVFormat] = field(default_factory=dict)
    description: str = ""
    reproducible: bool = False  # the vLLM backend's reproducible mode (``integrations.vllm.settings.reproducible``)
    key_transform: str = ""  # klt keys: the calibration file (``codec.klt.load_transforms``)

    @property
    def needs_key_transform(self) -> bool:
        """True when some layer's format codes its keys through a calibrated transform."""
        return any(f.key_mode == "klt" for f in self.named_formats)

    @property
    def named_formats(self) -> tuple[KVFormat, ...]:
        """The default and every per-layer override (the formats a layer can get besides the kept fp16 ones)."""
        return (self.default, *self.overrides.values())

    def format_for_layer(self, layer: int, num_layers: int) -> KVFormat:
        """The format of layer ``layer`` (0-based) in a model of ``num_layers`` layers."""
        expect_int("layer", layer, None)
        expect_int("num_layers", num_layers, None)
        if not 0 <= layer < num_layers:
            raise ConfigError(f"layer {layer} out of range for a model of {num_layers} layers")
        if layer < self.keep_fp16_first or layer >= num_layers - self.keep_fp16_last:
            return FP16_FORMAT
        return self.overrides.get(layer, self.default)

    def check_model(self, num_layers: int, head_dim: int) -> None:
        """Raise ConfigError unless every layer's format fits this model."""
        expect_int("num_layers", num_layers, None)
        expect_int("head_dim", head_dim, None)
        for i in self.overrides:
            if not 0 <= i < num_layers:
                raise ConfigError(f"layers.overrides: layer {i} out of range for a model of {num_layers} layers")
        kept = self.keep_fp16_first + self.keep_fp16_last
        if kept > num_layers or (kept == num_layers and not self.default.is_passthrough):
            raise ConfigError(
                f"layers: keep_fp16_first {self.keep_fp16_first} + keep_fp16_last {self.keep_fp16_last} "
                f"= {kept}: expected fewer than the model's {num_layers} layers (all layers fp16 "
                f"would never use the compressed format; use the fp16 preset for that)"
            )
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


def config_from_dict(raw: dict, name: str = "custom", base_dir: Path | None = None) -> TurboQuantConfig:
    """Validate a parsed YAML mapping and build the config (ConfigError names the bad key); a relative
    ``key_transform`` path is taken from ``base_dir`` (the YAML file's folder)."""
    raw = _as_mapping("config", raw)
    _reject_unknown("config", raw, _TOP_KEYS)
    default = _build_format(KVFormat(), _format_changes(raw, ""), "")
    layers = _as_mapping("layers", raw.get("layers", {}) or {})
    _reject_unknown("layers", layers, _LAYER_KEYS)
    keep = {}
    for key in ("keep_fp16_first", "keep_fp16_last"):
        value = layers.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LAYERS:
            raise ConfigError(f"layers.{key}: expected an integer in [0, {MAX_LAYERS}], got {value!r}")
        keep[key] = value
    overrides: dict[int, KVFormat] = {}
    for layer, sub in (_as_mapping("layers.overrides", layers.get("overrides", {}) or {})).items():
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ConfigError(f"layers.overrides: layer keys must be integers >= 0, got {layer!r}")
        sub = _as_mapping(f"layers.overrides.{layer}", sub)
        _reject_unknown(f"layers.overrides.{layer}", sub, _FORMAT_SECTIONS)
        where = f"layers.overrides.{layer}."
        overrides[layer] = _build_format(default, _format_changes(sub, where), where)
    for key in ("name", "description"):
        if key in raw and not isinstance(raw[key], str):
            raise ConfigError(f"{key}: expected a string, got {type(raw[key]).__name__} {raw[key]!r}")
    reproducible = raw.get("reproducible", False)
    if not isinstance(reproducible, bool):
        raise ConfigError(f"reproducible: expected true or false, got {type(reproducible).__name__} {reproducible!r}")
    transform = raw.get("key_transform", "")
    if not isinstance(transform, str):
        raise ConfigError(f"key_transform: expected a path, got {type(transform).__name__} {transform!r}")
    if transform:
        path = Path(transform).expanduser()
        transform = str(path if path.is_absolute() or base_dir is None else base_dir / path)
    return TurboQuantConfig(
        name=raw.get("name", name),
        default=default,
        overrides=overrides,
        description=raw.get("description", ""),
        reproducible=reproducible,
        key_transform=transform,
        **keep,
    )


def preset_names() -> list[str]:
    """Names of the YAML presets in ``CONFIG_DIR`` (shipped: ``configs/*.yaml``)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def resolve_named_yaml(name_or_path: str | os.PathLike, folder: Path, what: str, names: list[str]) -> Path:
    """A name in ``folder`` (``k4v4``) or a path to a .yaml/.yml file -> the file's path (ConfigError otherwise).

    Names may not hold path separators or '..', so a name never reaches a file outside ``folder``.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ConfigError(f"{what}: expected a name or a path to a YAML file, got {type(name_or_path).__name__}")
    text = os.fspath(name_or_path)
    path = Path(text)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            state = (
                "is a directory" if path.is_dir() else "is not a regular file" if path.exists() else "does not exist"
            )
            raise ConfigError(f"{what} {text!r}: expected a YAML file, but the path {state}")
        return path
    if "/" in text or os.sep in text:
        raise ConfigError(f"{what} {text!r}: expected a path ending in .yaml or .yml, or one of {names}")
    if not _NAME.match(text) or ".." in text:
        raise ConfigError(
            f"{what} {text!r}: expected one of {names} (a name: letters, digits, '_', '-', '.'; "
            f"no path) or a path to a .yaml file"
        )
    named = folder / f"{text}.yaml"
    if not named.is_file():
        raise ConfigError(f"no {what} {text!r}: not a YAML file and not one of {names}")
    return named


def resolve_config_path(name_or_path: str | os.PathLike) -> Path:
    """A preset name (``k4v4``) or a path to a YAML file -> the file's path."""
    return resolve_named_yaml(name_or_path, CONFIG_DIR, "config", preset_names())


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses anchors/aliases (no expansion bombs) and duplicate keys (no silent last-wins)."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            kind = "alias *" if isinstance(event, yaml.AliasEvent) else "anchor &"
            raise ConfigError(
                f"line {event.start_mark.line + 1}: YAML {kind}{event.anchor} is not allowed in "
                f"jetson-tq files (expected plain values; write the value out)"
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise ConfigError(
                    f"line {key_node.start_mark.line + 1}: a mapping key must be a plain value, got "
                    f"{type(key).__name__} {key!r}"
                )
            if key in seen:
                raise ConfigError(
                    f"line {key_node.start_mark.line + 1}: duplicate key {key!r} (first on line "
                    f"{seen[key]}); expected each key once"
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def read_yaml(path: Path) -> dict:
    """Parse a small jetson-tq YAML file strictly: a non-empty UTF-8 mapping, no aliases, no duplicate keys."""
    try:
        size = path.stat().st_size
        if size > MAX_YAML_BYTES:
            raise ConfigError(f"{path}: expected a YAML file of at most {MAX_YAML_BYTES:,} bytes, got {size:,}")
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror or e})") from e
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: expected UTF-8 text, got byte 0x{data[e.start]:02x} at offset {e.start}") from e
    try:
        raw = yaml.load(text, Loader=_StrictLoader)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if raw is None:
        raise ConfigError(f"{path}: the file is empty; expected a mapping of settings (see configs/*.yaml)")
    return _as_mapping(str(path), raw)


def load_config(name_or_path: str | os.PathLike = DEFAULT_PRESET) -> TurboQuantConfig:
    """Load and validate a preset by name or a YAML file by path. ``auto`` gives the calibrated format with no
    transform yet (``auto_template``): its bytes and window are known before a model is; a cache or the vLLM plugin
    resolves it for the model (``resolve_auto``)."""
    if name_or_path == AUTO:
        return auto_template()
    path = resolve_config_path(name_or_path)
    return config_from_dict(read_yaml(path), name=path.stem, base_dir=path.parent)


def auto_template() -> TurboQuantConfig:
    """The ``auto`` config before calibration: ``AUTO_FORMAT`` on every layer, no key transform file."""
    return config_from_dict(dict(AUTO_FORMAT), name=AUTO)


def is_auto(config: object) -> bool:
    """True for the name ``auto`` and for the unresolved ``auto_template``."""
    if isinstance(config, TurboQuantConfig):
        return config.name == AUTO and not config.key_transform
    return isinstance(config, str) and config.strip() == AUTO


#: kind ("model": a loaded transformers model; "checkpoint": a model directory) -> the function that resolves
#: ``auto`` for it. ``jetson_tq.calibration`` installs them (it sits above the integrations that call them).
_AUTO_RESOLVERS: dict[str, Callable[..., Any]] = {}


def register_auto_resolver(kind: str, resolver: Callable[..., Any]) -> None:
    """Install the resolver of ``auto`` for a kind of model source (``_AUTO_RESOLVERS``)."""
    _AUTO_RESOLVERS[kind] = resolver


def resolve_auto(kind: str, source: Any, **kwargs: Any) -> Any:
    """``auto`` resolved for ``source`` by the installed resolver of ``kind``: a loaded model -> its calibrated
    TurboQuantConfig (FALLBACK_PRESET's when it cannot be calibrated); a checkpoint directory -> the config's name or
    path. ConfigError when no resolver is installed (``import jetson_tq`` installs them)."""
    resolver = _AUTO_RESOLVERS.get(kind)
    if resolver is None:
        raise ConfigError(f"config 'auto': no calibration installed for a {kind} (import jetson_tq first)")
    return resolver(source, **kwargs)
