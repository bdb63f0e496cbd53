"""Chunked prefill over a compressed history vs SDPA (flash/efficient) over the same history in fp16.

    python benchmarks/bench_prefill.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jetson_tq.kernels.bench import prefill_bench, table  # noqa: E402

if __name__ == "__main__":
    print(table(prefill_bench()))
