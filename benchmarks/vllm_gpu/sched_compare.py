"""tests/test_vllm_scheduling.py's two engines, run with stock vLLM (same model, prompts and schedules; KV budgets
of 64 and 4 stock blocks) and compared the way the test compares ours: per output, the first step where the tokens
differ from the roomy batch, both runs' greedy margins there and the largest log-probability gap before it.

    python3 benchmarks/vllm_gpu/sched_compare.py --out OUT [--ours OURS.json] [--stock OUT/sched_stock.json]
(OURS.json: the test's JETSON_TQ_SCHED_JSON dump, compared the same way; the test's own assertions decide
pass/fail; --stock reuses an earlier stock run)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import test_vllm_scheduling as sched  # noqa: E402
from jetson_tq.integrations.vllm.compare import run_engine_subprocess  # noqa: E402


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
        rows.append({"what": what, "first_difference": n if n < len(x["token_ids"]) else None,
                     "margins_there": [x["margins"][n], y["margins"][n]] if n < len(x["token_ids"]) else None,
                     "max_logprob_gap_before": max([0.0] + [abs(a - b) for a, b in zip(x["logprobs"][:n],
                                                                                          y["logprobs"][:n])])})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ours", type=Path, help="the scheduling test's JSON dump (JETSON_TQ_SCHED_JSON)")
    ap.add_argument("--stock", type=Path, help="an earlier run's sched_stock.json instead of running the engines")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(sched.ENV, VLLM_PLUGINS="")  # stock: no plugin loaded at all
    if args.stock:
        stock = json.loads(args.stock.read_text())
    else:
        with tempfile.TemporaryDirectory() as tmp:
            jobs = sched.scheduling_jobs(sched.make_model(Path(tmp)))
            jobs["roomy"]["kv_bytes"] = 64 * stock_block_bytes()
            jobs["tight"]["kv_bytes"] = 4 * stock_block_bytes()
            stock = {name: run_engine_subprocess(j, None, env, timeout=600) for name, j in jobs.items()}
        (args.out / "sched_stock.json").write_text(json.dumps(stock, indent=1))
    report = {"stock": {"preemptions": stock["tight"]["preemptions"], "rows": comparisons(stock)}}
    if args.ours and args.ours.exists():
        ours = json.loads(args.ours.read_text())
        report["ours"] = {"preemptions": ours["tight"]["preemptions"], "rows": comparisons(ours)}
    (args.out / "sched_compare.json").write_text(json.dumps(report, indent=1))
    for name, r in report.items():
        diffs = [row for row in r["rows"] if row["first_difference"] is not None]
        worst = max(row["max_logprob_gap_before"] for row in r["rows"])
        print(f"{name}: preemptions {r['preemptions']}, {len(diffs)} of {len(r['rows'])} outputs differ, "
              f"largest log-probability gap before a difference {worst:.2e}")
        for row in diffs:
            print(f"  {row['what']}: step {row['first_difference']}, margins {row['margins_there']}")
    sys.stdout.flush()
    os._exit(0)  # engine subprocesses are gone; skip interpreter teardown of vLLM's atexit hooks


if __name__ == "__main__":
    main()
