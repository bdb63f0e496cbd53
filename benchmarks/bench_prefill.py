"""Chunked prefill over a compressed history vs SDPA (flash/efficient) over the same history in fp16.

    python benchmarks/bench_prefill.py --format mse_k4v3 --issue-shapes [--variants '[{}, {"num_stages": 2}]'] [--json F]

A variant is a dict of ``chunked_prefill`` knobs (run 7 also timed the run-6 kernel through ``{"impl": "run6"}``,
``benchmarks/prefill_run6.py`` at commit 98f9fb5; deleted after it lost).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_bench import prefill_bench, table  # noqa: E402

ISSUE_SHAPES = [(1, 32, 8, 32768, 2048), (1, 28, 4, 32768, 2048)]  # issue 12: chunk 2048 over 32k history


def compile_variants(shapes, fmt, variants) -> None:
    """Each variant once per shape (kernels compile; the timed run then loads them from Triton's cache)."""
    import torch

    from jetson_tq.kernels.prefill import chunked_prefill
    from kernel_bench import make_prefill_case, resolve_format

    for b, hq, hkv, hist, t in shapes:
        case, k, v = make_prefill_case(b, hq, hkv, hist, t, fmt=resolve_format(fmt))
        q = torch.randn(b, hq, t, k.shape[-1], device=k.device, dtype=torch.float16)
        for var in variants:
            chunked_prefill(q, k, v, case.kv, **var)
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default=None, help="cache format preset (default: blog_k3v2's layout)")
    ap.add_argument("--issue-shapes", action="store_true", help="chunk 2048 over 32k history, 32/8 and 28/4")
    ap.add_argument("--shapes", default=None, help="JSON list of [B, Hq, Hkv, history, chunk]")
    ap.add_argument("--variants", default="[{}]", help="JSON list of knob dicts (see above)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--compile-only", action="store_true",
                    help="run each variant once per shape, no timing (fills Triton's disk cache; run several at once)")
    args = ap.parse_args(argv)
    shapes = ISSUE_SHAPES if args.issue_shapes else None
    if args.shapes:
        shapes = [tuple(s) for s in json.loads(args.shapes)]
    variants = json.loads(args.variants)
    if args.compile_only:
        compile_variants(shapes, args.format, variants)
        return 0
    rows = prefill_bench(shapes, fmt=args.format, variants=variants)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
