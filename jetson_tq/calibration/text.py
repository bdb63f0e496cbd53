"""The calibration text shipped with the package, and the token windows a calibration reads from it.

The text is the last ~88 KB of Isaac Newton's *Opticks* (1730; public domain, Project Gutenberg's transcription;
~22k SmolLM2 tokens, enough for 8 windows of 1,024 with any common tokenizer), read through ``importlib.resources``
so it works from an installed wheel. The fidelity harness scores the essays (never calibrated on) and *Opticks* from
its start (the first ~16 KB of 567 KB), so both held-out texts stay disjoint from it (docs/fidelity.md).
"""

from __future__ import annotations

from importlib import resources

import torch

from ..errors import ConfigError

TEXT_PACKAGE = "jetson_tq.calibration"
TEXT_FILE = "texts/calibration.txt"


def calibration_text() -> str:
    """The shipped calibration text (UTF-8)."""
    return resources.files(TEXT_PACKAGE).joinpath(TEXT_FILE).read_text(encoding="utf-8")


def calibration_ids(tokenizer, windows: int, window_len: int, text: str | None = None) -> torch.Tensor:
    """Token ids [windows, window_len] of ``text`` (default: the shipped one): its last windows x window_len tokens,
    each window read from position 0; fewer windows when the text is short for this tokenizer (ConfigError below
    one)."""
    ids = tokenizer(text if text is not None else calibration_text(), return_tensors="pt").input_ids[0]
    rows = min(windows, ids.numel() // window_len)
    if rows < 1:
        raise ConfigError(f"calibration text: {ids.numel():,} tokens with this tokenizer, {window_len:,} needed")
    return ids[ids.numel() - rows * window_len :].reshape(rows, window_len)
