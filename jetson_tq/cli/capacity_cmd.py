"""``python -m jetson_tq capacity``: fp16 vs TurboQuant tokens that fit this device (or a given budget).

Table by default, ``--json`` for machines, a PNG plot (tokens vs memory per preset), and a measured
check: a real CompressedKVCache of N tokens per distinct layer format, formula vs allocated bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..arg_types import device_name, fraction, nonnegative_float, positive_float, positive_int
from ..config import DEFAULT_PRESET, load_config, preset_names
from ..errors import ConfigError
from ..models.specs import ModelSpec, load_model_spec
from ..reports.capacity import KVBudget, capacity_report, format_measurement, format_report, human_bytes, measure_model

DEFAULT_MODEL = "qwen2.5-7b-instruct"
DEFAULT_UTILIZATION = 0.85  # vLLM --gpu-memory-utilization on unified memory: 0.75-0.85 (FIELD_NOTES)
DEFAULT_CONTEXT = 32768
CPU_MEASURE_TOKENS = 1024
GPU_MEASURE_TOKENS = 32768


def resolve_budget(args: argparse.Namespace, model: ModelSpec) -> KVBudget:
    """The KV budget from --kv-budget-gb, --memory-gb, or this machine's probed memory budget."""
    weights = int(args.weights_gb * 1e9) if args.weights_gb is not None else model.weight_bytes
    overhead = int(args.overhead_gb * 1e9)
    if args.kv_budget_gb is not None:
        kv = int(args.kv_budget_gb * 1e9)
        return KVBudget(kv + weights + overhead, 1.0, weights, overhead, "--kv-budget-gb")
    if args.memory_gb is not None:
        budget = KVBudget(
            int(args.memory_gb * 1e9), args.utilization, weights, overhead, f"--memory-gb {args.memory_gb:g}"
        )
    else:
        from ..platform import memory_budget, probe

        info = probe()
        mem = memory_budget(info)
        if mem.available_bytes is None:
            raise ConfigError(
                f"cannot read this machine's memory budget ({mem.note}); pass --memory-gb or --kv-budget-gb"
            )
        budget = KVBudget(mem.available_bytes, args.utilization, weights, overhead, f"this {info.kind}: {mem.source}")
    if budget.kv_bytes <= 0:
        raise ConfigError(
            f"no memory left for the KV cache: {budget.source}: {human_bytes(budget.available_bytes)} x "
            f"utilization {budget.utilization:g} = {human_bytes(budget.usable_bytes)}, "
            f"but weights {human_bytes(weights)} "
            f"+ overhead {human_bytes(overhead)} need more; expected a larger --memory-gb, a smaller "
            f"--weights-gb/--overhead-gb, or --kv-budget-gb"
        )
    return budget


def _measure_device(name: str) -> str:
    """The measured cache's device; DeviceError when 'cuda' is asked for on a machine without one."""
    from ..validate import check_device

    if name != "auto":
        return str(check_device(name))
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _plot_path(args: argparse.Namespace, model: ModelSpec, config_name: str) -> Path:
    path = Path(args.plot) if args.plot else Path("out/capacity") / f"capacity_{model.name}_{config_name}.png"
    if path.is_dir():
        raise ConfigError(f"--plot: expected a PNG file path, got the directory {str(path)!r}")
    return path


def run_capacity(args: argparse.Namespace) -> dict:
    """Compute (and optionally measure and plot) the report; returns everything as one dict."""
    model = load_model_spec(args.model)  # every argument is checked before any work starts
    config = load_config(args.config)
    context = args.context or min(DEFAULT_CONTEXT, model.max_position_embeddings)
    budget = resolve_budget(args, model)
    device = None if args.no_measure else _measure_device(args.device)
    if not args.no_plot:
        names = args.compare.split(",") if args.compare else preset_names()
        configs = [load_config(n) for n in names if n != config.name] + [config]
        path = _plot_path(args, model, config.name)
    out: dict[str, Any] = {"report": capacity_report(model, config, budget, context)}
    if device is not None:
        tokens = args.measure_tokens or (GPU_MEASURE_TOKENS if device.startswith("cuda") else CPU_MEASURE_TOKENS)
        print(f"[jetson-tq] measuring a real {config.name} cache of {tokens:,} tokens on {device}", file=sys.stderr)
        out["measured"] = measure_model(config, model, tokens, device)
    if not args.no_plot:
        from ..reports.plots import plot_capacity

        out["plot"] = str(
            plot_capacity(model, configs, budget.kv_bytes, path, f"{model.name}: KV memory vs tokens ({budget.source})")
        )
    return out


def _run(args: argparse.Namespace) -> int:
    out = run_capacity(args)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0 if out.get("measured", {}).get("ok", True) else 1
    print(format_report(out["report"]))
    if "measured" in out:
        print(format_measurement(out["measured"]))
    if "plot" in out:
        print(f"plot: {out['plot']}")
    ok = out.get("measured", {}).get("ok", True)
    if not ok:
        print(
            "measured bytes disagree with the formula beyond the margin "
            f"({human_bytes(out['measured']['margin_bytes'])})"
        )
    return 0 if ok else 1


def add_capacity_arguments(p: argparse.ArgumentParser) -> None:
    """Model/config/budget options shared by ``capacity`` and the demo."""
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"model name in configs/models or a YAML path (default {DEFAULT_MODEL})"
    )
    p.add_argument("--config", default=DEFAULT_PRESET, help=f"TurboQuant preset or YAML (default {DEFAULT_PRESET})")
    p.add_argument(
        "--memory-gb",
        type=positive_float,
        help="memory available to the model, GB (default: this machine's "
        "budget: MemAvailable on Jetson, free GPU memory, or RAM)",
    )
    p.add_argument(
        "--utilization",
        type=fraction,
        default=DEFAULT_UTILIZATION,
        help=f"fraction of that memory the model may use (default {DEFAULT_UTILIZATION})",
    )
    p.add_argument("--weights-gb", type=nonnegative_float, help="override the model's weight bytes, GB")
    p.add_argument(
        "--overhead-gb", type=nonnegative_float, default=0.0, help="activations/CUDA context to set aside, GB"
    )
    p.add_argument("--kv-budget-gb", type=positive_float, help="give the KV budget directly, GB (overrides the above)")
    p.add_argument(
        "--context",
        type=positive_int,
        help=f"tokens per sequence for the per-sequence view (default min({DEFAULT_CONTEXT}, model max))",
    )


def register(sub) -> None:
    p = sub.add_parser("capacity", help="tokens that fit in fp16 vs TurboQuant, measured against a real cache")
    add_capacity_arguments(p)
    p.add_argument("--compare", help="comma-separated presets to draw in the plot (default: all presets)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--plot", help="PNG path (default out/capacity/capacity_<model>_<config>.png)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument(
        "--measure-tokens",
        type=positive_int,
        help=f"tokens in the measured cache (default {CPU_MEASURE_TOKENS} on CPU, {GPU_MEASURE_TOKENS} on CUDA)",
    )
    p.add_argument("--no-measure", action="store_true", help="skip allocating a real cache")
    p.add_argument("--device", default="auto", type=device_name, help="device of the measured cache: auto, cpu, cuda")
    p.set_defaults(func=_run)
