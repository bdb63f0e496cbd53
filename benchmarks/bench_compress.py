"""Compress-on-write: 16k new tokens x 8 KV heads (D=128, blog_k3v2) per launch, vs the copy-bandwidth floor.

    python benchmarks/bench_compress.py [--format mse_k4v3]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jetson_tq.kernels.bench import compress_bench, table  # noqa: E402

VARIANTS = [{}, {"exact_signs": False}, {"block_t": 128, "num_warps": 8},
            {"block_t": 128, "num_warps": 8, "exact_signs": False}, {"block_t": 16, "num_warps": 4}]

if __name__ == "__main__":
    fmt = sys.argv[sys.argv.index("--format") + 1] if "--format" in sys.argv else None
    print(table(compress_bench(variants=VARIANTS if fmt in (None, "blog_k3v2") else [{}], fmt=fmt)))
