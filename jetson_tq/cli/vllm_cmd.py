"""``python -m jetson_tq vllm``: hand over to the vLLM integration (``jetson_tq.integrations.vllm.cli.main``).

The integration is built separately; until it is in this build the command fails with
MissingComponentError (exit code 5). On a platform that cannot run the pinned vLLM (Orin on
JetPack 6, unknown Jetsons) it refuses first with UnsupportedPlatformError (exit code 3).
"""

from __future__ import annotations

import argparse
import importlib

from ..errors import MissingComponentError, UnsupportedPlatformError

ENTRY_MODULE = "jetson_tq.integrations.vllm.cli"


def _run(args: argparse.Namespace) -> int:
    from ..platform import probe, vllm_support

    ok, reason = vllm_support(probe())
    if not ok:
        raise UnsupportedPlatformError(f"vllm cannot run here: {reason}")
    try:
        module = importlib.import_module(ENTRY_MODULE)
    except ModuleNotFoundError as e:
        if e.name and (ENTRY_MODULE.startswith(e.name) or e.name.startswith("jetson_tq.integrations")):
            raise MissingComponentError(
                f"vLLM integration not installed: {ENTRY_MODULE} is not in this build (missing module {e.name!r})"
            ) from e
        raise
    return int(module.main(args.vllm_args) or 0)


def register(sub) -> None:
    p = sub.add_parser(
        "vllm", help="stock vLLM vs jetson-tq on one model: capacity, speed, the same greedy tokens", add_help=False
    )
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="arguments of the vLLM integration")
    p.set_defaults(func=_run)
