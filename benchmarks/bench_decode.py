"""Fused hybrid decode vs torch SDPA flash (fp16 KV, enable_gqa) on the H200 shapes of issue 3.

python benchmarks/bench_decode.py                 # the full table (D=128, B 1/8, 32/8 and 28/4, 1k..128k, ragged)
python benchmarks/bench_decode.py --sweep         # kernel variants at the two headline shapes
python benchmarks/bench_decode.py --quick         # three shapes
python benchmarks/bench_decode.py --format mse_k4v3   # another cache format (a configs/ preset)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_bench import copy_bandwidth, decode_vs_sdpa, table

FULL = [
    (b, hq, hkv, ctx) for b in (1, 8) for hq, hkv in ((32, 8), (28, 4)) for ctx in (1024, 4096, 16384, 65536, 131072)
]
QUICK = [(1, 32, 8, 1024), (8, 32, 8, 65536), (1, 32, 8, 131072)]
RAGGED = [131072, 65536, 16384, 4096, 1024, 300, 70000, 9000]
SWEEP = [
    dict(block_n=64, num_warps=4, num_stages=2),
    dict(block_n=64, num_warps=4, num_stages=3),
    dict(block_n=128, num_warps=4, num_stages=2),
    dict(block_n=128, num_warps=8, num_stages=2),
    dict(block_n=32, num_warps=2, num_stages=3),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--format", default=None, help="cache format preset (default: blog_k3v2's layout)")
    ap.add_argument("--shapes", type=json.loads, help="JSON list of [B, Hq, Hkv, ctx] (replaces the table)")
    args = ap.parse_args(argv)
    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw:.0f} GB/s (read + write)", flush=True)
    if args.sweep:
        rows = []
        for var in SWEEP:
            for r in decode_vs_sdpa(
                [(8, 32, 8, 65536), (1, 32, 8, 131072)], graphs=False, copy_gbps=bw, fmt=args.format, **var
            ):
                rows.append({"variant": ",".join(f"{k}={v}" for k, v in var.items()), **r})
                print(table(rows[-1:]), flush=True)
    else:
        shapes = [tuple(x) for x in args.shapes] if args.shapes else QUICK if args.quick else FULL
        rows = decode_vs_sdpa(
            shapes, ragged=None if args.quick or args.shapes else RAGGED, copy_gbps=bw, fmt=args.format
        )
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"copy_gbps": bw, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
