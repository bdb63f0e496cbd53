"""Calibrate a model's coded keys: capture its attention on calibration ids, fit each layer's key transform by the
recipe's key mode, hold the attention sink where it is constant.

Generic over the key mode: ``KEY_FITTERS`` maps a mode (the format's ``keys.mode``) to the function that fits it
from the captures; ``klt`` (``fit_klt``: the score-weighted KLT of the pre-RoPE keys, ``calibration.fit``) is the
one today, and another mode plugs in by adding its fitter and naming it in a ``Recipe``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..codec.klt import MAX_CODE_BITS, KeyTransform, RotaryParams, save_transforms
from ..errors import ConfigError
from ..format import KEY_CODE_REFERENCE_DIM, KVFormat
from .capture import AttentionCapture, capture_attention
from .fit import (
    LEVEL_KINDS,
    KLTLayer,
    fit_heads,
    gaussian_codebook,
    in_channel_order,
    key_weights,
    received_attention,
)
from .sink import SINK_TOLERANCE, sink_spread

Progress = Callable[[str], None]

#: The code widths a klt calibration allows by default: (2, 4, 8) keeps every code inside one byte, which the kernels
#: read without a second load; () allows any of 0..8. Held out, both measure the same (docs/fidelity.md).
DEFAULT_WIDTHS: tuple[int, ...] = (2, 4, 8)
DEFAULT_LEVELS = "cubic"
SINK_CHOICES = ("calibrated", "none")
#: "klt": the attention-weighted KLT (a D x D decode per key); "diagonal": no transform, each pre-RoPE channel
#: whitened by its own scale and coded alone (decode read without the D x D product: ``KltSpec.DIAGONAL``)
TRANSFORMS = ("klt", "diagonal")


@dataclass(frozen=True)
class Recipe:
    """What a calibration fits and the config it serves: the key mode and its code bytes at head dim 128, the
    transform (``TRANSFORMS``), code widths and levels, whether the attention sink is calibrated, the value bits and
    exact window of the config, and the calibration text's windows. Its ``tag`` names the cache entry, so a changed
    recipe never reads an old one."""

    key_mode: str = "klt"
    code_bytes: int = 52
    widths: tuple[int, ...] = DEFAULT_WIDTHS
    levels: str = DEFAULT_LEVELS
    sink: str = "calibrated"
    value_bits: int = 3
    recent_tokens: int = 256
    windows: int = 8  # SmolLM2 held out, Opticks: +0.82 % at 8 windows, +1.06 % at 2 (docs/fidelity.md)
    window_len: int = 1024
    transform: str = "klt"

    def __post_init__(self) -> None:
        if self.key_mode not in KEY_FITTERS:
            raise ConfigError(f"calibration key mode {self.key_mode!r}: expected one of {sorted(KEY_FITTERS)}")
        if self.levels not in LEVEL_KINDS:
            raise ConfigError(f"levels {self.levels!r}: expected one of {LEVEL_KINDS}")
        if self.transform not in TRANSFORMS:
            raise ConfigError(f"transform {self.transform!r}: expected one of {TRANSFORMS}")
        if self.sink not in SINK_CHOICES:
            raise ConfigError(f"sink {self.sink!r}: expected one of {SINK_CHOICES}")
        if any(not 1 <= w <= MAX_CODE_BITS for w in self.widths):
            raise ConfigError(f"widths {self.widths}: expected code widths between 1 and {MAX_CODE_BITS}")
        if self.windows < 1 or self.window_len < 256:
            raise ConfigError(f"{self.windows} x {self.window_len} tokens: expected >= 1 window of >= 256 tokens")
        self.key_format()  # a bad code size is a named error now

    def key_format(self) -> KVFormat:
        """The format the calibrated config serves (every layer)."""
        try:
            return KVFormat(
                key_mode=self.key_mode,  # type: ignore[arg-type]  # checked by KVFormat against its key modes
                key_code_bytes=self.code_bytes,
                value_mode="mse",
                value_bits=self.value_bits,
                recent_tokens=self.recent_tokens,
            )
        except Exception as e:
            raise ConfigError(f"calibration recipe: {e}") from e

    @property
    def tag(self) -> str:
        """A file-name-safe name of everything that changes the fit, e.g. ``klt52-w248-cubic-sink-2x1024`` (a
        diagonal transform adds ``-diag``)."""
        widths = "w" + ("".join(map(str, self.widths)) or "any")
        sink = "sink" if self.sink == "calibrated" else "nosink"
        diag = "-diag" if self.transform == "diagonal" else ""
        return f"{self.key_mode}{self.code_bytes}{diag}-{widths}-{self.levels}-{sink}-{self.windows}x{self.window_len}"

    def config_dict(self, transform_file: str, model: str) -> dict:
        """The config (as its YAML mapping) of the calibrated format around a transform file."""
        return {
            "name": f"auto-{self.key_mode}{self.code_bytes}",
            "description": f"{self.key_mode} keys calibrated for {model} (jetson_tq.calibration, recipe {self.tag})",
            "keys": {"mode": self.key_mode, "code_bytes": self.code_bytes},
            "values": {"mode": "mse", "bits": self.value_bits},
            "buffer": {"recent_tokens": self.recent_tokens, "window": "block", "sink_tokens": 0},
            "key_transform": transform_file,
        }


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


def fit_klt(cap: AttentionCapture, recipe: Recipe, skip: int) -> KeyTransform:
    """One layer's klt transform: pre-RoPE keys and queries (the model's RoPE undone), each key weighted by the
    attention it receives from queries that read it compressed, positions < ``skip`` left out; every KV head fitted
    at once in float64 where the capture is (the GPU for a model on it; ``calibration.fit.fit_heads``), returned on
    the CPU. ``recipe.transform`` "diagonal": no transform (each channel whitened by its own scale, its own
    coefficient, in channel order: a diagonal decode matrix)."""
    rotary = cap.rotary
    t, d = cap.k.shape[2], cap.k.shape[3]
    pos = torch.arange(t, device=cap.k.device)
    weights = key_weights(received_attention(cap.q, cap.k, cap.scaling)[:, :, skip:])
    k = rotary.apply(cap.k.double(), pos, inverse=True)[:, :, skip:]
    q = rotary.apply(cap.q.double(), pos, inverse=True)[:, :, skip:]  # [B, H, T', D], [B, Hq, T', D]
    h, g = k.shape[1], q.shape[1] // k.shape[1]
    budget = recipe.key_format().key_code_bits(d)
    b = k.shape[0]
    fields = fit_heads(
        k.transpose(0, 1).reshape(h, -1, d),
        q.reshape(b, h, g, -1, d).permute(1, 2, 0, 3, 4).reshape(h, -1, d),  # each head's query group
        weights.transpose(0, 1).reshape(h, -1),
        budget,
        widths=recipe.widths,
        levels=recipe.levels,
        block=1 if recipe.transform == "diagonal" else 0,
        rotary_dim=rotary.rotary_dim,
    )
    if recipe.transform == "diagonal":
        fields = in_channel_order(fields)
    layer = KLTLayer(
        mean=fields["mean"].float(),
        encode=fields["encode"].float(),
        decode=fields["decode"].float(),
        sigma=fields["sigma"].float(),
        bits=fields["bits"],
        levels=fields["levels"].float(),
    )
    return to_key_transform(layer, RotaryParams(rotary.inv_freq.float(), rotary.attention_scaling)).to("cpu")


#: key mode -> fitter(capture of one layer, recipe, positions to leave out) -> that layer's transform
KEY_FITTERS: dict[str, Callable[[AttentionCapture, Recipe, int], KeyTransform]] = {"klt": fit_klt}


def calibrate_model(
    model,
    ids: torch.Tensor,
    recipe: Recipe | None = None,
    progress: Progress | None = None,
    sink_firsts: torch.Tensor | None = None,
    skip: int = 0,
) -> list[KeyTransform]:
    """Per attention layer the key transform of ``model`` under ``recipe``, fitted on token ids [rows, T >= 256]
    (each row one window from position 0). ``sink_firsts`` (first token ids [N], ``sink.sink_first_tokens``): the
    layers whose position 0 is the same key and value over them (``SINK_TOLERANCE``) get that calibrated sink and are
    fitted without position 0; the others fit position 0's atypical key into the transform. ``skip``: positions left
    out everywhere (a format that keeps them exact; not with a calibrated sink)."""
    recipe = recipe or Recipe()
    if ids.dim() != 2 or ids.shape[1] < 256:
        raise ConfigError(f"calibration ids: expected [rows, T >= 256] token ids, got {tuple(ids.shape)}")
    if sink_firsts is not None and skip:
        raise ConfigError("a calibrated sink and exact sink tokens both read position 0: keep one")
    say = progress or (lambda _msg: None)
    t0 = time.monotonic()
    caps = capture_attention(model, ids)
    say(f"captured {len(caps)} attention layers over {ids.numel():,} tokens in {time.monotonic() - t0:.1f} s")
    sinks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if sink_firsts is not None:
        spread = sink_spread(model, sink_firsts.to(ids.device), ids[0, :512])
        sinks = {i: (spread.key[i], spread.value[i]) for i in spread.constant_layers(SINK_TOLERANCE)}
        say(
            f"calibrated sink in layers {sorted(sinks)} (position 0 within {SINK_TOLERANCE:.0%} over "
            f"{len(sink_firsts)} first tokens)"
        )
    fitter = KEY_FITTERS[recipe.key_mode]
    out: list[KeyTransform] = []
    n, step = len(caps), max(1, len(caps) // 8)
    caps.reverse()
    while caps:  # each layer's capture freed once fitted
        i = len(out)
        transform = fitter(caps.pop(), recipe, 1 if i in sinks else skip)
        if i in sinks:
            transform = replace(transform, sink_key=sinks[i][0].float(), sink_value=sinks[i][1].float())
        out.append(transform)
        if (i + 1) % step == 0 or i + 1 == n:
            say(f"layer {i + 1}/{n} fitted ({time.monotonic() - t0:.1f} s)")
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
    transform: str = "klt",
) -> None:
    """Save ``transforms`` to ``path`` with what they were fitted on (the file a config's ``key_transform`` names)."""
    meta = {
        "sink_tokens": sink_tokens,
        "calibrated_sink_layers": [i for i, t in enumerate(transforms) if t.has_sink],
        "model": model_name,
        "text": text_name,
        "tokens": tokens,
        "key_code_bytes": code_bytes,
        "reference_dim": KEY_CODE_REFERENCE_DIM,
        "coder": (
            "attention-weighted KLT" if transform == "klt" else "no transform (channels whitened, diagonal decode)"
        )
        + f", water-filled bits, fitted {levels} levels",
        "created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    save_transforms(path, list(transforms), meta)
