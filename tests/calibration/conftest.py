"""Fixtures of the calibration tests: a word tokenizer over the shipped text, and a private calibration cache."""

from __future__ import annotations

import pytest

from tests.calibration.families import word_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer()


@pytest.fixture(autouse=True)
def calibration_dir(tmp_path, monkeypatch):
    """Every test calibrates into its own folder (``JETSON_TQ_CALIBRATION_DIR``), never the user's cache."""
    monkeypatch.setenv("JETSON_TQ_CALIBRATION_DIR", str(tmp_path / "calibrations"))
    return tmp_path / "calibrations"


@pytest.fixture(autouse=True)
def two_windows(monkeypatch):
    """In-process ``auto`` calibrates 2 of the default recipe's windows: the same code path at a quarter of the fit
    (the vLLM end-to-end test, in its own process, runs the default recipe)."""
    from dataclasses import replace

    from jetson_tq.calibration import auto

    default = auto.auto_recipe()
    monkeypatch.setattr(auto, "auto_recipe", lambda: replace(default, windows=2))
