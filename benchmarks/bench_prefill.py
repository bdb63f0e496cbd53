"""Chunked prefill over a compressed history vs SDPA (flash/efficient) over the same history in fp16.

    python benchmarks/bench_prefill.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_bench import prefill_bench, table  # noqa: E402

ISSUE_SHAPES = [(1, 32, 8, 32768, 2048), (1, 28, 4, 32768, 2048)]  # issue 12: chunk 2048 over 32k history


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--format", default=None, help="cache format preset (default: blog_k3v2's layout)")
    ap.add_argument("--issue-shapes", action="store_true", help="chunk 2048 over 32k history, 32/8 and 28/4")
    args = ap.parse_args(argv)
    print(table(prefill_bench(ISSUE_SHAPES if args.issue_shapes else None, fmt=args.format)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
