"""The demo (``python -m jetson_tq demo``): every section has a verdict, kernels are SKIPPED (never faked) when the
dispatcher is absent, agreement runs through the Triton interpreter on CPU, and the vllm subcommand's exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jetson_tq.cli import exit_codes
from jetson_tq.cli.demo_cmd import load_demo
from jetson_tq.cli.main import main
from lab.reports import kernel_check
from tests.helpers.sandbox import BOARDS, REPO, sandbox_env

SECTIONS = ["platform", "theorem1", "theorem2", "theorem3", "kernels", "benchmark", "capacity"]
KERNELS_MISSING = "verdict: SKIPPED: kernels not in this build (jetson_tq.api missing)"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One full demo run on this (CPU) machine, through the CLI entry point."""
    out = tmp_path_factory.mktemp("demo")
    p = subprocess.run(
        [sys.executable, "-m", "jetson_tq", "demo", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    return p, out


@pytest.mark.slow  # the whole demo: ~90 s on 2 cores
def test_demo_sections_verdicts_and_plots(demo_run):
    p, out = demo_run
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [v["section"] for v in summary["verdicts"]] == SECTIONS
    status = {v["section"]: v["status"] for v in summary["verdicts"]}
    for s in ("platform", "theorem1", "theorem2", "theorem3", "capacity"):
        assert status[s] == "PASS", summary["verdicts"]
    for n, title in enumerate(
        [
            "Platform",
            "Theorem 1",
            "Theorem 2",
            "Theorem 3",
            "Kernel vs reference",
            "Decode micro-benchmark",
            "Capacity",
        ],
        start=1,
    ):
        assert f"== {n}. {title}" in p.stdout
    assert p.stdout.count("\nverdict: ") == len(SECTIONS)
    for name in ("theorem1_mse.png", "theorem2_prod.png", "capacity_thor_reference.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "[####################] 4/4" in p.stderr  # progress bars on the theorem loops


@pytest.mark.slow  # > 10 s on 2 cores
def test_demo_kernel_section_passes_or_says_why(demo_run):
    """With the kernels in the build the interpreter agreement section must PASS; without them it says why."""
    p, out = demo_run
    status = {v["section"]: v["status"] for v in json.loads((out / "summary.json").read_text())["verdicts"]}
    if kernel_check.load_dispatch() is None:
        assert KERNELS_MISSING in p.stdout
        assert "verdict: SKIPPED: no CUDA GPU" in p.stdout or "verdict: SKIPPED: kernels not in this build" in p.stdout
    else:
        assert status["kernels"] == "PASS", p.stdout
        assert "verdict: PASS: Triton decode vs reference" in p.stdout


@pytest.mark.slow  # the whole demo: ~90 s on 2 cores
def test_demo_theorem1_table_and_capacity_numbers(demo_run):
    p, out = demo_run
    rows = json.loads((out / "summary.json").read_text())["results"]["theorem1"]
    assert [r["bits"] for r in rows] == [1, 2, 3, 4]
    ref = json.loads((out / "summary.json").read_text())["results"]["capacity_reference"]
    assert 0.85e6 < ref["fp16"]["pool_tokens"] < 0.95e6 and ref["multiplier_pool"] == pytest.approx(
        512 / 122
    )  # mse_k4v3


@pytest.fixture(scope="module")
def demo_module():
    return load_demo()


class Recorder:
    """Minimal stand-in for the demo's section printer."""

    def __init__(self):
        self.verdicts, self.results = [], {}

    def verdict(self, key, status, text):
        self.verdicts.append((key, status, text))

    def progress(self, *a):
        pass


def test_kernel_section_through_the_interpreter_with_a_stand_in_dispatch(demo_module, capsys):
    """The CPU path runs the 'triton' backend in a TRITON_INTERPRET=1 child; with a stand-in that equals the
    reference it must PASS, and it must report that the interpreter was on."""
    rec = Recorder()
    demo_module.section_kernels(rec, False, "tests.helpers.fake_dispatch")
    assert rec.verdicts[0][:2] == ("kernels", "PASS"), rec.verdicts
    assert rec.results["kernels"]["triton_interpret"] == "1" and rec.results["kernels"]["max_abs"] == 0.0
    assert "TRITON_INTERPRET=1" in capsys.readouterr().out


@pytest.mark.slow  # > 10 s on 2 cores
def test_kernel_section_fails_on_a_mismatch(demo_module, monkeypatch):
    monkeypatch.setenv("FAKE_DISPATCH_OFFSET", "0.05")
    rec = Recorder()
    demo_module.section_kernels(rec, False, "tests.helpers.fake_dispatch")
    assert rec.verdicts[0][1] == "FAIL" and rec.results["kernels"]["max_abs"] == pytest.approx(0.05, rel=1e-2)


def test_kernel_section_fails_when_the_kernel_crashes(demo_module):
    rec = Recorder()
    demo_module.section_kernels(rec, False, "tests.helpers.sandbox")  # a module without decode()
    assert rec.verdicts[0][1] == "FAIL" and "decode" in rec.verdicts[0][2]


def test_benchmark_section_on_cpu_is_skipped_with_reason(demo_module):
    rec = Recorder()
    demo_module.section_benchmark(rec, False, object())
    assert rec.verdicts == [("benchmark", "SKIPPED", rec.verdicts[0][2])] and "no CUDA GPU" in rec.verdicts[0][2]


def test_demo_help_passes_through(capsys):
    assert main(["demo", "-h"]) == 0 and "--out" in capsys.readouterr().out  # main returns argparse's status


# ------------------------------------------------------------------------------------------- vllm subcommand
def test_vllm_subcommand_reports_missing_comparison(capsys, monkeypatch):
    """A checkout without the lab's comparison answers with exit 5 and says so (simulated by hiding the module)."""
    import sys

    monkeypatch.setitem(sys.modules, "lab.vllm_compare", None)  # import now fails
    rc = main(["vllm", "--model", "smollm2-135m-instruct"])
    err = capsys.readouterr().err
    assert rc == exit_codes.MISSING_COMPONENT == 5 and "lab.vllm_compare is not in this checkout" in err


def test_checkout_tools_are_missing_outside_a_checkout(tmp_path):
    """An installed wheel has no lab/ or demos/ beside the package: both modes' loaders name what is missing."""
    from jetson_tq.cli.checkout import import_tool, load_script
    from jetson_tq.errors import MissingComponentError

    with pytest.raises(MissingComponentError, match="lab/ is not part of an installed wheel"):
        import_tool("lab.vllm_compare", root=tmp_path)
    with pytest.raises(MissingComponentError, match="demo_jetson.py not found"):
        load_script(tmp_path / "demos" / "demo_jetson.py", "demo", root=tmp_path)


def test_vllm_subcommand_refused_on_jetpack6(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", sandbox_env(tmp_path, "orin_r36")["PATH"])
    monkeypatch.setenv("JETSON_TQ_SYSROOT", str(BOARDS / "orin_r36"))
    assert main(["vllm"]) == exit_codes.UNSUPPORTED_PLATFORM == 3
    assert "JetPack 6" in capsys.readouterr().err
