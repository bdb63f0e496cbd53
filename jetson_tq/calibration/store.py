"""Calibrations cached by model identity, so a model is calibrated once.

Identity (``ModelIdentity``): a hash of the decoder config's fields that shape attention (layers, heads, head dim,
RoPE, vocabulary, ...) and a digest of the key projections of the first and last attention layer (a sample of each,
as float32: a checkpoint read in bf16 or fp32 gives the same digest), computed alike from a loaded model and from a
checkpoint's safetensors files (a few tensors read, never the whole file). An entry is
``<cache>/calibrations/<model>-<identity>-<recipe tag>.pt`` (the key transforms and what they were fitted for) with
its config beside it as ``.yaml``; ``JETSON_TQ_CALIBRATION_DIR`` (else ``$JETSON_TQ_CACHE/calibrations``, else
``~/.cache/jetson_tq/calibrations``) moves it.

Reading an entry checks everything it was made for (``StaleCalibrationError`` names the difference): a file for
another model, another head dim or layer count, an older recipe or calibration version, or one that is truncated or
unreadable is never served.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import env
from ..codec.klt import KeyTransform, load_transforms, save_transforms
from ..errors import ConfigError
from ..models.smollm2 import cache_root
from .capture import decoder_config

ENV_DIR = env.CALIBRATION_DIR
#: Bumped when the fit changes what a recipe produces: older entries are recalibrated. 2: each eigenvector signed
#: so that its largest-magnitude entry is positive (the same coder up to a coefficient's sign, stored differently).
CALIBRATION_VERSION = 2
#: Elements of each sampled weight tensor in the digest (its first ones and an even stride through it).
DIGEST_ELEMENTS = 4096
#: Decoder config fields that change the keys a model makes (any absent one hashes as null).
CONFIG_FIELDS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "partial_rotary_factor",
    "layer_types",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "rms_norm_eps",
    "layer_norm_eps",
)
_KEY_PROJ = re.compile(r"layers\.(\d+)\..*(k_proj|qkv_proj|query_key_value|Wqkv|c_attn)\.weight$")


class StaleCalibrationError(ConfigError):
    """A calibration file that does not belong to this model, recipe or version (or cannot be read)."""


@dataclass(frozen=True)
class ModelIdentity:
    """A model's calibration identity: ``config`` and ``weights`` digests (hex) and a readable ``name``."""

    name: str
    config: str
    weights: str

    @property
    def key(self) -> str:
        return f"{self.config[:8]}{self.weights[:8]}"


def calibration_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where calibrations are cached: ``cache_dir``, else ``$JETSON_TQ_CALIBRATION_DIR``, else the jetson-tq cache
    root's ``calibrations``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return env.read().calibration_dir or cache_root() / "calibrations"


