"""The launcher's platform facts, printed as shell assignments: ``run_jetson.sh`` evaluates them instead of keeping
its own copy of the version, the platform probe and the image choice.

    python3 jetson_tq/platform/shell.py
    VERSION=0.1.0 PLATFORM=thor L4T_MAJOR=38 IMAGE=jetson-tq:0.1.0-cu130-arm64 GPU_FLAGS=(--runtime nvidia) ...

The launcher runs this file with the host's ``python3`` before any venv exists (a bare Jetson host has no torch,
and ``import jetson_tq`` imports torch), so run as a file it loads ``jetson_tq.version``, ``jetson_tq.env`` and
``jetson_tq.platform`` without ``jetson_tq/__init__.py``; all three need only the standard library. Every value is
shell-quoted (a board name is read from a file).
"""

from __future__ import annotations

import shlex
import sys
import types
from pathlib import Path


def shell_facts() -> str:
    """``NAME=value`` assignments (one line) of the version and this machine's platform, image and vLLM support."""
    from ..version import __version__
    from .detect import probe
    from .images import container_target

    info = probe(use_torch=False)  # the launcher's pick must not wait for torch (nor need it)
    target = container_target(info)
    values = {
        "VERSION": __version__,
        "PLATFORM": info.kind,
        "L4T_MAJOR": str(info.l4t_major or 0),
        "IMAGE": target.image or "",
        "DOCKERFILE": target.dockerfile or "",
        "VLLM_OK": "1" if target.vllm else "0",
        "REASON": target.reason,
    }
    flags = " ".join(shlex.quote(f) for f in target.gpu_flags)
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in values.items()) + f" GPU_FLAGS=({flags})"


def main() -> int:
    print(shell_facts())
    return 0


if __name__ == "__main__" and not __package__:
    # Run as a file: a bare ``jetson_tq`` package object (its __init__ not run) lets the relative imports resolve.
    package = types.ModuleType("jetson_tq")
    package.__path__ = [str(Path(__file__).resolve().parents[1])]
    sys.modules.setdefault("jetson_tq", package)
    from jetson_tq.platform.shell import main as _main

    sys.exit(_main())
