"""Issue 23's table in one run on any CUDA GPU: every row through the public API beside SDPA flash, with its target.

    python -m benchmarks targets [--format mse_k4v3] [--quick] [--json out.json]

Rows (default preset, D=128, fp16, same process, same tokens):
- decode, ``jt.attention_decode(q, cache)`` in a CUDA graph vs SDPA flash (graph): 8/64k, 1/128k, 8/16k, 1/1k
  (heads 32/8), and one decode step (append 1 token + attention, one graph) at 8/64k;
- append, ``cache.append`` with validation on (device-side checks) vs ``ops.write`` of the same tokens (device µs,
  ``kernel_bench.append_bench``: B=8, 8 KV heads, 16k tokens per sequence);
- prefill, ``jt.attention_prefill(q, k, v, cache)`` (its own compress-on-write and commit included, eager, one sync
  per call) vs SDPA flash with a lower-right causal mask over fp16 history + chunk: 2048-token chunk after 4k, 16k,
  32k and 128k of history (32/8).
Each row says its target and met / missed. ~2-3 minutes on an H200 (``--quick``: fewer rows).
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

import kernel_bench
from bench_api import _flash, filled_cache, graph_us
from kernel_bench import _bench, append_bench, table

import jetson_tq as jt
from jetson_tq.config import DEFAULT_PRESET, load_config

# (B, Hq, Hkv, context, target speed-up over flash or None)
DECODE = [(8, 32, 8, 65536, 3.0), (1, 32, 8, 131072, 2.5), (8, 32, 8, 16384, None), (1, 32, 8, 1024, 1.0)]
PREFILL = [(1, 32, 8, h, 2048) for h in (4096, 16384, 32768, 131072)]  # target: ours <= 1.0x SDPA's time
APPEND_TARGET = 1.5  # append (validate=True) <= 1.5x ops.write, device time
QUICK_DECODE, QUICK_PREFILL = DECODE[:2] + DECODE[3:], PREFILL[1:2]


def _verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("met" if ok else "missed")


def decode_rows(fmt, shapes, step: bool = True) -> list[dict]:
    """Graph µs of the public decode call and of flash on the same shape (plus one decode step at the first shape)."""
    rows = []
    for i, shape in enumerate(shapes):
        rows += _decode_shape(fmt, *shape, step=step and i == 0)
        torch.cuda.empty_cache()
    return rows


def _decode_shape(fmt, b: int, hq: int, hkv: int, ctx: int, target: float | None, step: bool) -> list[dict]:
    cache = filled_cache(fmt, b, hkv, ctx)
    q = torch.randn(b, hq, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(b, hkv, ctx, 128, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    ours, flash = graph_us(lambda: jt.attention_decode(q, cache)), graph_us(lambda: _flash(q.unsqueeze(2), k, v))
    rows = [
        _row(f"decode {b}, {hq}/{hkv}, {ctx // 1024}k", ours, flash, f"{flash / ours:.2f}x flash", target, flash / ours)
    ]
    if step:  # one decode step: append one token (validated) + attention, one graph
        cache.reserve(ctx + 256)  # the graph's warm-up, capture and 50 replays each append one token
        k1 = torch.randn(b, hkv, 1, 128, device="cuda", dtype=torch.float16)

        def one_step():
            cache.append(k1, k1)
            return jt.attention_decode(q, cache)

        us = graph_us(one_step)
        what = f"decode step (append + attention) {b}, {hq}/{hkv}, {ctx // 1024}k"
        rows.append(_row(what, us, flash, f"{flash / us:.2f}x flash", None, None))
    return rows


def append_rows(fmt) -> list[dict]:
    """``kernel_bench.append_bench``'s validated append against ``ops.write`` (device µs)."""
    rows = append_bench(fmt=fmt)
    base = next(r for r in rows if r["what"].startswith("ops.write"))
    app = next(r for r in rows if r["what"].startswith("append, validate=True"))
    off = next(r for r in rows if r["what"] == "append, validate=False")
    x = app["device_us"] / base["device_us"]
    out = [
        _row(
            "append (validate=True) vs ops.write, 8 x 8 x 16k",
            app["device_us"],
            base["device_us"],
            f"{x:.2f}x ops.write",
            APPEND_TARGET,
            x,
            lower=True,
        )
    ]
    out.append(
        _row(
            "append (validate=False) vs ops.write",
            off["device_us"],
            base["device_us"],
            f"{off['device_us'] / base['device_us']:.2f}x ops.write",
            None,
            None,
        )
    )
    return out


