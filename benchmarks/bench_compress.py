"""Compress-on-write: new tokens x 8 KV heads (D=128, default preset unless --format) per launch, next to a
device copy of the same bytes timed in the same run (% of copy bandwidth); then ``CompressedKVCache.append`` with
and without validation next to ``ops.write`` of the same tokens (issue 23: append with validation <= 1.5x ops.write).

    python benchmarks/bench_compress.py [--format mse_k4v3] [--tokens 16384,2048] [--slots random,blocks]
        [--variants JSON] [--no-reference] [--append-shape 8,8,16384] [--no-append] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_bench import append_bench, compress_bench, copy_bandwidth, table

VARIANTS = [{}, {"block_t": 64, "num_warps": 4}]

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default=None, help="cache format preset (default: the default preset, mse_k4v3)")
    ap.add_argument("--variants", type=json.loads, help="a JSON list of WriteTuning field dicts")
    ap.add_argument("--tokens", default="16384", help="comma-separated tokens per launch")
    ap.add_argument("--slots", default="random", help="comma-separated slot patterns: random, blocks")
    ap.add_argument("--no-reference", action="store_true", help="skip the PyTorch reference rows")
    ap.add_argument("--append-shape", default="8,8,16384", help="B,Hkv,T of the append-vs-write rows")
    ap.add_argument("--no-append", action="store_true", help="skip the append-vs-write rows")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth (2 GiB device copy, read + write): {bw:.0f} GB/s", flush=True)
    rows = []
    for n in (int(x) for x in args.tokens.split(",")):
        for pattern in args.slots.split(","):
            part = compress_bench(
                tokens=n,
                variants=args.variants or VARIANTS,
                copy_gbps=bw,
                fmt=args.format,
                slots=pattern,
                reference=not args.no_reference,
            )
            print(table(part), flush=True)
            rows += part
    if not args.no_append:
        b, h, t = (int(x) for x in args.append_shape.split(","))
        part = append_bench(batch=b, hkv=h, tokens=t, fmt=args.format)
        print(table(part), flush=True)
        rows += part
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_gbps": bw, "rows": rows}, indent=1))
