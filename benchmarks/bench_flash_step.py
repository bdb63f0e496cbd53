"""One layer's prefill of a whole step on the GPU: the flash path per request (before) vs all rows in one call.

    python benchmarks/bench_flash_step.py [--rows 8] [--chunk 8192] [--history 8192] [--heads 28,4] [--reps 10]
        [--profile]

A step of ``--rows`` chunks of ``--chunk`` tokens, each after ``--history`` tokens (a multiple of the ring; the
sequences share one history length so one prefill case serves them, Qwen2.5-7B's heads by default), through:

- ``per-request flash``: ``ops.prefill`` with vLLM's FlashAttention once per request, its plan built in the call
  (what every layer did before);
- ``step flash``: ``ops.prefill_rows`` over all rows with the step's plan built once beforehand (what a layer does
  now) and ``+ plan``: the same with the plan built in the call (what the step's first layer pays);
- ``per-request Triton``: ``ops.prefill`` on the Triton loop (what vLLM runs below the 8k rule,
  ``integrations.vllm.flash.FLASH_MIN_TOKENS``).

Wall time per call (host launches included, as a prefill step sees them: synchronize, ``--reps`` calls,
synchronize), best of 3, beside ``stock FA3``: stock vLLM's FlashAttention over the same tokens in fp16 pages (what a
stock engine's layer runs). ``--profile``: each CUDA kernel of one ``step flash`` call (``torch.profiler``, mean of 3
calls), to see the passes around FlashAttention. Needs a CUDA GPU with vLLM's FlashAttention (the bundle).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def wall_us(fn, reps: int) -> float:
    """Best of three: µs per call of ``reps`` calls between two synchronizations."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    best = float("inf")
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def step_variants(q, k, v, kv, history: list[int], varlen) -> dict:
    """The variants (name -> call) for a step of sequences ``kv`` holds: q [B, Hq, T, D], k, v [B, Hkv, T, D]."""

    from jetson_tq import ops

    b, hq, t, d = q.shape
    rows = [x.transpose(1, 2).reshape(b * t, -1, d).contiguous() for x in (q, k, v)]
    qsl = np.arange(b + 1) * t
    one = [kv.sequence(i) for i in range(b)]
    plan = ops.plan_prefill_rows(kv, history, qsl)

    def per_request(flash):
        for i in range(b):
            ops.prefill(
                q[i : i + 1],
                k[i : i + 1],
                v[i : i + 1],
                one[i],
                max_tokens=history[i] + t,
                varlen=varlen if flash else None,
                history=[history[i]],
            )

    return {
        "per-request flash": lambda: per_request(True),
        "step flash": lambda: ops.prefill_rows(*rows, kv, qsl, history, varlen=varlen, plan=plan),
        "step flash + plan": lambda: ops.prefill_rows(*rows, kv, qsl, history, varlen=varlen),
        "per-request Triton": lambda: per_request(False),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--history", type=int, default=8192, help="tokens before each chunk (a multiple of the ring)")
    ap.add_argument("--heads", default="28,4", help="query heads, KV heads (default 28,4)")
    ap.add_argument("--format", default="mse_k4v3")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="also the CUDA kernels of one whole-step call")
    args = ap.parse_args(argv)
    from kernel_bench import make_prefill_case, resolve_format, stock_fa_us

    from jetson_tq.integrations.vllm.flash import vllm_varlen

    varlen = vllm_varlen()
    if varlen is None:
        print("bench_flash_step: needs vLLM's FlashAttention on a CUDA GPU (the vLLM bundle)", file=sys.stderr)
        return 2
    hq, hkv = (int(x) for x in args.heads.split(","))
    case, k, v = make_prefill_case(args.rows, hq, hkv, args.history, args.chunk, fmt=resolve_format(args.format))
    q = torch.randn(args.rows, hq, args.chunk, k.shape[-1], device=k.device, dtype=torch.float16)
    history = [args.history] * args.rows
    print(f"{args.rows} rows x {args.chunk} tokens after {args.history}, heads {hq}/{hkv}, {args.format}")
    variants = step_variants(q, k, v, case.kv, history, varlen)
    for name, fn in variants.items():
        print(f"{name:<20} {wall_us(fn, args.reps) / 1e3:9.3f} ms per layer", flush=True)
    print(f"{'stock FA3':<20} {stock_fa_us(q, case.k16, case.v16) / 1e3:9.3f} ms per layer (device time)", flush=True)
    if args.profile:
        print_kernels(variants["step flash"])
    return 0


def print_kernels(fn, calls: int = 3) -> None:
    """Each CUDA kernel ``fn`` launches, µs per call (mean of ``calls``), longest first, and their sum."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.count // calls, e.device_time_total / calls) for e in prof.key_averages()]
    rows = sorted([r for r in rows if r[2] > 0], key=lambda r: -r[2])
    for key, n, us in rows:
        print(f"  {key[:72]:<72} x{n:<3} {us:9.1f} us", flush=True)
    print(f"  {'all kernels':<72}      {sum(r[2] for r in rows):9.1f} us", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
