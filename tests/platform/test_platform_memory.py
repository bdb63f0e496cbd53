"""Memory budget per platform (MemAvailable / mem_get_info / RAM) and jtop telemetry through a child process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from jetson_tq.platform import jtop_snapshot, memory_budget, probe, read_meminfo, telemetry
from tests.helpers.sandbox import BOARDS, FIXTURES, sandbox_env

FAKE_JTOP = str(FIXTURES / "fake_jtop")


def board_info(tmp_path, monkeypatch, board):
    monkeypatch.setenv("PATH", sandbox_env(tmp_path, board)["PATH"])
    return probe(BOARDS / board, use_torch=False)


def test_read_meminfo_in_bytes():
    info = read_meminfo(BOARDS / "thor_r38")
    assert info["MemTotal"] == 128272720 * 1024 and info["MemAvailable"] == 121000000 * 1024
    assert read_meminfo(BOARDS / "does-not-exist") == {}


@pytest.mark.parametrize("board, avail_kb", [("thor_r38", 121000000), ("orin_r36", 58000000)])
def test_integrated_budget_is_memavailable(tmp_path, monkeypatch, board, avail_kb):
    info = board_info(tmp_path, monkeypatch, board)

    def must_not_be_called():
        raise AssertionError("mem_get_info must not be used on unified memory")

    mem = memory_budget(info, BOARDS / board, cuda_mem_get_info=must_not_be_called)
    assert (mem.source, mem.available_bytes) == ("MemAvailable", avail_kb * 1024)


def test_discrete_budget_is_mem_get_info(tmp_path, monkeypatch):
    info = board_info(tmp_path, monkeypatch, "x86_h200")
    mem = memory_budget(info, BOARDS / "x86_h200", cuda_mem_get_info=lambda: (140 * 2**30, 143 * 2**30))
    assert (mem.source, mem.available_bytes, mem.total_bytes) == ("cuda.mem_get_info", 140 * 2**30, 143 * 2**30)


def test_discrete_budget_failure_is_reported_not_raised(tmp_path, monkeypatch):
    info = board_info(tmp_path, monkeypatch, "x86_h200")

    def fails():
        raise RuntimeError("CUDA driver not loaded")

    mem = memory_budget(info, BOARDS / "x86_h200", cuda_mem_get_info=fails)
    assert mem.source == "none" and mem.available_bytes is None and "CUDA driver not loaded" in mem.note
    assert mem.total_bytes == 143771 * 2**20  # nvidia-smi's figure is kept


def test_cpu_budget_is_ram(tmp_path, monkeypatch):
    info = board_info(tmp_path, monkeypatch, "x86_cpu")
    mem = memory_budget(info, BOARDS / "x86_cpu")
    assert (mem.source, mem.available_bytes) == ("MemAvailable", 24080000 * 1024)
    fallback = memory_budget(info, tmp_path / "no-proc")  # no meminfo: psutil
    assert fallback.source == "RAM" and fallback.available_bytes > 0 and "psutil" in fallback.note


# ------------------------------------------------------------------------------------------- jtop
def test_jtop_skipped_without_socket(tmp_path, monkeypatch):
    def no_child(*a, **k):
        raise AssertionError("no child process may start without /run/jtop.sock")

    monkeypatch.setattr(subprocess, "run", no_child)
    snap = jtop_snapshot(BOARDS / "x86_cpu")
    assert snap == {"available": False, "reason": "/run/jtop.sock absent (jtop service not running or not mounted)"}


def test_jtop_read_in_a_child_process(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", FAKE_JTOP)
    snap = jtop_snapshot(BOARDS / "thor_r38")
    assert snap["available"], snap
    assert snap["summary"] == {
        "power_total_mw": 31250,
        "temperatures_c": {"cpu": 47.5, "gpu": 45.1, "tj": 49.0},
        "ram_used_fraction": 0.31,
    }
    assert snap["stats"]["pid"] != os.getpid()  # sampled in another process
    assert "jtop" not in sys.modules  # never imported here (it would force "fork")


def test_jtop_service_down_is_not_fatal(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", FAKE_JTOP)
    monkeypatch.setenv("FAKE_JTOP_FAIL", "1")
    snap = jtop_snapshot(BOARDS / "thor_r38")
    assert not snap["available"] and "JtopException" in snap["reason"]


def test_jtop_not_installed_is_not_fatal(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # no jtop package anywhere on the path
    snap = jtop_snapshot(BOARDS / "thor_r38")
    assert not snap["available"] and "jtop not importable" in snap["reason"]


def test_jtop_child_hang_times_out(tmp_path):
    hang = tmp_path / "hang.sh"
    hang.write_text(f"#!/bin/sh\nexec {shutil.which('sleep')} 30\n")
    hang.chmod(0o755)
    snap = jtop_snapshot(BOARDS / "thor_r38", timeout_s=0.5, python=str(hang))
    assert not snap["available"] and "TimeoutExpired" in snap["reason"]


def test_summarize_ignores_odd_values():
    assert telemetry.summarize({"Power TOT": "n/a", "Temp cpu": None, "RAM": 0.5}) == {
        "power_total_mw": None,
        "temperatures_c": {},
        "ram_used_fraction": 0.5,
    }
