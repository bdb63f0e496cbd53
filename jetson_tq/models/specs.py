"""Model descriptions for capacity reports: the shipped YAMLs in ``configs/models/`` (layers, KV heads, weights).

Only what sizes the KV cache and the weights is kept; no model is downloaded. Unknown or missing
keys are ConfigErrors naming the file and the key.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import env
from ..config import CONFIG_DIR, read_yaml, resolve_named_yaml
from ..errors import ConfigError

_MODELS_DIR = env.read().models_dir
MODELS_DIR = Path(CONFIG_DIR / "models" if _MODELS_DIR is None else _MODELS_DIR)

_INT_KEYS = (
    "num_layers",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "weight_bytes",
)
_OPTIONAL = {
    "hf_id": "",
    "family": "",
    "tie_word_embeddings": False,
    "qkv_bias": False,
    "qk_norm": False,
    "weight_dtype": "bfloat16",
}


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer, as far as KV cache and weight memory go."""

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    weight_bytes: int
    hf_id: str = ""
    family: str = ""
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    weight_dtype: str = "bfloat16"

    def to_dict(self) -> dict:
        return asdict(self)

    def estimated_parameters(self) -> int:
        """Parameter count of a Llama/Qwen-style decoder with this shape (checks ``weight_bytes``)."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        layer = attn + 3 * h * self.intermediate_size + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embeddings + h


def model_names() -> list[str]:
    """Names of the shipped model descriptions."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.yaml"))


def model_spec_from_dict(raw: dict, where: str = "model") -> ModelSpec:
    """Validate a parsed model YAML (ConfigError names the bad key)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    allowed = {"name", *_INT_KEYS, *_OPTIONAL}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(allowed)}")
    missing = sorted({"name", *_INT_KEYS} - set(raw))
    if missing:
        raise ConfigError(f"{where}: missing key(s) {missing}")
    for key in _INT_KEYS:
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: {key}: expected an integer >= 1, got {value!r}")
    for key in ("name", *_OPTIONAL):
        want = bool if isinstance(_OPTIONAL.get(key, ""), bool) else str
        if key in raw and not isinstance(raw[key], want):
            raise ConfigError(
                f"{where}: {key}: expected {'true or false' if want is bool else 'a string'}, got "
                f"{type(raw[key]).__name__} {raw[key]!r}"
            )
    if raw["num_attention_heads"] % raw["num_kv_heads"]:
        raise ConfigError(
            f"{where}: num_attention_heads {raw['num_attention_heads']} is not a multiple of "
            f"num_kv_heads {raw['num_kv_heads']}"
        )
    return ModelSpec(**{**_OPTIONAL, **raw})


def load_model_spec(name_or_path: str | os.PathLike) -> ModelSpec:
    """A shipped model by name (``qwen2.5-7b-instruct``) or a YAML file by path."""
    plain = isinstance(name_or_path, str) and Path(name_or_path).suffix not in (".yaml", ".yml")
    name = name_or_path.lower() if plain and isinstance(name_or_path, str) else name_or_path
    path = resolve_named_yaml(name, MODELS_DIR, "model", model_names())
    return model_spec_from_dict(read_yaml(path), str(path))
