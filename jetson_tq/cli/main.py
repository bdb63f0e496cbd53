"""Argument parsing and dispatch of the jetson-tq command line."""

from __future__ import annotations

import argparse


def _cmd_demo(args: argparse.Namespace) -> int:
    from ..reports.theorems import theorem1_mse, theorem2_inner_product, theorem3_bounds

    mse = theorem1_mse()
    print("== Theorem 1: TurboQuant_mse distortion, D=128, 8192 random unit vectors ==")
    for r in mse:
        print(f"b={r['bits']}  measured {r['measured']:.4f}  paper {r['paper']:.4f}  ({100 * r['rel_to_paper']:+.1f} %)")
    prod = theorem2_inner_product()
    print("== Theorem 2: TurboQuant_prod inner products ==")
    for r in prod:
        print(f"b={r['bits']}  bias {r['bias']:+.5f} (z={r['bias_z']:+.2f})  d*D_prod {r['distortion_times_d']:.3f}"
              f"  paper {r['paper_times_d']:.3f}")
    print("== Theorem 3: bounds ==")
    for r in theorem3_bounds(mse, prod):
        print(f"{r['quantizer']:<11} b={r['bits']}  {r['lower']:.4f} <= {r['measured']:.4f} <= {r['upper']:.4f}  "
              f"{'ok' if r['ok'] else 'VIOLATED'}")
    return 0


def _cmd_vllm(args: argparse.Namespace) -> int:
    from ..integrations.vllm.compare import main as compare_main

    return compare_main(args.vllm_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetson_tq", description="TurboQuant KV cache tools")
    sub = parser.add_subparsers(dest="mode", required=True)
    demo = sub.add_parser("demo", help="run the demo report")
    demo.set_defaults(func=_cmd_demo)
    # Everything after "vllm" goes to compare.main untouched (its own parser); "+" is no option prefix there.
    vllm = sub.add_parser("vllm", add_help=False, prefix_chars="+", help="stock vLLM vs jetson-tq vLLM side by side (vllm --help)")
    vllm.add_argument("vllm_args", nargs=argparse.REMAINDER)
    vllm.set_defaults(func=_cmd_vllm)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