def prefill_rows(fmt, shapes) -> list[dict]:
    """Eager µs of ``jt.attention_prefill`` (stage, attention, commit) vs SDPA flash on the same fp16 tokens."""
    rows = []
    for shape in shapes:
        rows.append(_prefill_shape(fmt, *shape))
        torch.cuda.empty_cache()
    return rows


def _prefill_shape(fmt, b: int, hq: int, hkv: int, hist: int, t: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    cache = filled_cache(fmt, b, hkv, hist)
    cache.reserve(hist + t)
    saved = [x.clone() for x in (cache._lens, cache._comp, cache._rec)]
    q = torch.randn(b, hq, t, 128, device="cuda", dtype=torch.float16)
    kc = torch.randn(b, hkv, t, 128, device="cuda", dtype=torch.float16)
    vc = torch.randn_like(kc)

    def ours():  # the same chunk after the same history each call (lengths put back; ring contents not timed)
        for x, s in zip((cache._lens, cache._comp, cache._rec), saved):
            x.copy_(s)
        cache._host_lens.fill_(hist)
        cache._host_valid = True
        jt.attention_prefill(q, kc, vc, cache)

    kf = torch.randn(b, hkv, hist + t, 128, device="cuda", dtype=torch.float16)
    vf = torch.randn_like(kf)
    bias = causal_lower_right(t, hist + t)

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, kf, vf, attn_mask=bias, enable_gqa=True)

    ours_us, flash_us = _bench([ours]), _bench([flash])
    x = ours_us / flash_us
    what = f"prefill {b}, {hq}/{hkv}, chunk {t} after {hist // 1024}k"
    return _row(what, ours_us, flash_us, f"{x:.2f}x SDPA time", 1.0, x, lower=True)


def _row(what: str, ours: float, base: float, ratio: str, target: float | None, x: float | None, lower=False) -> dict:
    if target is None:
        goal, ok = "—", None
    else:
        goal, ok = (f"<= {target}x" if lower else f">= {target}x"), (x <= target if lower else x >= target)
    return {"row": what, "ours µs": ours, "baseline µs": base, "ratio": ratio, "target": goal, "verdict": _verdict(ok)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default=DEFAULT_PRESET)
    ap.add_argument("--quick", action="store_true", help="decode 8/64k, 1/128k, 1/1k; prefill at 16k only")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--klt",
        default="any",
        help="klt formats: the transform structure timed (tests/helpers/klt_cases.STRUCTURES: any, bytes, cubic, "
        "bytes-cubic)",
    )
    args = ap.parse_args(argv)
    kernel_bench.TIMING_KLT = args.klt
    if not torch.cuda.is_available():
        print("python -m benchmarks targets: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    fmt = load_config(args.format).default
    klt_note = f" ({args.klt} transform)" if fmt.key_mode == "klt" else ""
    t0 = time.time()
    print(
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}, "
        f"format {args.format}{klt_note}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    rows = []
    for part in (
        lambda: decode_rows(fmt, QUICK_DECODE if args.quick else DECODE),
        lambda: append_rows(fmt),
        lambda: prefill_rows(fmt, QUICK_PREFILL if args.quick else PREFILL),
    ):
        rows += part()
        print(f"({time.time() - t0:.0f} s)", flush=True)
    print(table(rows))
    print(f"done in {time.time() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
