"""``auto``: the calibrated format for any model, calibrated on first use and cached by model identity.

``config_for_model`` (``TurboQuantCache(model, "auto")``) and ``config_for_checkpoint`` (the vLLM plugin, from the
model directory before the engine starts) look the model's entry up (``store``), calibrate on a miss or a stale
entry (progress lines on stderr), and serve the calibrated config. A model that cannot be calibrated (no weights, a
dummy load, no tokenizer, an attention the capture does not recognise) gets ``FALLBACK_PRESET`` with one log line
saying why, never an exception.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import torch

from ..config import AUTO_FORMAT, FALLBACK_PRESET, TurboQuantConfig, config_from_dict, load_config
from ..integrations.transformers import model_dims
from .capture import decoder_config
from .keys import Progress, Recipe, calibrate_model
from .sink import sink_first_tokens
from .store import (
    StaleCalibrationError,
    checkpoint_identity,
    entry_meta,
    entry_path,
    model_identity,
    read_entry,
    write_entry,
)
from .text import calibration_ids

LOGGER = logging.getLogger("jetson_tq.calibration")


def auto_recipe() -> Recipe:
    """The recipe ``auto`` calibrates: ``config.AUTO_FORMAT``'s key mode, code bytes, value bits and window."""
    keys, values, buffer = AUTO_FORMAT["keys"], AUTO_FORMAT["values"], AUTO_FORMAT["buffer"]
    return Recipe(
        key_mode=keys["mode"],
        code_bytes=keys["code_bytes"],
        value_bits=values["bits"],
        recent_tokens=buffer["recent_tokens"],
    )


def stderr_progress(msg: str) -> None:
    """Progress of a calibration on the console."""
    print(f"[jetson-tq calibrate] {msg}", file=sys.stderr, flush=True)


def _dims(config) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a decoder config."""
    layers, _, kv, head_dim = model_dims(config)
    return layers, kv, head_dim


def _tokenizer_of(model):
    from transformers import AutoTokenizer

    source = getattr(model, "name_or_path", "") or ""
    if not source:
        raise ValueError("the model names no directory or hub id to load its tokenizer from (pass tokenizer=)")
    return AutoTokenizer.from_pretrained(source)


def calibrate_entry(
    model,
    tokenizer,
    recipe: Recipe | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: Progress | None = stderr_progress,
    identity=None,
) -> Path:
    """The cache entry of ``model`` under ``recipe``: read when valid, else calibrated on the shipped text and
    written. Raises what stops a calibration (the caller decides whether to fall back)."""
    recipe = recipe or auto_recipe()
    identity = identity or model_identity(model)
    path = entry_path(identity, recipe.tag, cache_dir)
    layers, kv, head_dim = _dims(decoder_config(model))
    meta = entry_meta(identity, recipe.tag, layers, kv, head_dim)
    say = progress or (lambda _msg: None)
    if path.exists():
        try:
            read_entry(path, meta)
            return path
        except StaleCalibrationError as e:
            say(f"recalibrating: {e}")
    if tokenizer is None:
        tokenizer = _tokenizer_of(model)
    ids = calibration_ids(tokenizer, recipe.windows, recipe.window_len).to(model.device)
    say(
        f"calibrating {identity.name} ({layers} layers, {kv} KV heads, head dim {head_dim}) for {recipe.tag} on "
        f"{ids.numel():,} tokens of the shipped text; once per model, cached at {path}"
    )
    t0 = time.monotonic()
    firsts = None
    if recipe.sink == "calibrated":
        firsts = sink_first_tokens(ids, list(getattr(tokenizer, "all_special_ids", []) or []))
    with torch.no_grad():
        transforms = calibrate_model(model, ids, recipe, say, sink_firsts=firsts)
    meta["created"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    meta["tokens"] = int(ids.numel())
    write_entry(path, transforms, meta, _yaml(recipe.config_dict(path.name, identity.name)))
    say(f"calibrated in {time.monotonic() - t0:.1f} s: {path}")
    return path


def _yaml(mapping: dict) -> str:
    import yaml

    return yaml.safe_dump(mapping, sort_keys=False)


def entry_config(path: Path, recipe: Recipe, name: str) -> TurboQuantConfig:
    """The config of a cache entry (its transform file named by absolute path)."""
    return config_from_dict(recipe.config_dict(str(path), name), name=f"auto-{recipe.tag}")


def fall_back(why: str) -> TurboQuantConfig:
    """``FALLBACK_PRESET``, with the one log line saying why."""
    LOGGER.warning("jetson-tq: auto: %s; serving %s (calibration-free)", why, FALLBACK_PRESET)
    return load_config(FALLBACK_PRESET)


def config_for_model(
    model,
    tokenizer=None,
    cache_dir: str | os.PathLike | None = None,
    recipe: Recipe | None = None,
    progress: Progress | None = stderr_progress,
) -> TurboQuantConfig:
    """``auto`` for a loaded transformers model: its calibrated config (calibrated now unless cached), or
    ``FALLBACK_PRESET``'s with one log line when it cannot be calibrated."""
    recipe = recipe or auto_recipe()
    try:
        path = calibrate_entry(model, tokenizer, recipe, cache_dir, progress)
    except Exception as e:  # any reason a model cannot be calibrated: the fallback serves it, the line says why
        return fall_back(f"cannot calibrate {type(model).__name__} ({type(e).__name__}: {e})")
    return entry_config(path, recipe, getattr(model, "name_or_path", "") or type(model).__name__)


