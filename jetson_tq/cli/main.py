"""Argument parsing and dispatch of the jetson-tq command line; named errors become distinct exit codes."""

from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError, MissingComponentError, UnsupportedPlatformError
from . import capacity_cmd, demo_cmd, exit_codes, platform_cmd, vllm_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetson_tq", description="TurboQuant KV cache tools")
    sub = parser.add_subparsers(dest="mode", required=True)
    for module in (demo_cmd, capacity_cmd, platform_cmd, vllm_cmd):
        module.register(sub)
    return parser


#: Subcommands whose arguments belong to another parser (the demo script, the vLLM integration).
PASSTHROUGH = {"demo": "demo_args", "vllm": "vllm_args"}


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; pass-through subcommands get every later argument verbatim (options included)."""
    parser = build_parser()
    if argv and argv[0] in PASSTHROUGH:
        args = parser.parse_args(argv[:1])
        setattr(args, PASSTHROUGH[argv[0]], list(argv[1:]))
        return args
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    try:
        return int(args.func(args) or 0)
    except UnsupportedPlatformError as e:
        print(f"jetson-tq: unsupported platform: {e}", file=sys.stderr)
        return exit_codes.UNSUPPORTED_PLATFORM
    except MissingComponentError as e:
        print(f"jetson-tq: {e}", file=sys.stderr)
        return exit_codes.MISSING_COMPONENT
    except ConfigError as e:
        print(f"jetson-tq: {e}", file=sys.stderr)
        return exit_codes.USAGE
