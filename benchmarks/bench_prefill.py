r"""Chunked prefill over a compressed history vs SDPA (flash/efficient) over the same history in fp16.

    python benchmarks/bench_prefill.py --format mse_k4v3 --issue-shapes \
        [--variants '[{}, {"num_stages": 2}]'] [--json F]

A variant is a dict of ``chunked_prefill`` knobs (run 8 also timed the run-7 kernel, in-loop dequantization,
through ``{"impl": "run7"}``: ``benchmarks/prefill_run7.py`` at commit 85808f9, deleted after it lost).
``--profile`` prints each CUDA kernel's time in one call of every variant (query transform, dequantization, flash).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_bench import prefill_bench, table

ISSUE_SHAPES = [(1, 32, 8, 32768, 2048), (1, 28, 4, 32768, 2048)]  # issue 12: chunk 2048 over 32k history


def _cases(shapes, fmt):
    import torch
    from kernel_bench import make_prefill_case, resolve_format

    for b, hq, hkv, hist, t in shapes:
        case, k, v = make_prefill_case(b, hq, hkv, hist, t, fmt=resolve_format(fmt))
        q = torch.randn(b, hq, t, k.shape[-1], device=k.device, dtype=torch.float16)
        yield (b, hq, hkv, hist, t), case, q, k, v


def compile_variants(shapes, fmt, variants) -> None:
    """Each variant once per shape (kernels compile; the timed run then loads them from Triton's cache)."""
    import torch

    from jetson_tq.kernels.prefill_plan import PrefillTuning, chunked_prefill

    for _, case, q, k, v in _cases(shapes, fmt):
        for var in variants:
            chunked_prefill(q, k, v, case.kv, tuning=PrefillTuning(**var))
        torch.cuda.synchronize()


def profile_variants(shapes, fmt, variants) -> None:
    """CUDA time of every kernel in one call of each variant (after a warm call), from torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from jetson_tq.kernels.prefill_plan import PrefillTuning, chunked_prefill

    for shape, case, q, k, v in _cases(shapes, fmt):
        for var in variants:
            chunked_prefill(q, k, v, case.kv, tuning=PrefillTuning(**var))
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                chunked_prefill(q, k, v, case.kv, tuning=PrefillTuning(**var))
                torch.cuda.synchronize()
            for ev in prof.key_averages():
                us = getattr(ev, "device_time_total", None)
                us = getattr(ev, "cuda_time_total", 0) if us is None else us
                if us > 0:
                    print(
                        f"profile {list(shape)} {var} {ev.key[:40]:40s} n={ev.count} {us / max(ev.count, 1):9.1f} us",
                        flush=True,
                    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default=None, help="cache format preset (default: blog_k3v2's layout)")
    ap.add_argument("--issue-shapes", action="store_true", help="chunk 2048 over 32k history, 32/8 and 28/4")
    ap.add_argument("--shapes", default=None, help="JSON list of [B, Hq, Hkv, history, chunk]")
    ap.add_argument("--variants", default="[{}]", help="JSON list of knob dicts (see above)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument(
        "--flash",
        action="store_true",
        help="also the vLLM path (vLLM's FlashAttention over the dequantized history) and stock vLLM's kernel",
    )
    ap.add_argument(
        "--compile-only",
        action="store_true",
        help="run each variant once per shape, no timing (fills Triton's disk cache; run several at once)",
    )
    ap.add_argument("--profile", action="store_true", help="per-kernel CUDA times of one call per variant, no timing")
    args = ap.parse_args(argv)
    shapes = ISSUE_SHAPES if args.issue_shapes else None
    if args.shapes:
        shapes = [tuple(s) for s in json.loads(args.shapes)]
    variants = json.loads(args.variants)
    if args.compile_only:
        compile_variants(shapes, args.format, variants)
        return 0
    if args.profile:
        profile_variants(shapes, args.format, variants)
        return 0
    rows = prefill_bench(shapes, fmt=args.format, variants=variants, flash=args.flash)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
