"""``python -m jetson_tq capacity`` / ``platform``: table, --json, PNG plot, budgets, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jetson_tq.cli.main import main
from tests.helpers.sandbox import BOARDS, REPO, sandbox_env

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # > 10 s on 2 cores
def test_capacity_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "cap.png"
    rc = main(
        [
            "capacity",
            "--kv-budget-gb",
            "51.6",
            "--config",
            "blog_k3v2",
            "--json",
            "--plot",
            str(plot),
            "--compare",
            "fp16,k4v4",
            "--device",
            "cpu",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    rep = out["report"]
    assert rep["model"]["name"] == "qwen2.5-7b-instruct" and rep["config"] == "blog_k3v2"
    assert rep["budget"]["kv_bytes"] == 51_600_000_000
    assert (rep["fp16"]["pool_tokens"], rep["turboquant"]["pool_tokens"]) == (899_832, 4_607_142)
    assert out["measured"]["ok"] and out["measured"]["device"] == "cpu" and out["measured"]["tokens"] == 1024
    assert out["plot"] == str(plot) and plot.read_bytes()[:8] == PNG_MAGIC


def test_capacity_table_for_a_hypothetical_thor(tmp_path, capsys):
    rc = main(
        [
            "capacity",
            "--memory-gb",
            "128",
            "--utilization",
            "0.85",
            "--model",
            "llama-3.1-8b-instruct",
            "--config",
            "k4v4",
            "--no-plot",
            "--measure-tokens",
            "256",
            "--context",
            "8192",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    assert "budget (--memory-gb 128): 128.00 GB x 0.85 = 108.80 GB - weights 16.06 GB" in text
    assert "multiplier: x3.46 tokens (pool)" in text  # 512 / 148 B per token per head
    assert "measured: a real CompressedKVCache" in text and "ok" in text


def test_capacity_from_the_probed_budget(tmp_path, monkeypatch, capsys):
    """No --memory-gb: the budget is this machine's (here a fake Thor: MemAvailable 121,000,000 kB)."""
    monkeypatch.setenv("PATH", sandbox_env(tmp_path, "thor_r38")["PATH"])
    monkeypatch.setenv("JETSON_TQ_SYSROOT", str(BOARDS / "thor_r38"))
    assert main(["capacity", "--json", "--no-plot", "--no-measure", "--utilization", "0.8"]) == 0
    budget = json.loads(capsys.readouterr().out)["report"]["budget"]
    assert budget["source"] == "this thor: MemAvailable"
    assert budget["available_bytes"] == 121_000_000 * 1024
    assert budget["usable_bytes"] == int(121_000_000 * 1024 * 0.8)


def test_capacity_usage_errors(capsys):
    assert main(["capacity", "--model", "gpt-17", "--no-plot", "--no-measure"]) == 2
    assert "no model 'gpt-17'" in capsys.readouterr().err
    assert main(["capacity", "--config", "nope", "--no-plot", "--no-measure"]) == 2
    assert main(["capacity", "--utilization", "1.5", "--memory-gb", "8", "--no-plot", "--no-measure"]) == 2


def test_platform_command_on_a_fake_orin(tmp_path):
    env = sandbox_env(tmp_path, "orin_r36")  # PATH holds only the fake board's tools
    p = subprocess.run(
        [sys.executable, "-m", "jetson_tq", "platform", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["platform"]["kind"] == "orin" and rep["platform"]["jetpack"] == "6.2"
    assert rep["memory"]["source"] == "MemAvailable"
    assert rep["container"]["image"].endswith("-jp6-arm64") and not rep["container"]["vllm"]
    assert rep["jtop"]["available"] is False
