"""Calibrate a model's transform-coded keys (key_mode ``klt``): capture its attention on calibration text, fit each
layer's ``codec.klt.KeyTransform`` (``klt_keys.calibrate``: attention-weighted KLT, water-filled bits, fitted
levels) and write the file a config's ``key_transform`` names."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from ..codec.klt import MAX_CODE_BITS, KeyTransform, RotaryParams, save_transforms
from ..errors import ConfigError
from ..format import KEY_CODE_REFERENCE_DIM
from ..integrations.transformers import UnsupportedModelError, check_model_supported, model_dims
from .klt_keys import KLTKeys, KLTLayer, calibrate, gaussian_codebook
from .sink import SINK_TOLERANCE, sink_spread
from .smartmix import capture

#: The code widths ``calibrate_model`` allows by default: (2, 4, 8) keeps every code inside one byte, which the
#: kernels read without a second load; () allows any of 0..8. Held out, both measure the same (docs/fidelity.md,
#: "Quality at 5x").
DEFAULT_WIDTHS: tuple[int, ...] = (2, 4, 8)

#: How ``calibrate_model`` fits each coefficient's levels by default: "cubic" (a cubic of the code, which the kernels
#: compute without a table) or "lloyd" (a Lloyd-Max codebook on the calibration coefficients, read from a table).
#: Held out, both measure the same (docs/fidelity.md, "Quality at 5x").
DEFAULT_LEVELS = "cubic"
LEVEL_KINDS = ("lloyd", "cubic")

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


def to_key_transform(layer: KLTLayer, rotary: RotaryParams) -> KeyTransform:
    """The product form of one calibrated layer: every coefficient's levels spelled out (Gaussian codebooks scaled by
    the coefficient's sigma where no fitted levels exist)."""
    levels = layer.levels
    if levels is None:
        h, d = layer.bits.shape
        levels = torch.zeros(h, d, 1 << MAX_CODE_BITS)
        for b in range(1, MAX_CODE_BITS + 1):
            book = gaussian_codebook(b)[0]
            full = torch.cat([book, book[-1:].expand((1 << MAX_CODE_BITS) - book.numel())])
            mask = layer.bits == b
            levels[mask] = full[None, :] * layer.sigma[mask][:, None]
    return KeyTransform(
        layer.mean.float(), layer.encode.float(), layer.decode.float(), layer.bits.long(), levels.float(), rotary
    )


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
    """Per layer the key transform of ``model`` for klt keys of ``code_bytes`` bytes at head dim 128, fitted on token
    ids [rows, T] (each row one calibration window from position 0). Positions < ``sink_tokens`` are left out (a
    format that keeps them exact never codes them); with none, the first position's atypical key is fitted too, which
    is what lets a format without a sink code it well (docs/fidelity.md, "The 5x preset"). ``widths``: the code widths
    the bits may take (``DEFAULT_WIDTHS``); ``levels``: how each coefficient's levels are fitted (``LEVEL_KINDS``).
    ``sink_firsts`` (first token ids [N], ``eval.sink.sink_first_tokens``): the layers whose position 0 is the same
    key and value over them (``SINK_TOLERANCE``) get that calibrated sink and are fitted without position 0."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    check_model_supported(config)
    if ids.dim() != 2 or ids.shape[1] < 256:
        raise ConfigError(f"calibration ids: expected [rows, T >= 256] token ids, got {tuple(ids.shape)}")
    if sink_firsts is not None and sink_tokens:
        raise ConfigError("a calibrated sink and exact sink tokens both read position 0: keep one")
    _, _, _, head_dim = model_dims(config)
    rotary = model_rotary(model)
    spec = calibration_spec(code_bytes, widths, levels)
    say = progress or (lambda _msg: None)
    t0 = time.monotonic()
    with torch.no_grad():
        caps = capture(model, ids)
    say(f"captured {len(caps)} layers over {ids.numel():,} tokens in {time.monotonic() - t0:.1f} s")
    sinks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if sink_firsts is not None:
        spread = sink_spread(model, sink_firsts, ids[0, :512])
        sinks = {i: (spread.key[i], spread.value[i]) for i in spread.constant_layers(SINK_TOLERANCE)}
        say(
            f"calibrated sink in layers {sorted(sinks)} (position 0 within {SINK_TOLERANCE:.0%} "
            f"over {len(sink_firsts)} first tokens)"
        )
    out = []
    for i, cap in enumerate(caps):
        layer = calibrate(spec, [cap], head_dim, 0.0, skip=1 if i in sinks else sink_tokens, rotary=rotary)[0]
        transform = to_key_transform(layer, rotary)
        if i in sinks:
            transform = replace(transform, sink_key=sinks[i][0].float(), sink_value=sinks[i][1].float())
        out.append(transform)
        say(f"layer {i + 1}/{len(caps)} calibrated ({time.monotonic() - t0:.1f} s)")
    return out


def write_calibration(
    path: str | Path,
    transforms: list[KeyTransform],
    code_bytes: int,
    model_name: str,
    text_name: str,
    tokens: int,
    sink_tokens: int = 0,
    levels: str = DEFAULT_LEVELS,
) -> None:
    """Save ``transforms`` with what they were fitted on."""
    meta = {
        "sink_tokens": sink_tokens,
        "calibrated_sink_layers": [i for i, t in enumerate(transforms) if t.has_sink],
        "model": model_name,
        "text": text_name,
        "tokens": tokens,
        "key_code_bytes": code_bytes,
        "reference_dim": KEY_CODE_REFERENCE_DIM,
        "coder": f"attention-weighted KLT, water-filled bits, fitted {levels} levels",
        "created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    save_transforms(path, list(transforms), meta)
