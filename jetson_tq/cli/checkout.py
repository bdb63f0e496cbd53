"""Tools that live in a jetson-tq checkout beside the package, not in the wheel: the demo script (``demos/``) and the
lab (``lab/``: the side-by-side vLLM comparison). They import the package and the package never imports them
(tests/test_layering.py); the CLI's ``demo`` and ``vllm`` modes reach them by their place in the checkout, and
answer MissingComponentError (exit 5) in an installed wheel, where they are absent."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from ..errors import MissingComponentError

#: the checkout's root: the folder that holds ``jetson_tq/``, ``demos/`` and ``lab/``
ROOT = Path(__file__).resolve().parents[2]


def _on_path(root: Path) -> None:
    """Put ``root`` first on ``sys.path`` so the checkout's ``lab`` package imports (a no-op when it is there)."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


def load_script(path: Path, name: str, root: Path = ROOT) -> ModuleType:
    """Import the script at ``path`` as module ``name`` (with ``root`` on the path, for the lab it imports);
    MissingComponentError when the file is not there."""
    if not path.exists():
        raise MissingComponentError(
            f"{path.name} not found at {path}: run from a jetson-tq checkout (it is not part of an installed wheel)"
        )
    _on_path(root)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py file path always has a source loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def import_tool(name: str, root: Path = ROOT) -> ModuleType:
    """Import the checkout module ``name`` (e.g. ``lab.vllm_compare``) from ``root``; MissingComponentError when
    ``root`` has no such package (an installed wheel) or the module is hidden."""
    top = name.partition(".")[0]
    if not (root / top / "__init__.py").is_file():
        raise MissingComponentError(
            f"{name} not found under {root}: run from a jetson-tq checkout ({top}/ is not part of an installed wheel)"
        )
    _on_path(root)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise MissingComponentError(f"{name} is not in this checkout (missing module {e.name!r})") from e
        raise
