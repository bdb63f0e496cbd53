"""tests/integrations/vllm/test_vllm_scheduling.py's two engines, run with stock vLLM (KV budgets of 64 and 4 stock
blocks) and/or other
jetson-tq presets (same model, prompts and schedules), side by side, and compared the way the test compares the
default preset's: per output, the first step where the tokens differ from the roomy batch, both runs' greedy margins
there and the largest log-probability gap before it.

    python3 benchmarks/vllm_gpu/sched_compare.py --out OUT --configs stock,tests/data/vllm_rawkeys_v8_r16.yaml
    python3 benchmarks/vllm_gpu/sched_compare.py --out OUT --reuse OUT/sched_stock.json OUT/sched_mse_k4v3.json
(--reuse compares earlier dumps only: the test's JETSON_TQ_SCHED_JSON dump named sched_<preset>.json; the test's own
assertions decide pass/fail). The ``fp16`` preset runs every layer on stock attention (it stores keys and values
exactly), so it is stock vLLM; the control on our kernels with almost no quantization is the exact-keys file above.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "integrations" / "vllm")]  # the scheduling test: its engines

import test_vllm_scheduling as sched  # noqa: E402

from lab.vllm_compare import run_engine_subprocess  # noqa: E402


def stock_block_bytes() -> int:
    """Bytes of one stock fp32 KV block of the test's model (K and V, every layer)."""
    return 2 * sched.KV_HEADS * sched.HEAD_DIM * 4 * sched.BLOCK * sched.LAYERS


def comparisons(runs: dict) -> list[dict]:
    """The test's three comparisons, one row per output."""
    roomy, tight = runs["roomy"], runs["tight"]
    ref = roomy["groups"][0]
    pairs = [(f"prompt {i} alone", ref[i], g[0]) for i, g in enumerate(roomy["groups"][1:])]
    pairs += [(f"tight, prompt {i}", x, y) for i, (x, y) in enumerate(zip(ref, tight["groups"][0]))]
    pairs += [(f"prefix cache, prompt {i}", x, y) for i, (x, y) in enumerate(zip(ref[:4], tight["groups"][1]))]
    rows = []
    for what, x, y in pairs:
        n = sched.first_difference(x, y)
        rows.append(
            {
                "what": what,
                "first_difference": n if n < len(x["token_ids"]) else None,
                "margins_there": [x["margins"][n], y["margins"][n]] if n < len(x["token_ids"]) else None,
                "max_logprob_gap_before": max(
                    [0.0] + [abs(a - b) for a, b in zip(x["logprobs"][:n], y["logprobs"][:n])]
                ),
            }
        )
    return rows


def run_config(config: str, model: Path) -> dict:
    """Both engines with ``config``: "stock" (no plugin, 64 and 4 stock fp32 blocks) or a jetson-tq preset."""
    if config == "stock":
        jobs = sched.scheduling_jobs(model)
        jobs["roomy"]["kv_bytes"] = 64 * stock_block_bytes()
        jobs["tight"]["kv_bytes"] = 4 * stock_block_bytes()
        return {
            name: run_engine_subprocess(j, None, dict(sched.ENV, VLLM_PLUGINS=""), timeout=600)
            for name, j in jobs.items()
        }
    return {
        name: run_engine_subprocess(j, config, sched.ENV, timeout=600)
        for name, j in sched.scheduling_jobs(model, config).items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--configs", default="stock", help="comma-separated: stock and/or jetson-tq presets, run side by side"
    )
    ap.add_argument(
        "--reuse",
        nargs="*",
        type=Path,
        default=[],
        help="earlier dumps (sched_<config>.json, or the test's JETSON_TQ_SCHED_JSON) to compare instead",
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {p.stem.removeprefix("sched_"): json.loads(p.read_text()) for p in args.reuse if p.exists()}
    runs = {name: r for name, r in runs.items() if "roomy" in r}  # a glob may also match sched_compare.json
    todo = [c for c in args.configs.split(",") if c and c not in runs] if not args.reuse else []
    if todo:
        with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(len(todo)) as pool:
            model = sched.make_model(Path(tmp))
            for config, result in zip(todo, pool.map(lambda c: run_config(c, model), todo)):
                name = Path(config).stem  # a preset's name, or a YAML file's
                runs[name] = result
                (args.out / f"sched_{name}.json").write_text(json.dumps(result, indent=1))
    report = {name: {"preemptions": r["tight"]["preemptions"], "rows": comparisons(r)} for name, r in runs.items()}
    (args.out / "sched_compare.json").write_text(json.dumps(report, indent=1))
    for name, r in report.items():
        diffs = [row for row in r["rows"] if row["first_difference"] is not None]
        worst = max(row["max_logprob_gap_before"] for row in r["rows"])
        print(
            f"{name}: preemptions {r['preemptions']}, {len(diffs)} of {len(r['rows'])} outputs differ, "
            f"largest log-probability gap before a difference {worst:.2e}"
        )
        for row in diffs:
            print(f"  {row['what']}: step {row['first_difference']}, margins {row['margins_there']}")
    sys.stdout.flush()
    os._exit(0)  # engine subprocesses are gone; skip interpreter teardown of vLLM's atexit hooks


if __name__ == "__main__":
    main()
