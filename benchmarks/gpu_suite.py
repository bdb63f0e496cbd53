"""Everything the GPU run needs, in one call: environment, GPU tests at real sizes, and every benchmark table.

    python benchmarks/gpu_suite.py --out DIR [--stages env,decode,sweep,compress,scores,prefill,tests] [--budget S]

Each stage writes its results under DIR as soon as it ends (so a run cut short keeps what it
finished) and the suite skips stages that would start after ``--budget`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAGES = ["env", "diag", "decode", "tests", "compress", "scores", "prefill", "sweep"]
# decode variants tried by the diagnostics, in order of preference for the benchmark table
DIAG_VARIANTS = [{}, {"fold_values": False}, {"fast_keys": False}]
TEST_FILES = [
    "tests/kernels/test_kernels_decode.py",
    "tests/kernels/test_kernels_prefill.py",
    "tests/kernels/test_kernels_compress.py",
    "tests/kernels/test_kernels_scores.py",
    "tests/ops/test_ops.py",
    "tests/kernels/test_kernels_layout.py",
]


def _env(out: Path) -> None:
    import torch
    import triton

    lines = [
        f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"torch {torch.__version__}, triton {triton.__version__}",
        f"gpu: {torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).multi_processor_count} SMs)",
    ]
    try:
        lines.append(
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw", "--format=csv"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
        )
    except Exception as e:
        lines.append(f"nvidia-smi: {e}")
    from kernel_bench import copy_bandwidth

    lines.append(f"copy bandwidth: {copy_bandwidth():.0f} GB/s (read + write, 2 GiB)")
    (out / "env.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--budget", type=float, default=540.0, help="seconds; later stages are skipped")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    import kernel_bench as bench

    results, md = {}, []
    bw = None
    for stage in args.stages.split(","):
        left = args.budget - (time.time() - t0)
        if left < 20:
            print(f"== {stage}: skipped ({left:.0f} s of budget left)", flush=True)
            continue
        print(f"== {stage} (t={time.time() - t0:.0f}s)", flush=True)
        try:
            if stage == "env":
                _env(args.out)
            elif stage == "diag":
                rows = bench.decode_diagnostics([(8, 32, 8, 65536), (1, 32, 8, 131072)], DIAG_VARIANTS)
                rows += bench.decode_diagnostics([(8, 32, 8, 65536)], [{}], q_scale=3.0)
                ok = [
                    v
                    for v in DIAG_VARIANTS
                    if all(
                        max(r["err_run1"], r["err_run2"]) <= 2e-3
                        for r in rows
                        if r["variant"] == (",".join(f"{a}={b}" for a, b in v.items()) or "default")
                        and r["q_scale"] == 1.0
                    )
                ]
                chosen = next((v for v in ok if "num_splits" not in v), {})
                results["decode_variant"] = chosen
                results["diag"] = rows
                text = f"### diag (decode; chosen for the table: {chosen or 'default'})\n\n{bench.table(rows)}\n"
                md.append(text)
                print(text, flush=True)
                continue
            elif stage == "tests":
                log = args.out / "tests.log"
                files = os.environ.get("JETSON_TQ_GPU_TESTS", ",".join(TEST_FILES)).split(",")
                cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
                with open(log, "w") as f:
                    try:
                        rc = subprocess.run(
                            cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=max(left - 10, 30)
                        ).returncode
                    except subprocess.TimeoutExpired:
                        rc = "timeout (budget): see tests.log for the tests that finished"
                print(log.read_text()[-3000:], flush=True)
                results["tests_rc"] = rc
            else:
                bw = bw or bench.copy_bandwidth()
                if stage == "decode":
                    from bench_decode import FULL, RAGGED

                    rows = bench.decode_vs_sdpa(FULL, ragged=RAGGED, copy_gbps=bw, **results.get("decode_variant", {}))
                elif stage == "sweep":
                    from bench_decode import SWEEP

                    rows = []
                    for var in SWEEP:
                        if args.budget - (time.time() - t0) < 30:
                            break
                        for r in bench.decode_vs_sdpa(
                            [(8, 32, 8, 65536), (1, 32, 8, 131072)], graphs=False, copy_gbps=bw, **var
                        ):
                            rows.append({"variant": ",".join(f"{k}={v}" for k, v in var.items()), **r})
                elif stage == "compress":
                    from bench_compress import VARIANTS

                    rows = bench.compress_bench(variants=VARIANTS, copy_gbps=bw) + bench.append_bench()
                elif stage == "scores":
                    rows = bench.scores_bench(copy_gbps=bw)
                elif stage == "prefill":
                    rows = bench.prefill_bench(copy_gbps=bw)
                results[stage] = rows
                text = f"### {stage} (copy bandwidth {bw:.0f} GB/s)\n\n{bench.table(rows)}\n"
                md.append(text)
                print(text, flush=True)
        except Exception:
            err = traceback.format_exc()
            results[f"{stage}_error"] = err
            print(err, flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        (args.out / "tables.md").write_text("\n".join(md))
    print(f"== done in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
