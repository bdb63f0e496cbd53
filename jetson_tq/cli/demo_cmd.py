"""``python -m jetson_tq demo``: run ``demos/demo_jetson.py`` (the README's main command) with the given arguments."""

from __future__ import annotations

import argparse
from pathlib import Path

from .checkout import ROOT, load_script

DEMO_PATH = ROOT / "demos" / "demo_jetson.py"


def load_demo(path: Path = DEMO_PATH):
    """Import the demo script as a module (it lives beside the package, not inside it, and imports the lab)."""
    return load_script(path, "jetson_tq_demo")


def _run(args: argparse.Namespace) -> int:
    return int(load_demo().main(args.demo_args) or 0)


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the demo report (theorems, kernels, capacity, plots)", add_help=False)
    p.add_argument("demo_args", nargs=argparse.REMAINDER, help="arguments of demos/demo_jetson.py (-h for its help)")
    p.set_defaults(func=_run)
