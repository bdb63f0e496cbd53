"""turboquant_scores at the challenge shape (B=32, S=32768, D=128, C=16): kernel vs reconstruct-then-matmul.

python benchmarks/bench_scores.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_bench import scores_bench, table

if __name__ == "__main__":
    print(table(scores_bench()))
