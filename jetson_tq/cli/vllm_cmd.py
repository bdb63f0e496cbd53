"""``python -m jetson_tq vllm``: stock vLLM vs jetson-tq on one model, run by the lab's side-by-side comparison
(``lab/vllm_compare.py``, ``main(argv) -> int``) from the checkout.

On a platform that cannot run the pinned vLLM (Orin on JetPack 6, unknown Jetsons) it refuses first with
UnsupportedPlatformError (exit code 3). Outside a checkout (an installed wheel, which does not ship the lab) it fails
with MissingComponentError (exit code 5).
"""

from __future__ import annotations

import argparse

from ..errors import UnsupportedPlatformError
from .checkout import import_tool

ENTRY_MODULE = "lab.vllm_compare"


def _run(args: argparse.Namespace) -> int:
    from ..platform import probe, vllm_support

    ok, reason = vllm_support(probe())
    if not ok:
        raise UnsupportedPlatformError(f"vllm cannot run here: {reason}")
    return int(import_tool(ENTRY_MODULE).main(args.vllm_args) or 0)


def register(sub) -> None:
    p = sub.add_parser(
        "vllm", help="stock vLLM vs jetson-tq on one model: capacity, speed, the same greedy tokens", add_help=False
    )
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="arguments of the lab's vLLM comparison")
    p.set_defaults(func=_run)
