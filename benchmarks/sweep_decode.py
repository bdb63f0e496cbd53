r"""Launch-configuration sweep of the fused hybrid decode at the two headline shapes, per format.

    python benchmarks/sweep_decode.py [--formats blog_k3v2,mse_k4v3] [--out DIR] [--quick] \
        [--variants JSON] [--shapes JSON]

For each format and shape (B=8 32/8 64k, B=1 32/8 128k) the inputs are built once, the fp16
flash baseline is timed in the same process, then every variant (programs per SM = ``waves``,
``num_stages``, tile size and warps) is checked against the PyTorch reference and timed eager
(``do_bench`` median) and from a CUDA graph. Rows print as they finish; ``--out`` also gets JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernel_bench
import torch
from kernel_bench import (
    _bench,
    _graph_us,
    _sdpa_flash,
    copy_bandwidth,
    leading_sequences,
    make_decode_case,
    resolve_format,
    table,
)

SHAPES = [(8, 32, 8, 65536), (1, 32, 8, 131072)]
TILES = [(64, 4), (32, 2), (128, 8)]  # (block_n, num_warps)
STAGES = [1, 2, 3]
WAVES = [2, 4, 8, 16]


def variants(quick: bool) -> list[dict]:
    """The launch configurations to time (``quick``: waves only, default tile and stages)."""
    if quick:
        return [dict(waves=w) for w in WAVES]
    return [
        dict(block_n=bn, num_warps=nw, num_stages=st, waves=w)
        for (bn, nw), st, w in itertools.product(TILES, STAGES, WAVES)
    ]


def sweep(
    fmt_name: str, shape: tuple[int, int, int, int], todo: list[dict], bw: float, label: str | None = None
) -> list[dict]:
    """Rows of one (format, shape): the flash baseline first, then every variant (``label``: the rows' format
    column, default the format's name)."""
    from jetson_tq.attention.reference import paged_attention_decode
    from jetson_tq.kernels.hybrid_decode_plan import DecodeTuning, hybrid_decode

    b, hq, hkv, ctx = shape
    fmt = resolve_format(fmt_name)
    sets = [make_decode_case(b, hq, hkv, [ctx] * b, fmt=fmt, seed=i) for i in range(2)]
    case = sets[0]
    nbytes = case.compressed_bytes + case.buffer_bytes + 4 * case.q.numel()
    sub = min(b, 2)
    kv = case.kv
    part = leading_sequences(kv, sub)
    ref = paged_attention_decode(case.q[:sub], part).float()
    flash = [lambda c=c: _sdpa_flash(c.q.unsqueeze(2), c.k16, c.v16) for c in sets]
    base = {"format": label or fmt_name, "shape": f"B={b} {hq}/{hkv} {ctx // 1024}k"}
    rows = [{**base, "variant": "torch SDPA flash (fp16 KV)", "eager_us": _bench(flash), "graph_us": _graph_us(flash)}]
    print(table(rows[-1:]), flush=True)
    outs = [torch.empty_like(c.q) for c in sets]
    for var in todo:
        try:
            got = hybrid_decode(case.q, kv, tuning=DecodeTuning(**var))[:sub].float()
            err = ((got - ref).norm() / ref.norm()).item()
            tuning = DecodeTuning(**var)
            fns = [
                lambda c=c, o=o, tuning=tuning: hybrid_decode(c.q, c.kv, out=o, tuning=tuning)
                for c, o in zip(sets, outs)
            ]
            eager, graph = _bench(fns), _graph_us(fns)
            rows.append(
                {
                    **base,
                    "variant": ",".join(f"{k}={v}" for k, v in var.items()),
                    "eager_us": eager,
                    "graph_us": graph,
                    "speedup_graph": rows[0]["graph_us"] / graph,
                    "pct_copy_bw": 100 * nbytes / (graph * 1e-6) / (bw * 1e9),
                    "err": err,
                }
            )
        except Exception as e:
            rows.append({**base, "variant": ",".join(f"{k}={v}" for k, v in var.items()), "error": repr(e)[:200]})
        print(table(rows[-1:]), flush=True)
    del sets, case, outs
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="blog_k3v2,mse_k4v3")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--shapes", type=json.loads, help="JSON list of [B, Hq, Hkv, ctx] (default: B=8 32/8 64k, B=1 32/8 128k)"
    )
    ap.add_argument("--variants", type=json.loads, help="a JSON list of DecodeTuning field dicts (replaces the grid)")
    ap.add_argument(
        "--klt",
        default="any",
        help="klt formats: the transform structures timed, comma-separated (tests/helpers/klt_cases.STRUCTURES: any, "
        "bytes, cubic, bytes-cubic, diagonal, diagonal-bytes-cubic); each one a klt format's row set, labelled "
        "FORMAT/STRUCTURE",
    )
    args = ap.parse_args(argv)
    from tests.helpers.klt_cases import STRUCTURES

    klts = args.klt.split(",")
    unknown = [k for k in klts if k not in STRUCTURES]
    if unknown:
        ap.error(f"--klt {','.join(unknown)}: expected structures of {sorted(STRUCTURES)}")
    t0 = time.time()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw:.0f} GB/s", flush=True)
    rows = []
    for fmt_name, klt in (
        (f, k) for f in args.formats.split(",") for k in (klts if resolve_format(f).key_mode == "klt" else klts[:1])
    ):
        kernel_bench.TIMING_KLT = klt
        label = f"{fmt_name}/{klt}" if resolve_format(fmt_name).key_mode == "klt" else fmt_name
        for shape in [tuple(x) for x in args.shapes] if args.shapes else SHAPES:
            rows += sweep(fmt_name, shape, args.variants or variants(args.quick), bw, label)
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "sweep_decode.json").write_text(json.dumps({"copy_gbps": bw, "rows": rows}, indent=1))
    print(table(rows))
    print(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
