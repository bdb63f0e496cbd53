"""One shape of the fused hybrid decode, launched a few times, for a profiler (Nsight Compute) to read.

    ncu --clock-control none -k regex:_hybrid_decode_kernel --launch-skip 2 -c 1 \
        --section SchedulerStats --section WarpStateStats --section Occupancy \
        python benchmarks/profile_decode.py --format blog_k3v2 --batch 8 --ctx 65536
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from kernel_bench import make_decode_case, resolve_format

from jetson_tq.kernels.hybrid_decode_plan import DecodeTuning, hybrid_decode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="blog_k3v2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=65536)
    ap.add_argument("--waves", type=float, default=None)
    ap.add_argument("--launches", type=int, default=4)
    args = ap.parse_args(argv)
    case = make_decode_case(args.batch, 32, 8, [args.ctx] * args.batch, fmt=resolve_format(args.format))
    tuning = DecodeTuning(waves=args.waves)
    for _ in range(args.launches):
        hybrid_decode(case.q, case.kv, tuning=tuning)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