def config_digest(config) -> str:
    """sha256 (hex) of the decoder config's ``CONFIG_FIELDS``."""
    fields = {f: getattr(config, f, None) for f in CONFIG_FIELDS}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def tensor_digest(t: torch.Tensor) -> bytes:
    """sha256 of a sample of ``t`` as float32 (its shape, first ``DIGEST_ELEMENTS`` elements and as many at an even
    stride): the same for the tensor in any float dtype it converts to exactly."""
    flat = t.detach().reshape(-1)
    stride = max(1, flat.numel() // DIGEST_ELEMENTS)
    sample = torch.cat([flat[:DIGEST_ELEMENTS], flat[::stride][:DIGEST_ELEMENTS]]).float().cpu().contiguous()
    h = hashlib.sha256(json.dumps(list(t.shape)).encode())
    h.update(sample.numpy().tobytes())
    return h.digest()


def key_projection_names(names) -> list[str]:
    """Of weight ``names``, the key projections of the lowest and highest layer index (fused qkv weights count)."""
    found = sorted(((int(m.group(1)), n) for n in names if (m := _KEY_PROJ.search(n))), key=lambda x: (x[0], x[1]))
    if not found:
        return []
    first, last = found[0][0], found[-1][0]
    return sorted({n for i, n in found if i in (first, last)})


def _identity(name: str, config, tensors: dict[str, torch.Tensor]) -> ModelIdentity:
    if not tensors:
        raise ConfigError(f"{name}: no key projection weights found (layers.N....k_proj / qkv_proj)")
    h = hashlib.sha256()
    for n in sorted(tensors):
        h.update(re.sub(r"^.*?layers\.", "layers.", n).encode())
        h.update(tensor_digest(tensors[n]))
    return ModelIdentity(_safe_name(name), config_digest(config), h.hexdigest())


def _safe_name(name: str) -> str:
    base = Path(str(name).rstrip("/")).name or "model"
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", base)[:64]


def model_identity(model) -> ModelIdentity:
    """The identity of a loaded transformers model."""
    params = dict(model.named_parameters())
    names = key_projection_names(params)
    name = getattr(model, "name_or_path", "") or type(model).__name__
    return _identity(name, decoder_config(model), {n: params[n] for n in names})


def checkpoint_identity(model_dir: str | os.PathLike) -> ModelIdentity:
    """The identity of a checkpoint directory (config.json + safetensors), reading only the sampled tensors."""
    from safetensors import safe_open
    from transformers import AutoConfig

    path = Path(model_dir)
    config = AutoConfig.from_pretrained(path)
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path}: no *.safetensors weights to calibrate from")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            where.update({k: f for k in st.keys()})
    tensors = {}
    for n in key_projection_names(where):
        with safe_open(str(where[n]), "pt") as st:
            tensors[n] = st.get_tensor(n)
    return _identity(path.name, config, tensors)


def entry_path(identity: ModelIdentity, tag: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache entry (transform file) of a model identity and recipe tag."""
    return calibration_dir(cache_dir) / f"{identity.name}-{identity.key}-{tag}.pt"


def entry_meta(identity: ModelIdentity, tag: str, num_layers: int, kv_heads: int, head_dim: int) -> dict:
    """What an entry records to be checked against on reading."""
    return {
        "model": identity.name,
        "config_digest": identity.config,
        "weights_digest": identity.weights,
        "recipe": tag,
        "calibration_version": CALIBRATION_VERSION,
        "num_layers": num_layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
    }


def read_entry(path: Path, expected: dict) -> list[KeyTransform | None]:
    """The transforms of an entry, every field of ``expected`` (``entry_meta``) checked; StaleCalibrationError
    naming the first difference, or the file's fault (missing, truncated, unreadable)."""
    try:
        layers, meta = load_transforms(path)
    except ConfigError as e:
        raise StaleCalibrationError(str(e)) from None
    for field, want in expected.items():
        if meta.get(field) != want:
            raise StaleCalibrationError(
                f"{path}: made for {field} {meta.get(field)!r}, expected {want!r} (another model, recipe or version)"
            )
    shapes = {(t.num_heads, t.head_dim) for t in layers if t is not None}
    if len(layers) != expected["num_layers"] or shapes != {(expected["kv_heads"], expected["head_dim"])}:
        raise StaleCalibrationError(
            f"{path}: {len(layers)} layers of (KV heads, head dim) {sorted(shapes)}, expected "
            f"{expected['num_layers']} of ({expected['kv_heads']}, {expected['head_dim']})"
        )
    return layers


def write_entry(path: Path, transforms: list[KeyTransform], meta: dict, config_yaml: str) -> None:
    """Write an entry and its config beside it (``.yaml``), each atomically: a temporary file renamed into place, so
    a killed writer leaves no half-written entry."""
    _atomic(path, lambda tmp: save_transforms(tmp, list(transforms), meta))
    _atomic(path.with_suffix(".yaml"), lambda tmp: Path(tmp).write_text(config_yaml, encoding="utf-8"))


def _atomic(target: Path, write) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
