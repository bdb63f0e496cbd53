"""Host time of the FlashAttention prefill's plan: per layer and request (before) vs once per step with numpy.

    python benchmarks/bench_flash_plan.py [--rows 8] [--chunk 8192] [--max-history 24576] [--ring 128] [--layers 28]

A step of ``--rows`` prefill chunks of ``--chunk`` tokens after histories spread evenly over [0, --max-history]
(Qwen2.5-7B's shape by default: 4 KV heads of width 128, a 128-token ring, 28 layers). "before": what
``flash_prefill`` computed on the host per layer for each request on its own (the block list, both parts' offsets, the
rows of every sub-sequence as Python lists, packed into one tensor), summed over the step's rows; "after": one
``plan_flash_rows`` for the whole step (which every layer reuses), shown as its total and per layer. CPU only: the
host arithmetic and the tensor packing, not the pinned copy (no GPU here) nor any launch.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
import triton

from jetson_tq.kernels.prefill_flash_plan import plan_flash_rows
from jetson_tq.kernels.prefill_plan import DEQUANT_TOKENS, WORKSPACE_BYTES, workspace_segment


def plan_before(hist: int, t_len: int, ring: int, hkv: int, dp: int) -> list[torch.Tensor]:
    """The host part of ``flash_prefill`` for one sequence as it was (per layer, per request)."""
    first, last = hist // ring, (hist + t_len - 1) // ring
    blocks = [
        (j * ring, max(hist, j * ring) - hist, min(hist + t_len, (j + 1) * ring) - hist) for j in range(first, last + 1)
    ]
    top = blocks[-1][0]
    step = ring * DEQUANT_TOKENS // math.gcd(ring, DEQUANT_TOKENS)
    seg = triton.cdiv(workspace_segment(1, hkv, 4 * dp, max(top, 1), step, WORKSPACE_BYTES), step) * step
    cu_q, cu_k = [0], [0]
    for j, (_, r0, r1) in enumerate(blocks):
        cu_q.append(r1)
        cu_k.append(cu_k[-1] + (r1 - r0) + (hist % ring if j == 0 else 0))
    host: list[list[int]] = [cu_q, cu_k]
    for s0 in range(0, top, seg):
        subs = [(0, r0, r1, min(start, s0 + seg) - s0) for start, r0, r1 in blocks if start > s0]
        rows = [r for _, r0, r1, _ in subs for r in range(r0, r1)]
        cu = [0, *np.cumsum([r1 - r0 for _, r0, r1, _ in subs]).tolist()]
        host += [cu, [u for *_, u in subs], [b for b, *_ in subs], rows]
    sizes = [len(x) for x in host]
    pad = [-n % 4 for n in sizes]
    packed = torch.from_numpy(
        np.concatenate([np.pad(np.asarray(x, dtype=np.int32), (0, p)) for x, p in zip(host, pad)])
    )
    return [x[:n] for x, n in zip(packed.split([n + p for n, p in zip(sizes, pad)]), sizes)]


def best_of(fn, repeat: int) -> tuple[float, float]:
    """(fastest, median) of ``repeat`` calls, in seconds."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8, help="prefill rows in the step (default 8)")
    ap.add_argument("--chunk", type=int, default=8192, help="tokens per chunk (default 8192)")
    ap.add_argument("--max-history", type=int, default=24576, help="the last row's history (default 24576)")
    ap.add_argument("--ring", type=int, default=128, help="R: the ring and block (default 128)")
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-width", type=int, default=128, help="DP: workspace row width (default 128)")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    if min(args.rows, args.chunk, args.ring, args.layers, args.repeat) < 1 or args.max_history < 0:
        ap.error("--rows, --chunk, --ring, --layers, --repeat must be >= 1 and --max-history >= 0")
    hist = np.linspace(0, args.max_history, args.rows).astype(np.int64)
    qsl = np.arange(args.rows + 1) * args.chunk
    hkv, dp, ring = args.kv_heads, args.head_width, args.ring
    torch.set_num_threads(1)  # the plan's few tensor ops are device work on a GPU; one thread keeps CPU noise out
    before = best_of(lambda: [plan_before(int(s), args.chunk, ring, hkv, dp) for s in hist], args.repeat)
    cpu = torch.device("cpu")
    after = best_of(lambda: plan_flash_rows(hist, qsl, ring, hkv, dp, cpu), args.repeat)
    print(f"step: {args.rows} rows x {args.chunk} tokens, histories {hist.tolist()}, R={ring}, {args.layers} layers")
    for name, (best, median), per in (("before", before, "layer"), ("after", after, "step")):
        print(f"{name:<7} {best * 1e3:8.3f} ms per {per} (median {median * 1e3:.3f})", end="")
        if per == "layer":
            print(f", every layer: {best * args.layers * 1e3:.1f} ms per step")
        else:
            print(f", once: {best / args.layers * 1e3:.3f} ms per layer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
