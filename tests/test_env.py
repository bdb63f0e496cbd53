"""``jetson_tq.env``: the environment -> one frozen ``Settings``, with the defaults each reader had."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from jetson_tq import env
from jetson_tq.env import Settings


def test_an_empty_environment_gives_the_defaults():
    s = Settings.from_env({})
    assert s == Settings()
    assert s.config is None and s.kernel_backend == "" and s.flash_prefill and s.sysroot == Path("/")
    assert s.cache_root == Path.home() / ".cache" / "jetson_tq" and s.calibration_dir is None
    assert s.config_dir is None and s.models_dir is None and not s.traceback and s.reproducible is None
    assert s.flash_min_tokens is None


def test_each_variable_reaches_its_field():
    s = Settings.from_env(
        {
            env.CONFIG: "  mse_k4v3 ",
            env.AUTO_REQUESTED: "mse_k4v3",
            env.REPRODUCIBLE: "1",
            env.BACKEND: "Triton",
            env.FLASH_PREFILL: "0",
            env.FLASH_MIN_TOKENS: " 4096 ",
            env.SYSROOT: "/boards/thor",
            env.CACHE: "~/c",
            env.CALIBRATION_DIR: " ~/cal ",
            env.CONFIG_DIR: "/presets",
            env.MODELS_DIR: "/models",
            env.TRACEBACK: "1",
        }
    )
    assert s.config == "mse_k4v3" and s.auto_requested == "mse_k4v3" and s.reproducible == "1"
    assert s.kernel_backend == "Triton"  # validated (case-folded) by jetson_tq.ops, which names the variable
    assert s.flash_min_tokens == "4096"  # parsed by the vLLM flash module, which names the variable
    assert not s.flash_prefill and s.sysroot == Path("/boards/thor") and s.traceback
    assert s.cache_root == Path("~/c").expanduser() and s.calibration_dir == Path("~/cal").expanduser()
    assert (s.config_dir, s.models_dir) == ("/presets", "/models")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.config = "k4v4"  # type: ignore[misc]


def test_blank_values_mean_unset_where_they_did_before():
    s = Settings.from_env({env.CONFIG: "  ", env.CACHE: "", env.CALIBRATION_DIR: " ", env.FLASH_PREFILL: ""})
    assert s.config is None and s.cache_root == Settings().cache_root and s.calibration_dir is None
    assert s.flash_prefill  # only "0" switches the flash prefill off


def test_read_follows_the_environment_of_the_moment(monkeypatch):
    """The vLLM plugin rewrites the switch within a process (auto resolved for child engines): read() sees it."""
    monkeypatch.delenv(env.CONFIG, raising=False)
    assert env.read().config is None
    monkeypatch.setenv(env.CONFIG, "k4v4")
    assert env.read().config == "k4v4"
