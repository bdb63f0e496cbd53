"""Platform probe on fake boards (Thor R38, Orin R36/R39, Xavier, x86 GPU/CPU); it never raises."""

from __future__ import annotations

import shutil

import pytest

from jetson_tq.platform import container_target, jetpack_for_l4t, parse_tegra_release, probe, vllm_support
from jetson_tq.platform import detect as probe_mod
from tests.helpers.sandbox import BOARDS, sandbox_env

EXPECTED = {
    #             kind         l4t       jetpack  board substring        gpu                 cc      integrated
    "thor_r38": ("thor", "38.2.0", "7.0", "AGX Thor", "NVIDIA Thor", "11.0", True),
    "orin_r36": ("orin", "36.4.3", "6.2", "AGX Orin", "Orin (nvgpu)", "8.7", True),
    "orin_r39": ("orin", "39.1.0", "7.2", "AGX Orin", "Orin (nvgpu)", "8.7", True),
    "xavier_r35": ("jetson", "35.5.0", "5.1", "AGX Xavier", None, None, True),
    "x86_h200": ("cuda-dgpu", None, None, None, "NVIDIA H200", "9.0", False),
    "x86_cpu": ("cpu", None, None, None, None, None, False),
}


@pytest.fixture
def board_env(tmp_path, monkeypatch):
    """Put the fake board's tools (only) on PATH and return a probe function for a board."""

    def use(board: str):
        env = sandbox_env(tmp_path, board)
        monkeypatch.setenv("PATH", env["PATH"])
        return probe(BOARDS / board, use_torch=False)

    return use


@pytest.mark.parametrize("board", sorted(EXPECTED))
def test_probe_fake_boards(board_env, board):
    info = board_env(board)
    kind, l4t, jetpack, board_name, gpu, cc, integrated = EXPECTED[board]
    assert (info.kind, info.l4t, info.jetpack, info.integrated) == (kind, l4t, jetpack, integrated)
    assert (board_name in info.board) if board_name else info.board is None
    assert info.gpu_name == gpu
    assert info.compute_capability == cc
    assert info.errors == []


def test_h200_memory_from_nvidia_smi(board_env):
    assert board_env("x86_h200").gpu_memory_bytes == 143771 * 2**20


def test_thor_smi_na_memory_is_left_unknown(board_env):
    info = board_env("thor_r38")
    assert info.gpu_memory_bytes is None and info.sources["l4t"] == "/etc/nv_tegra_release"


@pytest.mark.parametrize(
    "line, want",
    [
        ("# R38 (release), REVISION: 2.0, GCID: 41844464, BOARD: generic, EABI: aarch64", "38.2.0"),
        ("# R36 (release), REVISION: 4.4, GCID: 1, BOARD: generic", "36.4.4"),
        ("# R39 (release), REVISION: 0, GCID: 1", "39.0.0"),
        ("garbage", None),
        ("", None),
    ],
)
def test_parse_tegra_release(line, want):
    assert parse_tegra_release(line) == want


@pytest.mark.parametrize(
    "l4t, jp",
    [
        ("38.2.0", "7.0"),
        ("38.4.0", "7.1"),
        ("39.0.0", "7.2"),
        ("39.2.1", "7.2"),
        ("36.4.0", "6.1"),
        ("36.4.3", "6.2"),
        ("36.4.4", "6.2.1"),
        ("36.3.0", "6.0"),
        ("35.5.0", "5.1"),
        ("40.0.0", None),
        (None, None),
    ],
)
def test_jetpack_for_l4t(l4t, jp):
    assert jetpack_for_l4t(l4t) == jp


def test_model_copy_inside_a_container(tmp_path, monkeypatch):
    """No /proc/device-tree in a container: the launcher's copy at /tmp/nv_jetson_model is read instead."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "tmp").mkdir()
    (tmp_path / "etc/nv_tegra_release").write_text("# R39 (release), REVISION: 1.0, GCID: 0, BOARD: generic\n")
    (tmp_path / "tmp/nv_jetson_model").write_bytes(b"NVIDIA Jetson AGX Thor Developer Kit\x00")
    (tmp_path / ".dockerenv").write_text("")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    info = probe(tmp_path, use_torch=False)
    assert (info.kind, info.jetpack, info.in_container, info.sources["board"]) == (
        "thor",
        "7.2",
        True,
        "/tmp/nv_jetson_model",
    )
    assert info.compute_capability == "11.0" and info.sources["compute_capability"] == "known for this board"


def test_l4t_alone_decides_when_the_board_name_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    (tmp_path / "etc").mkdir()
    for line, kind in (
        ("# R38 (release), REVISION: 4.0", "thor"),
        ("# R36 (release), REVISION: 4.3", "orin"),
        ("# R39 (release), REVISION: 1.0", "jetson"),
    ):
        (tmp_path / "etc/nv_tegra_release").write_text(line + "\n")
        assert probe(tmp_path, use_torch=False).kind == kind


def _write_smi(tmp_path, body: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + body + "\n")
    smi.chmod(0o755)
    return bin_dir


def test_probe_never_raises_on_bad_inputs(tmp_path, monkeypatch):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/nv_tegra_release").write_text("this is not an L4T release line\n")
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/device-tree").write_text("")  # a file where a folder should be
    monkeypatch.setenv("PATH", str(_write_smi(tmp_path, "echo 'NVIDIA-SMI has failed' >&2; exit 9")))
    info = probe(tmp_path, use_torch=False)
    assert info.kind == "jetson" and info.l4t is None
    assert any("unrecognised first line" in e for e in info.errors)
    assert any("nvidia-smi: exit 9" in e for e in info.errors)


def test_slow_nvidia_smi_times_out(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(_write_smi(tmp_path, f"exec {shutil.which('sleep')} 30")))
    monkeypatch.setattr(probe_mod, "NVIDIA_SMI_TIMEOUT_S", 0.3)
    info = probe(tmp_path, use_torch=False)
    assert info.kind == "cpu" and any("TimeoutExpired" in e for e in info.errors)


def test_unexpected_exception_is_recorded_not_raised(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(probe_mod, "_read_text", boom)
    info = probe(tmp_path, use_torch=False)
    assert info.kind == "cpu" and info.errors == ["probe: RuntimeError: disk on fire"]


def test_probe_with_torch_on_this_machine():
    info = probe()  # the real machine: whatever it is, no exception and a known kind
    assert info.kind in probe_mod.KINDS and info.torch_version


def test_sysroot_env_var(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", sandbox_env(tmp_path, "orin_r36")["PATH"])
    monkeypatch.setenv("JETSON_TQ_SYSROOT", str(BOARDS / "orin_r36"))
    assert probe(use_torch=False).kind == "orin"


@pytest.mark.parametrize(
    "board, image_part, flags, vllm",
    [
        ("thor_r38", "cu130-arm64", ("--runtime", "nvidia"), True),
        ("orin_r39", "cu130-arm64", ("--runtime", "nvidia"), True),
        ("orin_r36", "jp6-arm64", ("--runtime", "nvidia"), False),
        ("xavier_r35", None, (), False),
        ("x86_h200", "cu130-", ("--gpus", "all"), True),
        ("x86_cpu", None, (), True),
    ],
)
def test_container_target(board_env, board, image_part, flags, vllm):
    info = board_env(board)
    target = container_target(info)
    assert (target.image is None) == (image_part is None)
    if image_part:
        assert image_part in target.image and target.image.startswith("jetson-tq:")
    assert target.gpu_flags == flags
    assert vllm_support(info) == (vllm, target.reason)
    if not vllm:
        assert target.reason
