"""The lab's entry to key calibration (key_mode ``klt``): the product's driver (``jetson_tq.calibration.keys``) with
the lab's options (exact sink tokens, the evaluation coder's spec, the model's RoPE by its ``rotary_emb``); the file a
config's ``key_transform`` names is written by the product's ``write_calibration`` (re-exported here)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from jetson_tq.calibration.capture import decoder_config
from jetson_tq.calibration.fit import LEVEL_KINDS
from jetson_tq.calibration.keys import DEFAULT_LEVELS, DEFAULT_WIDTHS, Recipe, to_key_transform, write_calibration
from jetson_tq.calibration.keys import calibrate_model as calibrate_keys
from jetson_tq.codec.klt import KeyTransform, RotaryParams
from jetson_tq.errors import ConfigError, UnsupportedModelError
from jetson_tq.integrations.transformers import check_model_supported

from .klt_keys import KLTKeys

__all__ = [
    "DEFAULT_LEVELS",
    "DEFAULT_WIDTHS",
    "LEVEL_KINDS",
    "calibrate_model",
    "calibration_spec",
    "model_rotary",
    "to_key_transform",
    "write_calibration",
]


#: RoPE variants whose frequencies do not depend on the sequence length: one transform serves every position.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def model_rotary(model) -> RotaryParams:
    """The model's RoPE as applied to keys (frequencies, attention scaling); UnsupportedModelError for RoPE whose
    frequencies change with the length (dynamic NTK, LongRoPE), which one calibration cannot serve."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    freq = getattr(rotary, "inv_freq", None)
    if freq is None:
        raise UnsupportedModelError(f"{type(model).__name__}: no model.rotary_emb.inv_freq to calibrate keys against")
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE type {rope_type!r}: its frequencies change with the sequence length; klt keys serve "
            f"{STATIC_ROPE_TYPES}"
        )
    return RotaryParams(freq.detach().float().cpu().clone(), float(getattr(rotary, "attention_scaling", 1.0)))


def calibration_spec(
    code_bytes: int, widths: tuple[int, ...] = DEFAULT_WIDTHS, levels: str = DEFAULT_LEVELS
) -> KLTKeys:
    """The evaluation coder's spec that ``calibrate_model`` fits: attention-weighted statistics, ``widths``, ``levels``
    (``LEVEL_KINDS``; ConfigError for others)."""
    if levels not in LEVEL_KINDS:
        raise ConfigError(f"levels {levels!r}: expected one of {LEVEL_KINDS}")
    return KLTKeys(code_bytes, attention=True, lloyd=levels == "lloyd", cubic=levels == "cubic", widths=widths)


def calibrate_model(
    model,
    ids: torch.Tensor,
    code_bytes: int,
    progress: Callable[[str], None] | None = None,
    sink_tokens: int = 0,
    widths: tuple[int, ...] = DEFAULT_WIDTHS,
    levels: str = DEFAULT_LEVELS,
    sink_firsts: torch.Tensor | None = None,
) -> list[KeyTransform]:
    """The product's calibration (``jetson_tq.calibration.keys.calibrate_model``) of klt keys of ``code_bytes`` at
    head dim 128 on token ids [rows, T >= 256]; positions < ``sink_tokens`` left out (a format that keeps them
    exact); ``sink_firsts``: the calibrated sink (see there)."""
    check_model_supported(decoder_config(model))
    if ids.dim() != 2 or ids.shape[1] < 256:
        raise ConfigError(f"calibration ids: expected [rows, T >= 256] token ids, got {tuple(ids.shape)}")
    if levels not in LEVEL_KINDS:
        raise ConfigError(f"levels {levels!r}: expected one of {LEVEL_KINDS}")
    recipe = Recipe(code_bytes=code_bytes, widths=widths, levels=levels, windows=ids.shape[0], window_len=ids.shape[1])
    return calibrate_keys(model, ids, recipe, progress, sink_firsts=sink_firsts, skip=sink_tokens)
