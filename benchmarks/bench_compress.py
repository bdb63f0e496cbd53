"""Compress-on-write: 16k new tokens x 8 KV heads (D=128, blog_k3v2) per launch, vs the copy-bandwidth floor.

    python benchmarks/bench_compress.py [--format mse_k4v3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jetson_tq.kernels.bench import compress_bench, table  # noqa: E402

VARIANTS = [{}, {"exact_signs": False}, {"block_t": 128, "num_warps": 8},
            {"block_t": 128, "num_warps": 8, "exact_signs": False}, {"block_t": 16, "num_warps": 4}]

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default=None, help="cache format preset (default: blog_k3v2's layout)")
    fmt = ap.parse_args().format
    print(table(compress_bench(variants=VARIANTS if fmt in (None, "blog_k3v2") else [{}], fmt=fmt)))
