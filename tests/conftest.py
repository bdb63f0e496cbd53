"""Test plumbing for the Triton kernels.

Tests marked ``kernel`` launch Triton kernels. On a machine with a CUDA GPU they run in this
process, for real. Without one they must run under Triton's CPU interpreter, which only switches
on when ``TRITON_INTERPRET=1`` is set *before* triton is imported — and other tests of this same
session import triton normally. So on CPU each kernel test module runs once, whole, in a child
``python -m pytest`` with ``TRITON_INTERPRET=1`` (started for all modules at once when the
session begins, so they overlap), and every kernel test here reports its own child's outcome:
pass, fail (with the child's report) or skip. Nothing is counted as passed that did not run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

CHILD_ENV = "JETSON_TQ_KERNEL_REPORT"  # set in a child: write outcomes there
_children: dict[str, tuple[subprocess.Popen, str, str]] = {}


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _delegate() -> bool:
    """True in the parent process on a CPU-only machine: kernel tests run in interpreter children."""
    return CHILD_ENV not in os.environ and os.environ.get("TRITON_INTERPRET") != "1" and not _gpu()


def pytest_addoption(parser):
    parser.addoption(
        "--quick",
        action="store_true",
        help="the edit-loop lane: leave out tests marked slow (under 5 minutes on 2 cores)",
    )


def pytest_configure(config):
    if getattr(config.option, "durations", None) is None:  # CI prints its 15 slowest tests (2-core budget)
        config.option.durations = 15
    config.addinivalue_line("markers", "kernel: launches Triton kernels (GPU, or the CPU interpreter in a child)")


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests skip (with the reason) without a CUDA GPU; ``--quick`` deselects ``slow`` tests and runs each
    kernel test function once, with its first parameter set (Triton's interpreter runs a kernel ~100x slower than
    PyTorch runs its reference: the full lane covers every shape, the edit loop every test)."""
    if config.getoption("--quick"):
        seen: set[tuple[str, str]] = set()
        out = []
        for item in items:
            function = (str(item.path), getattr(item, "originalname", item.name))
            if item.get_closest_marker("slow") or (item.get_closest_marker("kernel") and function in seen):
                out.append(item)
            elif item.get_closest_marker("kernel"):
                seen.add(function)
        if out:
            config.hook.pytest_deselected(items=out)
            dropped = {id(item) for item in out}
            items[:] = [item for item in items if id(item) not in dropped]
    if any(item.get_closest_marker("gpu") for item in items) and not _gpu():
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def pytest_collection_finish(session):
    if not _delegate():
        return
    root = Path(str(session.config.rootpath))
    by_module: dict[str, list[str]] = {}
    for item in session.items:  # after -k / -m selection: children run exactly the selected tests
        if item.get_closest_marker("kernel"):
            by_module.setdefault(str(item.path), []).append(item.nodeid)
    for mod, nodeids in sorted(by_module.items()):
        report = tempfile.NamedTemporaryFile(prefix="jtq-kernel-", suffix=".json", delete=False).name
        log = report.replace(".json", ".log")
        env = dict(os.environ, TRITON_INTERPRET="1", **{CHILD_ENV: report}, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "pytest", *nodeids, "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--tb=short"]
        with open(log, "w") as out:
            _children[mod] = (
                subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT),
                report,
                log,
            )


def _child_results(mod: str) -> tuple[dict, str]:
    proc, report, log = _children[mod]
    proc.wait()
    text = Path(log).read_text(errors="replace")
    try:
        results = json.loads(Path(report).read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        results = {}
    return results, text


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if not pyfuncitem.get_closest_marker("kernel") or not _delegate():
        return None
    results, log = _child_results(str(pyfuncitem.path))
    outcome = results.get(pyfuncitem.nodeid)
    if outcome is None:
        pytest.fail(
            f"the TRITON_INTERPRET=1 child produced no result for this test; its log ends:\n{log[-4000:]}",
            pytrace=False,
        )
    status, detail = outcome
    if status == "failed":
        pytest.fail(f"failed under TRITON_INTERPRET=1 (child process):\n{detail}", pytrace=False)
    if status == "skipped":
        pytest.skip(f"skipped in the TRITON_INTERPRET=1 child: {detail}")
    if status == "xfailed":
        pytest.xfail(f"failed as expected in the TRITON_INTERPRET=1 child: {detail}")
    return True  # ran and passed in the child


def pytest_runtest_logreport(report):
    path = os.environ.get(CHILD_ENV)
    if not path:
        return
    if report.when == "call" or report.outcome != "passed":
        try:
            data = json.loads(Path(path).read_text() or "{}")
        except (OSError, json.JSONDecodeError):
            data = {}
        if report.nodeid in data and data[report.nodeid][0] != "passed":
            return  # keep the first failure (e.g. setup) of a test
        detail = str(report.longrepr)[-6000:] if report.outcome != "passed" else ""
        outcome = report.outcome
        if hasattr(report, "wasxfail") and report.outcome == "skipped":  # an expected failure, reported as one
            outcome, detail = "xfailed", report.wasxfail
        elif report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            detail = report.longrepr[2]
        data[report.nodeid] = (outcome, detail)
        Path(path).write_text(json.dumps(data))


@pytest.fixture(autouse=True)
def _fresh_backend_setting():
    """``jetson_tq.ops`` reads JETSON_TQ_BACKEND once per process: re-read it around every test."""
    from jetson_tq import ops

    ops.configured.cache_clear()
    yield
    ops.configured.cache_clear()
