"""What the reproducible mode costs in decode attention time, on the GPU, both modes in the same run.

    python3 benchmarks/vllm_gpu/repro_cost.py [--json OUT.json] [--layers 28]

Off, vLLM runs a decode-only step's attention as ``hybrid_decode`` inside its CUDA graph; on
(``JETSON_TQ_REPRODUCIBLE=1``), the backend serves decode rows as one-token prefill chunks (``chunked_prefill``
with ``PrefillTuning(reproducible=True)``, one launch for all rows), eagerly. Per case (Qwen2.5-7B's attention
shape: 28 query / 4 KV heads, head dim 128, the default preset mse_k4v3, B sequences of ``ctx`` compressed
tokens): µs per layer of the default kernel in a CUDA graph and eager, of the reproducible route eager (what vLLM
runs) and in a graph (its device time), and the ratio on / off; times ``--layers`` for a step. Host-side work of
the eager step (metadata, PagedKV) is not included: the end-to-end figures come from the engines of
tests/integrations/vllm/test_vllm_reproducible.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402

from jetson_tq.config import load_config  # noqa: E402
from jetson_tq.paged import PagedKV  # noqa: E402

CASES = [(1, 4096), (8, 4096), (8, 32768), (32, 32768)]


def one_case(batch: int, ctx: int, hq: int = 28, hkv: int = 4, d: int = 128) -> dict:
    """µs per layer of both modes' decode attention for ``batch`` sequences of ``ctx`` tokens."""
    from kernel_bench import _bench, _graph_us, make_decode_case

    from jetson_tq.kernels.hybrid_decode_plan import hybrid_decode
    from jetson_tq.kernels.prefill_plan import PrefillTuning, chunked_prefill

    fmt = load_config("mse_k4v3").default
    ring = fmt.recent_tokens
    # ctx compressed tokens in the pages plus a full ring (off: decode reads both); on, the same pages as a
    # one-token chunk's history at a block boundary (block window: nothing from the ring) plus the chunk itself
    case = make_decode_case(batch, hq, hkv, [ctx + ring] * batch, head_dim=d, fmt=fmt, recent_tokens=ring)
    kv, q = case.kv, case.q
    kv_on = PagedKV(
        kv.pages,
        kv.block_table,
        kv.compressed_lens,
        kv.recent_k,
        kv.recent_v,
        torch.zeros_like(kv.recent_lens),
        kv.recent_index,
        kv.layout,
        kv.codec,
    )
    out = torch.empty_like(q)
    gen = torch.Generator(device=q.device).manual_seed(1)
    q1 = q.unsqueeze(2)  # [B, Hq, 1, D]: the new token as a one-token chunk
    k1 = torch.randn(batch, hkv, 1, d, device=q.device, dtype=q.dtype, generator=gen)
    v1 = torch.randn_like(k1)
    repro = PrefillTuning(reproducible=True)

    def off() -> None:
        hybrid_decode(q, kv, out=out)

    def on() -> None:
        chunked_prefill(q1, k1, v1, kv_on, tuning=repro, max_tokens=ctx + 1)

    off()
    on()
    torch.cuda.synchronize()
    row = {
        "batch": batch,
        "ctx": ctx,
        "off_graph_us": round(_graph_us([off]), 1),
        "off_eager_us": round(_bench([off]), 1),
        "on_eager_us": round(_bench([on]), 1),
    }
    try:
        row["on_graph_us"] = round(_graph_us([on]), 1)
    except Exception as e:  # informative only: vLLM runs the reproducible route eagerly
        row["on_graph_us"] = None
        row["on_graph_error"] = f"{type(e).__name__}: {e}"[:200]
    row["on_vs_off"] = round(row["on_eager_us"] / row["off_graph_us"], 2)
    del case
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=28, help="attention layers per decode step (Qwen2.5-7B: 28)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("repro_cost: needs a CUDA GPU")
    rows = [one_case(b, n) for b, n in CASES]
    print(f"repro_cost: {torch.cuda.get_device_name()}, torch {torch.__version__}, mse_k4v3, 28/4 heads, D=128")
    print(
        f"{'B':>3} {'ctx':>6} {'off graph':>10} {'off eager':>10} {'on eager':>10} {'on graph':>10} {'on/off':>7}"
        f" {'step ms off->on':>16}"
    )
    for r in rows:
        step = f"{r['off_graph_us'] * args.layers / 1e3:.2f}->{r['on_eager_us'] * args.layers / 1e3:.2f}"
        print(
            f"{r['batch']:>3} {r['ctx']:>6} {r['off_graph_us']:>10} {r['off_eager_us']:>10} {r['on_eager_us']:>10} "
            f"{r['on_graph_us'] if r['on_graph_us'] is not None else 'n/a':>10} {r['on_vs_off']:>7} {step:>16}"
        )
    if args.json:
        args.json.write_text(json.dumps({"layers": args.layers, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
