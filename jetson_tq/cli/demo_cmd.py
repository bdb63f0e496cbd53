"""``python -m jetson_tq demo``: run ``demos/demo_jetson.py`` (the README's main command) with the given arguments."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from ..errors import MissingComponentError

DEMO_PATH = Path(__file__).resolve().parents[2] / "demos" / "demo_jetson.py"


def load_demo(path: Path = DEMO_PATH):
    """Import the demo script as a module (it lives beside the package, not inside it)."""
    if not path.exists():
        raise MissingComponentError(
            f"demo script not found at {path}: run from a jetson-tq checkout "
            "(the demo is not part of an installed wheel)"
        )
    spec = importlib.util.spec_from_file_location("jetson_tq_demo", path)
    assert spec is not None and spec.loader is not None  # a .py file path always has a source loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(args: argparse.Namespace) -> int:
    return int(load_demo().main(args.demo_args) or 0)


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the demo report (theorems, kernels, capacity, plots)", add_help=False)
    p.add_argument("demo_args", nargs=argparse.REMAINDER, help="arguments of demos/demo_jetson.py (-h for its help)")
    p.set_defaults(func=_run)
