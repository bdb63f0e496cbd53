"""The public API as a user calls it: ``jetson_tq.attention_decode(q, cache)`` on a ``CompressedKVCache``,
eager and in a CUDA graph, against torch SDPA flash on fp16 K/V of the same shape, in the same process.

    python benchmarks/bench_api.py [--format mse_k4v3] [--quick] [--json out.json]

Per shape: graph replay µs (median of CUDA-event timed replays), eager µs per call (back-to-back calls,
one sync at the end), host µs per call (calls issued while the GPU is held busy, so only the Python and
launch cost is timed), the same for flash, the eager host cost of one decode-step ``cache.append``, and the
peak extra device memory of one long append against the bytes it stores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_bench import timing_transform

import jetson_tq as jt
from jetson_tq.config import DEFAULT_PRESET, load_config

SHAPES = [(1, 32, 8, 1024), (1, 32, 8, 16384), (1, 32, 8, 131072), (8, 32, 8, 16384), (8, 32, 8, 65536)]
QUICK = [(1, 32, 8, 1024), (1, 32, 8, 16384), (8, 32, 8, 65536)]


def _flash(q4, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)


def graph_us(fn, iters: int = 50) -> float:
    """Median µs of one replay of a CUDA graph capturing ``fn`` (after an eager warm-up)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def wall_us(fn, calls: int = 200) -> float:
    """Wall µs per call of ``calls`` back-to-back calls (warmed up; one sync at the end)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def host_us(fn, calls: int = 200) -> float:
    """Host µs per call, the calls issued while the GPU is held busy (enqueueing never waits for the GPU)."""
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU work ahead of the calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def eager_us(fn, calls: int = 200) -> tuple[float, float]:
    """(wall µs per back-to-back call, host µs per call issued while the GPU is busy)."""
    return wall_us(fn, calls), host_us(fn, calls)


def filled_cache(fmt, b: int, hkv: int, ctx: int, d: int = 128):
    kt = timing_transform(fmt, hkv, d)
    cache = jt.CompressedKVCache(
        fmt, hkv, d, b, device="cuda", dtype=torch.float16, initial_capacity=ctx + 64, key_transform=kt
    )
    step = 8192
    for t0 in range(0, ctx, step):
        n = min(step, ctx - t0)
        k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.float16)
        cache.append(k, torch.randn_like(k))
    return cache


def row(fmt, b: int, hq: int, hkv: int, ctx: int, d: int = 128) -> dict:
    cache = filled_cache(fmt, b, hkv, ctx, d)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    ref = jt.attention_decode(q, cache, backend="reference").float()
    out = jt.attention_decode(q, cache).float()
    err = float((out - ref).norm() / ref.norm())
    ours = lambda: jt.attention_decode(q, cache)  # noqa: E731
    flash = lambda: _flash(q.unsqueeze(2), k, v)  # noqa: E731
    g_t, g_f = graph_us(ours), graph_us(flash)
    (e_t, h_t), (e_f, h_f) = eager_us(ours), eager_us(flash)
    k1 = torch.randn(b, hkv, 1, d, device="cuda", dtype=torch.float16)
    cache.reserve(ctx + 300)
    e_app, h_app = eager_us(lambda: cache.append(k1, k1), calls=200)
    return {
        "B": b,
        "Hq": hq,
        "Hkv": hkv,
        "ctx": ctx,
        "rel_err_vs_reference": err,
        "graph_us": g_t,
        "eager_us": e_t,
        "host_us": h_t,
        "eager_minus_graph_us": e_t - g_t,
        "flash_graph_us": g_f,
        "flash_eager_us": e_f,
        "flash_host_us": h_f,
        "speedup_vs_flash_graph": g_f / g_t,
        "speedup_vs_flash_eager": e_f / e_t,
        "append_eager_us": e_app,
        "append_host_us": h_app,
    }


def append_memory(fmt, n: int = 80_000, hkv: int = 1, d: int = 128) -> dict:
    """Peak extra device memory of one append of n tokens (capacity reserved first) vs the bytes it stores."""
    cache = jt.CompressedKVCache(fmt, hkv, d, 1, device="cuda", dtype=torch.float16, initial_capacity=n + 64)
    k = torch.randn(1, hkv, n + 64, d, device="cuda", dtype=torch.float16)
    cache.append(k[:, :, :64], k[:, :, :64])  # warm-up: compile, constants
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    cache.append(k[:, :, 64:], k[:, :, 64:])
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    stored = n * hkv * fmt.bytes_per_token(d)
    return {"tokens": n, "extra_bytes": extra, "stored_bytes": stored, "ratio": extra / stored}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default=DEFAULT_PRESET)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    fmt = load_config(args.format).default
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, format {args.format}", flush=True)
    rows = []
    for shape in QUICK if args.quick else SHAPES:
        r = row(fmt, *shape)
        rows.append(r)
        print(json.dumps(r), flush=True)
    mem = append_memory(fmt)
    print(json.dumps({"append_memory": mem}), flush=True)
    hdr = (
        "B Hq/Hkv ctx | ours graph / eager / host us | flash graph / eager us | x flash (graph, eager) | append host us"
    )
    print(hdr)
    for r in rows:
        print(
            f"{r['B']} {r['Hq']}/{r['Hkv']} {r['ctx']} | {r['graph_us']:.1f} / {r['eager_us']:.1f} / "
            f"{r['host_us']:.1f} | {r['flash_graph_us']:.1f} / {r['flash_eager_us']:.1f} | "
            f"{r['speedup_vs_flash_graph']:.2f} / {r['speedup_vs_flash_eager']:.2f} | {r['append_host_us']:.1f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "append_memory": mem}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
