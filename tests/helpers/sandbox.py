"""Helpers for tests that run run_jetson.sh or the probe against a fake board (tests only).

``sandbox_env`` builds a PATH holding only the tools run_jetson.sh needs (python3: the base interpreter, outside any
venv, as on a bare host) plus the fake board's ``nvidia-smi`` and, on request, the fake ``docker``: a real GPU or
docker on the test machine can then never leak into the result.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BOARDS = FIXTURES / "platforms"
REPO = FIXTURES.parents[1]
SCRIPT = REPO / "run_jetson.sh"
TOOLS = (
    "bash",
    "env",
    "tr",
    "sed",
    "cut",
    "head",
    "uname",
    "timeout",
    "cat",
    "dirname",
    "sha256sum",
    "mkdir",
    "id",
    "touch",
)


def sandbox_env(tmp_path: Path, board: str, docker: bool = False, **extra: str) -> dict[str, str]:
    """Environment for running run_jetson.sh / the probe on fake board ``board`` (a folder of BOARDS)."""
    bin_dir = tmp_path / f"bin-{board}-{int(docker)}"
    bin_dir.mkdir(exist_ok=True)
    for tool in TOOLS:
        real = shutil.which(tool)
        if real is None:
            raise RuntimeError(f"test set-up: '{tool}' not found on PATH")
        if not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(real)
    if not (bin_dir / "python3").exists():  # the platform probe (jetson_tq/platform/shell.py): a bare interpreter
        (bin_dir / "python3").symlink_to(os.path.realpath(sys.executable))
    fake_smi = BOARDS / board / "bin" / "nvidia-smi"
    if fake_smi.exists() and not (bin_dir / "nvidia-smi").exists():
        (bin_dir / "nvidia-smi").symlink_to(fake_smi)
    if docker and not (bin_dir / "docker").exists():
        (bin_dir / "docker").symlink_to(FIXTURES / "bin" / "docker")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JETSON_TQ_", "FAKE_"))}
    env.update(
        {
            "PATH": str(bin_dir),
            "JETSON_TQ_SYSROOT": str(BOARDS / board),
            "HOME": str(tmp_path / "home"),
            "JETSON_TQ_VENV": str(tmp_path / "venv-never-created"),
            "XDG_CACHE_HOME": str(tmp_path / "cache"),
        }
    )
    env.pop("HF_HOME", None)
    env.pop("VLLM_CACHE_ROOT", None)
    env.update(extra)
    return env


def run_launcher(
    tmp_path: Path, board: str, *args: str, docker: bool = False, **env: str
) -> subprocess.CompletedProcess:
    """run_jetson.sh ARGS on fake board ``board`` (cwd tmp_path, 60 s limit), output captured."""
    e = sandbox_env(tmp_path, board, docker=docker, **env)
    return subprocess.run([str(SCRIPT), *args], env=e, capture_output=True, text=True, timeout=60, cwd=tmp_path)
