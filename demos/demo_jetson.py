"""jetson-tq demo: what TurboQuant guarantees, whether our kernels agree, and how much more context fits here.

Run it with ``./run_jetson.sh demo`` (sets up .venv on first use) or ``python -m jetson_tq demo``.
Sections, each ending in one verdict line (PASS / FAIL / SKIPPED / MEASURED):
 1. platform           what this machine is and its memory budget
 2. Theorem 1          TurboQuant_mse distortion vs the paper and its bounds (8192 unit vectors, D=128)
 3. Theorem 2          TurboQuant_prod inner products: bias, mean |error|, relative error
 4. Theorem 3          lower bound <= measured <= upper bound
 5. kernel agreement   Triton decode vs the PyTorch reference (Triton interpreter on CPU)
 6. decode benchmark   Triton decode vs torch SDPA on fp16 K/V (GPU only)
 7. capacity           tokens that fit, fp16 vs TurboQuant, formula checked against a real cache
Plots and summary.json go to the output folder (default out/demo/). Exit code 1 if any verdict is FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from jetson_tq.config import DEFAULT_PRESET

#: the checkout: run as a script (python demos/demo_jetson.py), the lab beside the package imports from here
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: The reference Jetson write-up's fp16 figure for Qwen2.5-7B on a 128 GB Thor (16 GB weights): ~0.9 M tokens.
WRITEUP_FP16_TOKENS = 0.9e6
WRITEUP_MULTIPLIER = 4.4


class Demo:
    """Prints sections with a heading, a progress bar on long steps, and one verdict line each."""

    def __init__(self, out: Path) -> None:
        self.out, self.verdicts, self.results = out, [], {}
        self.tty = sys.stderr.isatty()

    def heading(self, n: int, title: str) -> None:
        print(f"\n== {n}. {title} " + "=" * max(3, 70 - len(title)), flush=True)

    def verdict(self, key: str, status: str, text: str) -> None:
        self.verdicts.append({"section": key, "status": status, "text": text})
        print(f"verdict: {status}: {text}", flush=True)

    def progress(self, done: int, total: int, label: str) -> None:
        bar = "#" * round(20 * done / total) + "-" * (20 - round(20 * done / total))
        end = "\r" if self.tty and done < total else "\n"
        print(f"  [{bar}] {done}/{total} {label}", end=end, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- sections
def section_platform(demo: Demo) -> dict:
    from jetson_tq.cli.platform_cmd import format_platform, platform_report

    rep = platform_report()
    print(format_platform(rep))
    p = rep["platform"]
    demo.results["platform"] = rep
    # Probe notes (a slow nvidia-smi, no torch CUDA) are information, not failures: the probe never raises.
    demo.verdict(
        "platform",
        "PASS",
        f"probed {p['kind']} ({p['arch']}), budget from {rep['memory']['source']}"
        + (f"; {len(p['errors'])} probe note(s)" if p["errors"] else ""),
    )
    return rep


def section_theorem1(demo: Demo) -> list[dict]:
    from lab.reports.theorems import theorem1_mse

    rows = []
    for i, b in enumerate((1, 2, 3, 4)):
        rows += theorem1_mse(dim=128, n=8192, bits=(b,))
        demo.progress(i + 1, 4, f"b={b}")
    print(f"{'b':>2} {'measured':>9} {'codebook':>9} {'paper':>7} {'vs paper':>9} {'lower':>7} {'upper':>7}")
    for r in rows:
        print(
            f"{r['bits']:>2} {r['measured']:>9.4f} {r['codebook_expected']:>9.4f} {r['paper']:>7.4f} "
            f"{100 * r['rel_to_paper']:>+8.1f}% {r['lower_bound']:>7.4f} {r['upper_bound']:>7.4f}"
        )
    bad = [
        r["bits"]
        for r in rows
        if not (
            abs(r["measured"] / r["codebook_expected"] - 1) < 0.03
            and abs(r["rel_to_paper"]) < 0.05
            and r["lower_bound"] <= r["measured"] <= r["upper_bound"]
        )
    ]
    demo.results["theorem1"] = rows
    demo.verdict(
        "theorem1",
        "FAIL" if bad else "PASS",
        f"bits {bad} off"
        if bad
        else "all b within 3 % of the exact Lloyd-Max distortion, within 5 % of the paper, inside the bounds",
    )
    return rows


def section_theorem2(demo: Demo) -> list[dict]:
    from lab.reports.theorems import theorem2_inner_product

    rows = []
    for i, b in enumerate((1, 2, 3, 4)):
        rows += theorem2_inner_product(dim=128, bits=(b,))
        demo.progress(i + 1, 4, f"b={b}")
    print(
        f"{'b':>2} {'bias':>9} {'z':>6} {'mean|err|':>10} {'rel err':>8} {'d*D_prod':>9} {'predicted':>9} {'paper':>7}"
    )
    for r in rows:
        print(
            f"{r['bits']:>2} {r['bias']:>+9.5f} {r['bias_z']:>+6.2f} {r['mean_abs_error']:>10.4f} "
            f"{r['relative_error']:>8.3f} {r['distortion_times_d']:>9.4f} {r['predicted_times_d']:>9.4f} "
            f"{r['paper_times_d']:>7.3f}"
        )
    print("  (rel err = mean |error| / mean |<y,x>|; predicted d*D_prod = pi/2 * D_mse(b-1) of the exact codebook)")
    bad = [
        r["bits"]
        for r in rows
        if abs(r["bias_z"]) >= 4 or abs(r["distortion_times_d"] / r["predicted_times_d"] - 1) >= 0.05
    ]
    demo.results["theorem2"] = rows
    demo.verdict(
        "theorem2",
        "FAIL" if bad else "PASS",
        f"bits {bad} biased or off"
        if bad
        else "unbiased (|z| < 4 for every b) and distortion within 5 % of pi/2 * D_mse(b-1)",
    )
    return rows


def section_theorem3(demo: Demo, mse_rows: list[dict], prod_rows: list[dict]) -> None:
    from lab.reports.theorems import theorem3_bounds

    rows = theorem3_bounds(mse_rows, prod_rows)
    for r in rows:
        print(
            f"{r['quantizer']:<11} b={r['bits']}  {r['lower']:.4f} <= {r['measured']:.4f} <= {r['upper']:.4f}  "
            f"{'ok' if r['ok'] else 'VIOLATED'}"
        )
    demo.results["theorem3"] = rows
    bad = [f"{r['quantizer']} b={r['bits']}" for r in rows if not r["ok"]]
    demo.verdict("theorem3", "FAIL" if bad else "PASS", f"violated: {bad}" if bad else f"all {len(rows)} bounds hold")


def section_kernels(demo: Demo, cuda: bool, dispatch_module: str) -> object:
    from lab.reports import kernel_check as kc

    dispatch = kc.load_dispatch(dispatch_module)
    if dispatch is None:
        demo.verdict("kernels", "SKIPPED", f"kernels not in this build ({dispatch_module} missing)")
        return None
    if cuda:
        res = kc.agreement(dispatch, kc.GPU_SHAPE, "cuda")
        where = "CUDA"
    else:
        print(
            "  CPU: running the Triton kernel in the Triton interpreter (TRITON_INTERPRET=1, child process), "
            f"tiny shape {kc.CPU_SHAPE}"
        )
        t0 = time.time()
        res = kc.agreement_cpu_interpreted(dispatch_module)
        where = f"Triton interpreter, {time.time() - t0:.1f} s"
    demo.results["kernels"] = res
    if "max_abs" not in res:
        demo.verdict("kernels", "FAIL", f"kernel run failed: {res.get('error')}")
        return dispatch
    print(
        f"  max |diff| {res['max_abs']:.2e}, mean |diff| {res['mean_abs']:.2e} (|ref| max {res['ref_max_abs']:.2f};"
        f" tolerance {res['tol_max_abs']:.0e} / {res['tol_mean_abs']:.0e})"
    )
    demo.verdict(
        "kernels",
        "PASS" if res["ok"] else "FAIL",
        f"Triton decode vs reference on {where}: max {res['max_abs']:.2e}, mean {res['mean_abs']:.2e}",
    )
    return dispatch


def section_benchmark(demo: Demo, cuda: bool, dispatch) -> None:
    if not cuda:
        demo.verdict(
            "benchmark",
            "SKIPPED",
            "no CUDA GPU: Triton on the CPU interpreter and SDPA on CPU cores say "
            "nothing about decode speed on a Jetson/GPU",
        )
        return
    if dispatch is None:
        demo.verdict("benchmark", "SKIPPED", "kernels not in this build (jetson_tq.api missing)")
        return
    from lab.reports.kernel_check import decode_benchmark

    rows = decode_benchmark(dispatch, progress=demo.progress)
    for r in rows:
        print(
            f"  B={r['batch']} {r['q_heads']}/{r['kv_heads']} D={r['head_dim']} ctx {r['context']:>6}: triton "
            f"{r['triton_us']:8.1f} us  sdpa({r['sdpa_backend']}) {r['sdpa_us']:8.1f} us  "
            f"x{r['speedup_vs_sdpa']:.2f}  (max |diff| vs reference {r['max_abs_vs_reference']:.1e})"
        )
    demo.results["benchmark"] = rows
    wrong = [r["context"] for r in rows if r["max_abs_vs_reference"] > 1e-2]
    if wrong:
        demo.verdict("benchmark", "FAIL", f"kernel output off the reference at ctx {wrong}")
        return
    best = max(rows, key=lambda r: r["context"])
    demo.verdict(
        "benchmark",
        "MEASURED",
        f"on {best['gpu']}: x{best['speedup_vs_sdpa']:.2f} vs SDPA at ctx "
        f"{best['context']} (demo micro-benchmark; benchmarks/ has the method)",
    )


def section_capacity(demo: Demo, args, platform_rep: dict, cuda: bool) -> None:
    from jetson_tq.config import load_config, preset_names
    from jetson_tq.format import FP16_FORMAT
    from jetson_tq.models.specs import load_model_spec
    from jetson_tq.reports.capacity import (
        KVBudget,
        bytes_per_token,
        capacity_report,
        format_measurement,
        format_report,
        measure_model,
    )
    from jetson_tq.reports.plots import plot_capacity

    config = load_config(args.config)
    compare = [load_config(n) for n in preset_names() if n != config.name] + [config]
    kind = platform_rep["platform"]["kind"]
    model = load_model_spec(args.model or ("smollm2-135m-instruct" if kind == "cpu" else "qwen2.5-7b-instruct"))
    mem = platform_rep["memory"]
    plots = []
    if mem["available_bytes"]:
        budget = KVBudget(
            mem["available_bytes"], args.utilization, model.weight_bytes, source=f"this {kind}: {mem['source']}"
        )
        rep = capacity_report(model, config, budget, min(32768, model.max_position_embeddings))
        print(format_report(rep))
        demo.results["capacity_here"] = rep
        plots.append(
            plot_capacity(
                model, compare, budget.kv_bytes, demo.out / f"capacity_{model.name}.png", f"{model.name} on this {kind}"
            )
        )
    else:
        print(f"  this machine's memory budget is unknown ({mem['note']}); showing the reference case only")
    # Reference case: Qwen2.5-7B on a 128 GB Thor (the write-up), at the KV budget its fp16 figure implies.
    qwen = load_model_spec("qwen2.5-7b-instruct")
    fp16_bpt = bytes_per_token([FP16_FORMAT] * qwen.num_layers, qwen)
    ref_budget = KVBudget(
        int(WRITEUP_FP16_TOKENS * fp16_bpt) + qwen.weight_bytes,
        1.0,
        qwen.weight_bytes,
        source="the write-up's ~0.9 M fp16 tokens on a 128 GB Thor",
    )
    ref = capacity_report(qwen, config, ref_budget, 32768)
    print(
        f"\n  reference: {qwen.name} on a 128 GB Thor, KV budget {ref_budget.kv_bytes / 1e9:.1f} GB (= 0.9 M fp16 "
        f"tokens x {fp16_bpt:,} B): fp16 {ref['fp16']['pool_tokens'] / 1e6:.2f} M tokens, {config.name} "
        f"{ref['turboquant']['pool_tokens'] / 1e6:.2f} M (x{ref['multiplier_pool']:.2f}; the write-up: "
        f"~x{WRITEUP_MULTIPLIER}; docs/launcher.md explains the difference)"
    )
    demo.results["capacity_reference"] = ref
    plots.append(
        plot_capacity(
            qwen,
            compare,
            ref_budget.kv_bytes,
            demo.out / "capacity_thor_reference.png",
            f"{qwen.name} on a 128 GB Thor (write-up budget)",
        )
    )
    device = "cuda" if cuda else "cpu"
    tokens = args.measure_tokens or (32768 if cuda else 1024)
    meas = measure_model(config, model, tokens, device)
    print(format_measurement(meas))
    demo.results["capacity_measured"] = meas
    demo.results.setdefault("plots", []).extend(str(p) for p in plots)
    demo.verdict(
        "capacity",
        "PASS" if meas["ok"] else "FAIL",
        f"{model.name}/{config.name}: real cache of {meas['tokens']:,} tokens on {device} = formula "
        f"{100 * meas['rel_diff']:+.3f} % (margin 1 %)",
    )


# ---------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    from jetson_tq.arg_types import fraction, positive_int

    p = argparse.ArgumentParser(prog="demo_jetson.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/demo", help="folder for plots and summary.json (default out/demo)")
    p.add_argument(
        "--model",
        help="model for the capacity section (default: smollm2-135m-instruct on CPU, "
        "qwen2.5-7b-instruct on Jetson/GPU)",
    )
    p.add_argument("--config", default=DEFAULT_PRESET, help=f"TurboQuant preset or YAML (default {DEFAULT_PRESET})")
    p.add_argument("--utilization", type=fraction, default=0.85, help="fraction of the memory budget to use (0.85)")
    p.add_argument(
        "--measure-tokens", type=positive_int, help="tokens in the measured cache (1024 on CPU, 32768 on CUDA)"
    )
    p.add_argument("--dispatch-module", default="jetson_tq.api", help=argparse.SUPPRESS)
    return p


def check_args(args: argparse.Namespace) -> None:
    """Fail on a bad --config, --model or --out before the first section runs (exit 2 through the CLI)."""
    from jetson_tq.config import load_config
    from jetson_tq.errors import ConfigError
    from jetson_tq.models.specs import load_model_spec

    load_config(args.config)
    if args.model:
        load_model_spec(args.model)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(f"--out: expected a folder, got the file {args.out!r}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        # The demo's CPU tensors are small: extra threads only add synchronisation, which on a busy
        # 2-core machine cost 4x (42 s vs 10 s for the whole demo). OMP_NUM_THREADS overrides this.
        torch.set_num_threads(1)

    from lab.reports.plots import plot_theorem1, plot_theorem2

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    demo, t0 = Demo(out), time.time()
    cuda = torch.cuda.is_available()
    print(
        f"jetson-tq demo (torch {torch.__version__}, {'CUDA ' + torch.cuda.get_device_name(0) if cuda else 'CPU'})"
        f" -> {out}/"
    )
    demo.heading(1, "Platform")
    platform_rep = section_platform(demo)
    demo.heading(2, "Theorem 1: TurboQuant_mse distortion (8192 random unit vectors, D=128)")
    mse = section_theorem1(demo)
    demo.heading(3, "Theorem 2: TurboQuant_prod inner products (bias, mean |error|, relative error)")
    prod = section_theorem2(demo)
    demo.heading(4, "Theorem 3: lower <= measured <= upper bounds")
    section_theorem3(demo, mse, prod)
    plots = [plot_theorem1(mse, out / "theorem1_mse.png"), plot_theorem2(prod, out / "theorem2_prod.png")]
    demo.results["plots"] = [str(p) for p in plots]
    demo.heading(5, "Kernel vs reference agreement (fused Triton decode)")
    dispatch = section_kernels(demo, cuda, args.dispatch_module)
    demo.heading(6, "Decode micro-benchmark vs torch SDPA")
    section_benchmark(demo, cuda, dispatch)
    demo.heading(7, "Capacity: tokens that fit, fp16 vs TurboQuant")
    section_capacity(demo, args, platform_rep, cuda)
    summary = {"verdicts": demo.verdicts, "results": demo.results, "seconds": time.time() - t0}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"\n== Summary ({time.time() - t0:.1f} s) " + "=" * 50)
    for v in demo.verdicts:
        print(f"  {v['status']:<8} {v['section']}")
    print(f"  plots: {', '.join(demo.results['plots'])}\n  summary: {out / 'summary.json'}")
    return 1 if any(v["status"] == "FAIL" for v in demo.verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
