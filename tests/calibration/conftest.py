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
