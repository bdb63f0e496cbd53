"""Where the host time of one eager ``jetson_tq.attention_decode`` call goes (cProfile over many calls, CUDA).

    python benchmarks/profile_api.py [--ctx 1024] [--calls 2000]

Also times the pieces directly: the plan lookup, one fast launch, ``torch.empty`` of the output, and one
decode-step ``cache.append``; and lists the CUDA kernels of one DynamicCache-style SDPA decode step of a
transformers Llama layer for comparison (``--hf``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_api import wall_us

import jetson_tq as jt
from jetson_tq.config import DEFAULT_PRESET, load_config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--format", default=DEFAULT_PRESET)
    args = ap.parse_args(argv)
    fmt = load_config(args.format).default
    cache = jt.CompressedKVCache(fmt, 8, 128, 1, device="cuda", dtype=torch.float16, initial_capacity=args.ctx + 256)
    k = torch.randn(1, 8, args.ctx, 128, device="cuda", dtype=torch.float16)
    cache.append(k, k)
    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.float16)
    view = cache.paged()
    from jetson_tq import ops
    from jetson_tq.kernels.hybrid_decode_plan import hybrid_decode

    k1 = k[:, :, :1].contiguous()
    pieces = {
        "jt.attention_decode(q, cache)": lambda: jt.attention_decode(q, cache),
        "ops.decode(q, view)": lambda: ops.decode(q, view),
        "hybrid_decode(q, view)": lambda: hybrid_decode(q, view),
        "torch.empty(q.shape)": lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device),
        "cache.append(1 token)": lambda: cache.append(k1, k1),
    }
    cache.reserve(args.ctx + 256 + 12 * args.calls)
    for name, fn in pieces.items():
        print(f"{name:32s} {wall_us(fn, args.calls):8.1f} us/call", flush=True)
    for name in ("jt.attention_decode(q, cache)", "cache.append(1 token)"):
        prof = cProfile.Profile()
        fn = pieces[name]
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
        print(f"---- cProfile of {args.calls} x {name}\n" + s.getvalue()[-6000:], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
