"""Prefill cases that failed on the H200 in run 1 (D=50/100/256), per block size and pipelining depth.

Runs in its own process (an illegal address poisons the CUDA context): python benchmarks/diag_prefill.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from kernel_cases import build_paged_kv, fmt_for, rel_err  # noqa: E402
from jetson_tq.attention.reference import paged_attention_prefill  # noqa: E402
from jetson_tq.kernels.prefill import chunked_prefill  # noqa: E402

CASES = [("blog_k3v2", 128, 4, [32768], [128], 64), ("blog_k3v2", 128, 4, [3000, 77, 0], [128, 0, 5], 300),
         ("blog_k3v2", 50, 4, [300], [5], 40), ("blog_k3v2", 256, 2, [800], [9], 33),
         ("blog_k3v2", 100, 4, [0, 400], [0, 2], 70)]
# run 2 measured: block_m=64 (wgmma) + num_stages=1 -> illegal address with the run-6 kernel (spilling, 4 warps)
VARIANTS = [dict(), dict(num_stages=2)]


def main() -> int:
    only = sys.argv[1] if len(sys.argv) > 1 else None
    for name, d, g, comp, rec, t in CASES:
        gen = torch.Generator().manual_seed(1234)
        kv = build_paged_kv(fmt_for(name, d), 2, d, comp, rec, torch.float16, gen)
        b = len(comp)
        q = (torch.randn(b, 2 * g, t, d, generator=gen) * 3).half().cuda()
        k = (torch.randn(b, 2, t, d, generator=gen) * 2).half().cuda()
        v = torch.randn(b, 2, t, d, generator=gen).half().cuda()
        ref = paged_attention_prefill(q, k, v, kv)
        for var in VARIANTS:
            tag = ",".join(f"{a}={b_}" for a, b_ in var.items())
            if only and only != tag:
                continue
            try:
                out = chunked_prefill(q, k, v, kv, **var)
                torch.cuda.synchronize()
                print(f"D={d} T={t} {tag}: rel err {rel_err(out, ref):.2e}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"D={d} T={t} {tag}: ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
                return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
