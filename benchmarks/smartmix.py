r"""SmartMix calibration on SmolLM2-135M: per-layer key/value bits at the default preset's average bytes per token.

    PYTHONPATH=. .venv/bin/python benchmarks/smartmix.py --out out/smartmix   # ~5 min on 2 CPU cores

Calibrates on the *last* essay tokens (the fidelity harness scores the first ones, so its numbers
for the written config are on text the calibration never saw), writes
``<out>/smartmix_smollm2-135m.yaml`` (a per-layer config ``jetson_tq.config`` loads) and
``<out>/smartmix.json`` (per-layer errors and picks). Compare it with the default:

    PYTHONPATH=. .venv/bin/python benchmarks/fidelity.py --rows mse_k4v3 \
        --extra-configs <out>/smartmix_smollm2-135m.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import yaml

from jetson_tq.config import config_from_dict, load_config
from jetson_tq.models.smollm2 import load_smollm2
from jetson_tq.models.text import essay_text
from lab.eval import smartmix as S

ROOT = Path(__file__).resolve().parents[1]
# (key bits, value bits, value group): mse keys, group values, the default's buffer and flush chunk
CANDIDATES = [
    (2, 3, 64),
    (3, 2, 32),
    (3, 3, 64),
    (4, 2, 64),
    (3, 3, 32),
    (4, 3, 64),
    (3, 4, 64),
    (4, 4, 64),
    (5, 4, 64),
    (4, 5, 64),
    (5, 5, 64),
    (6, 6, 64),
]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "out" / "smartmix"))
    p.add_argument("--windows", type=int, default=2, help="calibration windows (from the end of the essays)")
    p.add_argument("--window-len", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--target", default="mse_k4v3", help="preset whose mean bytes per token is the budget (and base format)"
    )
    p.add_argument(
        "--budget",
        type=float,
        default=0.0,
        help="mean bytes per token per KV head at --cost-head-dim (0: the --target preset's)",
    )
    p.add_argument(
        "--cost-head-dim",
        type=int,
        default=0,
        help="head dim the bytes are counted at (0: the model's); "
        "128 prices a mix the way a head-dim-128 model stores it",
    )
    p.add_argument("--candidates", default="", help="k,v,g;k,v,g;... (mse key bits, group value bits, value group)")
    p.add_argument(
        "--sensitivity",
        default="proxy",
        choices=("proxy", "kl"),
        help="proxy: attention-output error only; kl: also measure each layer's output KL alone at k3v2 "
        "(one window) and scale that layer's proxy errors to it",
    )
    p.add_argument("--kl-tokens", type=int, default=1024, help="tokens of the one window the KL sensitivity uses")
    p.add_argument("--kl-probe", default="k3v2g32", help="the candidate each layer is stored in alone for its KL")
    p.add_argument("--name", default="smartmix_smollm2-135m")
    p.add_argument("--reuse-errors", default="", help="smartmix.json of an earlier run: reuse its proxy errors")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model, tok = load_smollm2()
    n_layers, head_dim = model.config.num_hidden_layers, model.config.head_dim
    ids = tok(essay_text(), return_tensors="pt").input_ids[0]
    calib = ids[-args.windows * args.window_len :].reshape(args.windows, args.window_len)
    base = load_config(args.target).default
    grid = [tuple(int(x) for x in c.split(",")) for c in args.candidates.split(";")] if args.candidates else CANDIDATES
    candidates = {
        f"k{k}v{v}g{g}": base.with_(key_mode="mse", key_bits=k, value_mode="group", value_bits=v, value_group=g)
        for k, v, g in grid
    }
    cost_dim = args.cost_head_dim or head_dim
    cost = {n: f.bytes_per_token(cost_dim) for n, f in candidates.items()}
    budget = int((args.budget or base.bytes_per_token(cost_dim)) * n_layers)
    if args.reuse_errors:  # the proxy errors of an earlier run (same candidates and calibration text)
        errors = json.loads(Path(args.reuse_errors).read_text())["proxy_errors"]
    else:
        errors = S.layer_errors(
            model, S.capture(model, calib), candidates, chunk=args.chunk, progress=lambda m: print(m, flush=True)
        )
    proxy_errors = errors
    kl = None
    if args.sensitivity == "kl":
        probe = args.kl_probe
        kl = S.layer_kl(
            model,
            calib[:1, : args.kl_tokens],
            candidates[probe],
            chunk=args.chunk,
            progress=lambda m: print(m, flush=True),
        )
        errors = S.weight_errors(errors, kl, probe)
    picks = S.allocate(errors, cost, budget)
    mean_bytes = sum(cost[x] for x in picks) / n_layers
    base_name = f"k{base.key_bits}v{base.value_bits}g{base.value_group}"
    name = args.name
    desc = (
        f"SmartMix for SmolLM2-135M (benchmarks/smartmix.py): per-layer mse key / group value bits picked from "
        f"measured per-layer attention-output error"
        f"{' scaled to the measured output KL of each layer' if kl else ''} on "
        f"{args.windows} x {args.window_len} calibration tokens "
        f"(the essays' end), mean {mean_bytes:.1f} B/token/head at D={cost_dim}."
    )
    raw = S.to_config(name, desc, picks, candidates)
    config_from_dict(raw, name=name).check_model(n_layers, head_dim)  # loads back as a valid per-layer config
    (out / f"{name}.yaml").write_text(yaml.safe_dump(raw, sort_keys=False, width=110))
    result = {
        "picks": picks,
        "sensitivity": args.sensitivity,
        "layer_kl_probe": kl,
        "mean_bytes": mean_bytes,
        "budget_mean_bytes": budget / n_layers,
        "cost": cost,
        "proxy_errors": proxy_errors,
        "errors": errors,
        "proxy_error_mix": sum(e[x] for e, x in zip(errors, picks)),
        "proxy_error_uniform": sum(e[base_name] for e in errors) if base_name in errors[0] else None,
        "calibration_tokens": args.windows * args.window_len,
        "wall_s": time.time() - t0,
    }
    (out / "smartmix.json").write_text(json.dumps(result, indent=1))
    print(
        f"picks: {picks}\nmean {mean_bytes:.1f} B/token/head; proxy error mix {result['proxy_error_mix']:.3e} vs "
        f"uniform {result['proxy_error_uniform']}; {time.time() - t0:.0f} s",
        flush=True,
    )
    return result


if __name__ == "__main__":
    main()