def config_for_checkpoint(
    model_dir: str | os.PathLike,
    load_format: str = "auto",
    cache_dir: str | os.PathLike | None = None,
    recipe: Recipe | None = None,
    progress: Progress | None = stderr_progress,
) -> str:
    """``auto`` for a model directory (the vLLM plugin, before the engine starts): the path of its cached config
    (calibrated now, from the checkpoint through transformers, unless cached), or ``FALLBACK_PRESET`` with one log
    line when it cannot be calibrated (a dummy load, no directory, no weights, ...)."""
    recipe = recipe or auto_recipe()
    if str(load_format).lower() == "dummy":
        return _fallback_name("load_format 'dummy': random weights have nothing to calibrate")
    try:
        path = _local_dir(str(model_dir))
    except Exception as e:
        return _fallback_name(f"{model_dir}: no local checkpoint ({type(e).__name__}: {e})")
    if not (path / "config.json").is_file():
        return _fallback_name(f"{model_dir}: not a model directory with a config.json")
    try:
        identity = checkpoint_identity(path)
        entry = entry_path(identity, recipe.tag, cache_dir)
        if entry.exists():
            try:
                from transformers import AutoConfig

                config = AutoConfig.from_pretrained(path)
                config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
                read_entry(entry, entry_meta(identity, recipe.tag, *_dims(config)))
                return str(entry.with_suffix(".yaml"))
            except StaleCalibrationError as e:
                (progress or (lambda _m: None))(f"recalibrating: {e}")
        model, tokenizer = _load_checkpoint(path)
        done = calibrate_entry(model, tokenizer, recipe, cache_dir, progress, identity=identity)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return str(done.with_suffix(".yaml"))
    except Exception as e:  # see config_for_model
        return _fallback_name(f"cannot calibrate {model_dir} ({type(e).__name__}: {e})")


def _local_dir(model: str) -> Path:
    """A model directory, or a hub id's local snapshot (the files a calibration reads; downloaded if missing, as
    vLLM's worker would)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
    return Path(snapshot_download(model, allow_patterns=patterns))


def _fallback_name(why: str) -> str:
    fall_back(why)
    return FALLBACK_PRESET


def _load_checkpoint(path: Path):
    """(model, tokenizer) of a checkpoint in transformers, on the GPU in bf16 when there is one, else fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16 if cuda else torch.float32, device_map="cuda" if cuda else None
    ).eval()
    return model, AutoTokenizer.from_pretrained(path)
