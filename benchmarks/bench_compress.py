"""Compress-on-write: 16k new tokens x 8 KV heads (D=128, blog_k3v2) per launch, vs the copy-bandwidth floor.

    python benchmarks/bench_compress.py [--format mse_k4v3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_bench import compress_bench, table  # noqa: E402

VARIANTS = [{}, {"fast_rotation": False}, {"block_t": 64, "num_warps": 4}, {"block_t": 32, "num_warps": 4},
            {"block_t": 64, "num_warps": 8}]

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default=None, help="cache format preset (default: blog_k3v2's layout)")
    ap.add_argument("--variants", type=json.loads, help="a JSON list of compress_write keyword dicts")
    args = ap.parse_args()
    print(table(compress_bench(variants=args.variants or VARIANTS, fmt=args.format)))
