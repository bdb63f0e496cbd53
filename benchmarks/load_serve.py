"""Load and faults against a running ``vllm serve`` (jetson-tq's plugin or stock), over loopback only.

    python benchmarks/load_serve.py --port 8000 [--clients 64] [--duration 180] [--max-requests 5000]
        [--min-prompt 100] [--max-prompt 30000] [--max-tokens 64] [--server-pid PID] [--json out.json]

N client threads stream ``/v1/completions`` requests (token-id prompts of ragged lengths, log-uniform in
[--min-prompt, --max-prompt], ``ignore_eos`` so each asks for exactly its ``max_tokens``); a quarter of the
streams (``--disconnect-frac``) close their socket after 1-3 chunks; ``--bad-frac`` of the requests are bad on
purpose: a prompt longer than the server's ``max_model_len``, an empty prompt, ``max_tokens`` 0, absurd sampling
values (temperature -1, top_p 5, n 10^6, top_k -5, logprobs 10^6, presence_penalty 1e9, max_tokens 10^9, a string
temperature) and a body that is not JSON. A KV budget small enough to force queueing and preemption is the
server's part (``--kv-cache-memory-bytes`` / ``--num-gpu-blocks-override``).

Invariants (exit 1 when one fails, 2 for a bad command line):
- every request either completes (HTTP 200, a finish reason, ``[DONE]``, exactly ``max_tokens`` tokens) or gets
  a clear HTTP 4xx (a JSON body with a message); a prompt longer than ``max_model_len`` must be a 4xx; no 5xx, no
  error inside a stream, no connection dropped by the server, nothing left hanging past ``--request-timeout``;
- no NaN/inf among the streamed log-probabilities;
- afterwards the server is idle again: ``/health`` answers, no request running or waiting, and the KV-cache usage
  in ``/metrics`` is back at its start value (no leaked blocks); then a burst of short requests, one per client,
  all complete (leaked blocks or recent-buffer rows would refuse or stall them);
- server memory is flat: the resident memory of ``--server-pid`` and its children (or the API process's own
  ``process_resident_memory_bytes``) after the load is within ``--rss-tolerance`` of the value after warm-up, and
  the GPU memory nvidia-smi reports for that tree (when there is one) grew by at most ``--rss-tolerance-mib``.
Printed (and written to ``--json``): requests by kind and outcome, aggregate generated tokens/s, TTFT p50/p99,
peak KV usage, waiting requests, preemptions, memory. Hard limits: at most 256 clients, 1800 s, 100,000 requests;
only 127.0.0.1 / ::1 / localhost. Standard library only (the GPU machine has no aiohttp / httpx).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import re
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

LOOPBACK = ("127.0.0.1", "::1", "localhost")
MAX_CLIENTS, MAX_DURATION_S, MAX_REQUESTS = 256, 1800, 100_000
#: /metrics names across vLLM versions (the first present is used)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREEMPTIONS = ("vllm:num_preemptions_total", "vllm:num_preemptions")
#: bad requests: name -> (changes to a valid streaming body, may it complete?) — a 4xx is always acceptable
ABSURD: dict[str, tuple[dict, bool]] = {
    "temperature -1": ({"temperature": -1.0}, False),
    "top_p 5": ({"top_p": 5.0, "temperature": 0.8}, False),
    "n 10^6": ({"n": 10**6, "temperature": 0.8}, False),
    "top_k -5": ({"top_k": -5, "temperature": 0.8}, False),
    "logprobs 10^6": ({"logprobs": 10**6}, False),
    "presence_penalty 1e9": ({"presence_penalty": 1e9}, False),
    "max_tokens 10^9": ({"max_tokens": 10**9}, False),
    "temperature 'hot'": ({"temperature": "hot"}, False),
    "max_tokens 0": ({"max_tokens": 0}, True),
    "empty prompt": ({"prompt": []}, True),
    "empty text prompt": ({"prompt": ""}, True),
}


@dataclass
class Outcome:
    """What one request did."""

    kind: str
    ok: bool
    status: int | None = None
    why: str = ""
    prompt_tokens: int = 0
    max_tokens: int = 0
    tokens: int = 0
    ttft_s: float | None = None
    wall_s: float = 0.0
    error: str = ""
    in_stream_error: bool = False  # the error came as an event inside an HTTP 200 stream


@dataclass
class Plan:
    """One request to send: its kind, body (bytes) and what is acceptable."""

    kind: str
    body: bytes
    prompt_tokens: int = 0
    max_tokens: int = 0
    complete_ok: bool = True  # a completion is acceptable
    http4xx_ok: bool = False  # a 4xx is acceptable
    disconnect_after: int = 0  # close the socket after this many chunks (0: read to the end)


@dataclass
class Sample:
    """One reading of the server's state."""

    t: float
    kv_usage: float | None
    running: float | None
    waiting: float | None
    preemptions: float | None
    rss_bytes: int | None
    gpu_bytes: int | None = None


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------- HTTP
def _connect(host: str, port: int, timeout: float) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(host, port, timeout=timeout)


def get(host: str, port: int, path: str, timeout: float = 10.0) -> tuple[int, str]:
    """GET ``path`` -> (status, text)."""
    conn = _connect(host, port, timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        conn.close()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value summed over label sets} (``_created`` samples left out)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m and not m.group(1).endswith("_created"):
            try:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
            except ValueError:
                continue
    return out


def _first(metrics: dict[str, float], names) -> float | None:
    return next((metrics[n] for n in names if n in metrics), None)


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.append(p)
            todo += children.get(p, [])
    return out


def gpu_bytes(pids: list[int]) -> int | None:
    """GPU memory nvidia-smi reports for these processes (None without nvidia-smi or a GPU)."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return None
    try:
        res = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    used = {
        int(a): int(b)
        for a, b in (line.split(",") for line in res.stdout.splitlines() if "," in line)
        if a.strip().isdigit() and b.strip().isdigit()
    }
    return sum(used.get(p, 0) for p in pids) * 2**20 if res.returncode == 0 else None


def tree_rss(pid: int) -> int | None:
    """Resident bytes of ``pid`` and all its descendants (Linux /proc; None when unreadable)."""
    total = 0
    for p in process_tree(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            if p == pid:
                return None
            continue
        m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        total += int(m.group(1)) * 1024 if m else 0
    return total


def sample(host: str, port: int, pid: int | None) -> Sample:
    """Read /metrics (and the process tree's RSS when a pid is given)."""
    try:
        status, text = get(host, port, "/metrics", timeout=10)
        m = parse_metrics(text) if status == 200 else {}
    except OSError:
        m = {}
    rss = tree_rss(pid) if pid else None
    if rss is None and "process_resident_memory_bytes" in m:
        rss = int(m["process_resident_memory_bytes"])
    return Sample(
        time.time(),
        _first(m, KV_USAGE),
        m.get("vllm:num_requests_running"),
        m.get("vllm:num_requests_waiting"),
        _first(m, PREEMPTIONS),
        rss,
        gpu_bytes(process_tree(pid)) if pid else None,
    )


# ------------------------------------------------------------------------------------------- requests
def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _ids(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return [rng.randrange(lo, hi) for _ in range(n)]


BAD_KINDS = [*sorted(ABSURD), "too_long", "not_json"]


def make_plan(
    rng: random.Random, args: argparse.Namespace, model: str, max_model_len: int, bad_count: list[int] | None = None
) -> Plan:
    """One request: a valid stream (some of them disconnecting early) or, with probability --bad-frac, a bad one
    (the bad kinds in turn, so a short run sees each of them)."""
    max_tokens = rng.randint(1, args.max_tokens)
    hi = max(args.min_prompt, min(args.max_prompt, max_model_len - max_tokens))
    n = _log_uniform(rng, args.min_prompt, hi)
    body = {
        "model": model,
        "prompt": _ids(rng, n, *args.token_range),
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "logprobs": 1,
        "stream_options": {"include_usage": True},
        "temperature": rng.choice([0.0, 0.0, 0.8]),
    }
    if rng.random() < args.bad_frac:
        bad_count = [0] if bad_count is None else bad_count
        pick = BAD_KINDS[bad_count[0] % len(BAD_KINDS)]
        bad_count[0] += 1
        if pick == "too_long":  # longer than the model: must be refused
            n = max_model_len + rng.randint(1, 64)
            body.update(prompt=_ids(rng, n, *args.token_range), max_tokens=8)
            return Plan("too_long", json.dumps(body).encode(), n, 8, complete_ok=False, http4xx_ok=True)
        if pick == "not_json":
            return Plan("not_json", b'{"model": "' + model.encode() + b'", "prompt": [1, 2', 0, 0, False, True)
        name = pick
        change, may_complete = ABSURD[name]
        body.update(change)
        plen = len(body["prompt"]) if isinstance(body["prompt"], list) else 0
        mt = body["max_tokens"] if isinstance(body["max_tokens"], int) else 0
        return Plan(f"bad: {name}", json.dumps(body).encode(), plen, mt, complete_ok=may_complete, http4xx_ok=True)
    if rng.random() < args.disconnect_frac:
        return Plan("disconnect", json.dumps(body).encode(), n, max_tokens, disconnect_after=rng.randint(1, 3))
    return Plan("stream", json.dumps(body).encode(), n, max_tokens)


def _finite(values) -> bool:
    return all(v is None or (isinstance(v, (int, float)) and math.isfinite(v)) for v in values)


def run_request(host: str, port: int, plan: Plan, timeout: float) -> Outcome:
    """Send one request and judge it against its plan."""
    out = Outcome(plan.kind, False, prompt_tokens=plan.prompt_tokens, max_tokens=plan.max_tokens)
    t0 = time.perf_counter()
    conn = _connect(host, port, timeout)
    try:
        conn.request("POST", "/v1/completions", body=plan.body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        out.status = r.status
        if r.status != 200:
            text = r.read().decode("utf-8", "replace")
            out.error = text[:300]
            try:
                payload = json.loads(text)
                message = payload.get("error", payload) if isinstance(payload, dict) else payload
                message = message.get("message", "") if isinstance(message, dict) else str(message)
            except ValueError:
                message = ""
            if 400 <= r.status < 500 and plan.http4xx_ok and message:
                out.ok = True
            else:
                out.why = (
                    f"HTTP {r.status} without a message"
                    if 400 <= r.status < 500 and plan.http4xx_ok
                    else f"HTTP {r.status} where {'a 4xx or ' if plan.http4xx_ok else ''}a completion was due"
                )
            return out
        if not plan.complete_ok:
            out.why = "completed a request that must be refused"
        chunks, done, finish, usage = 0, False, None, None
        for raw in iter(r.readline, b""):
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            msg = json.loads(data)
            if "error" in msg or msg.get("object") == "error":
                # vLLM validates some parameters (logprobs > max_logprobs) after the 200 header went out: a 4xx
                # error event with a message is as clear as a 4xx status; anything else is a server failure
                err = msg.get("error", msg) if isinstance(msg.get("error", msg), dict) else {}
                code = int(err.get("code") or 0) if str(err.get("code") or "0").isdigit() else 0
                out.status, out.error, out.in_stream_error = code or out.status, str(err)[:300], True
                if plan.http4xx_ok and 400 <= code < 500 and err.get("message"):
                    out.ok, out.why = True, ""
                else:
                    out.why = f"error inside the stream: {str(msg)[:200]}"
                return out
            if msg.get("usage"):
                usage = msg["usage"]
            for choice in msg.get("choices", []):
                lp = choice.get("logprobs") or {}
                if not _finite(lp.get("token_logprobs") or []):
                    out.why = f"non-finite log-probability in the stream: {lp.get('token_logprobs')}"
                    return out
                n_tok = len(lp.get("tokens") or []) or (1 if choice.get("text") else 0)
                out.tokens += n_tok
                if n_tok and out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - t0
                finish = choice.get("finish_reason") or finish
            chunks += 1
            if time.perf_counter() - t0 > timeout:
                out.why = f"still streaming after --request-timeout {timeout:g} s"
                return out
            if plan.disconnect_after and chunks >= plan.disconnect_after:
                conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
                out.ok = not out.why
                return out
        if usage and usage.get("completion_tokens") is not None:
            out.tokens = int(usage["completion_tokens"])
        if out.why:
            return out
        if not done or finish is None:
            out.why = f"stream ended without {'[DONE]' if not done else 'a finish reason'}"
        elif plan.kind in ("stream", "disconnect") and out.tokens != plan.max_tokens:
            out.why = f"{out.tokens} tokens generated, {plan.max_tokens} asked for (ignore_eos)"
        else:
            out.ok = True
        return out
    except (OSError, http.client.HTTPException, ValueError) as e:
        out.why = f"{type(e).__name__}: {e}"[:300]
        return out
    finally:
        out.wall_s = time.perf_counter() - t0
        conn.close()


# ------------------------------------------------------------------------------------------- the run
def check_loopback(host: str) -> str:
    """The host, if it is a loopback address; otherwise a usage error (this script never leaves the machine)."""
    if host not in LOOPBACK:
        raise SystemExit(f"load_serve: --host must be one of {LOOPBACK} (loopback only), got {host!r}")
    infos = socket.getaddrinfo(host, None)
    if not all(info[4][0] in ("127.0.0.1", "::1") for info in infos):
        raise SystemExit(f"load_serve: {host!r} does not resolve to loopback only: {[i[4][0] for i in infos]}")
    return host


def server_model(host: str, port: int, model: str | None) -> tuple[str, int]:
    """(served model name, max_model_len) from /v1/models."""
    try:
        status, text = get(host, port, "/v1/models")
    except OSError as e:
        raise SystemExit(
            f"load_serve: no server answers on {host}:{port} ({type(e).__name__}: {e}); start vllm serve first"
        ) from e
    if status != 200:
        raise SystemExit(f"load_serve: GET /v1/models answered {status}: {text[:200]}")
    cards = json.loads(text)["data"]
    card = next((c for c in cards if model in (None, c["id"])), None)
    if card is None:
        raise SystemExit(f"load_serve: model {model!r} not served; the server has {[c['id'] for c in cards]}")
    return card["id"], int(card.get("max_model_len") or 0)


def wait_until_idle(host: str, port: int, pid: int | None, start_kv: float | None, timeout: float) -> Sample:
    """Poll until nothing runs or waits and the KV usage is back at ``start_kv`` (or the timeout); the last sample."""
    deadline = time.time() + timeout
    while True:
        s = sample(host, port, pid)
        idle = not s.running and not s.waiting
        kv_back = start_kv is None or s.kv_usage is None or abs(s.kv_usage - start_kv) < 1e-9
        if (idle and kv_back) or time.time() > deadline:
            return s
        time.sleep(0.5)


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by nearest rank."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def run(args: argparse.Namespace) -> dict:
    host = check_loopback(args.host)
    model, mml = server_model(host, args.port, args.model)
    mml = args.max_model_len or mml
    if not mml:
        raise SystemExit("load_serve: the server did not report max_model_len; pass --max-model-len")
    rep = Report()
    start = sample(host, args.port, args.server_pid)
    rep.samples.append(start)
    rng_lock, out_lock = threading.Lock(), threading.Lock()
    rng = random.Random(args.seed)
    t_start = time.time()
    stop_at = t_start + args.duration
    issued, bad_count = [0], [0]
    warm: list[Sample] = []

    def next_plan() -> Plan | None:
        with rng_lock:
            if time.time() >= stop_at or issued[0] >= args.max_requests:
                return None
            issued[0] += 1
            return make_plan(rng, args, model, mml, bad_count)

    def client() -> None:
        while (plan := next_plan()) is not None:
            o = run_request(host, args.port, plan, args.request_timeout)
            with out_lock:
                rep.outcomes.append(o)

    done = threading.Event()

    def monitor() -> None:
        while not done.wait(args.sample_every):
            s = sample(host, args.port, args.server_pid)
            rep.samples.append(s)
            if not warm and time.time() - t_start >= args.warmup:
                warm.append(s)

    mon = threading.Thread(target=monitor, daemon=True)
    mon.start()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
    for t in threads:
        t.start()
    hard_stop = stop_at + args.request_timeout + 30
    for t in threads:
        t.join(max(0.0, hard_stop - time.time()))
    hanging = sum(t.is_alive() for t in threads)
    load_s = time.time() - t_start
    done.set()
    mon.join(5)
    if hanging:
        rep.failures.append(
            f"{hanging} client(s) still waiting for the server {hard_stop - t_start:.0f} s after the start"
        )
    after = wait_until_idle(host, args.port, args.server_pid, start.kv_usage, args.settle)
    # leaked blocks or recent-buffer rows would refuse or stall these
    burst_args = argparse.Namespace(
        **{
            **vars(args),
            "bad_frac": 0.0,
            "disconnect_frac": 0.0,
            "max_prompt": 64,
            "min_prompt": min(args.min_prompt, 16),
            "max_tokens": 8,
        }
    )
    burst_plans = [make_plan(rng, burst_args, model, mml) for _ in range(min(args.clients, 64))]
    burst: list[Outcome] = []

    def one(plan: Plan) -> None:
        burst.append(run_request(host, args.port, plan, args.request_timeout))

    bthreads = [threading.Thread(target=one, args=(p,)) for p in burst_plans]
    for t in bthreads:
        t.start()
    for t in bthreads:
        t.join(args.request_timeout + 5)
    end = wait_until_idle(host, args.port, args.server_pid, start.kv_usage, args.settle)
    rep.samples.append(end)
    health = get(host, args.port, "/health")[0]
    return summarize(args, rep, start, warm[0] if warm else start, after, end, burst, health, load_s, model, mml)


def summarize(
    args,
    rep: Report,
    start: Sample,
    warm: Sample,
    after: Sample,
    end: Sample,
    burst: list[Outcome],
    health: int,
    load_s: float,
    model: str,
    mml: int,
) -> dict:
    """Judge the invariants and gather the figures."""
    outs = rep.outcomes
    by_kind: dict[str, dict[str, int]] = {}
    for o in outs:
        k = by_kind.setdefault(o.kind, {"sent": 0, "ok": 0, "http_200": 0, "http_4xx": 0, "in_stream_4xx": 0})
        k["sent"] += 1
        k["ok"] += o.ok
        k["http_200"] += o.status == 200
        k["http_4xx" if not o.in_stream_error else "in_stream_4xx"] += o.status is not None and 400 <= o.status < 500
    bad = [o for o in outs if not o.ok]
    for o in bad[:20]:
        rep.failures.append(f"{o.kind}: {o.why} (HTTP {o.status}, {o.prompt_tokens} prompt tokens) {o.error[:120]}")
    if len(bad) > 20:
        rep.failures.append(f"... and {len(bad) - 20} more failed requests")
    if health != 200:
        rep.failures.append(f"/health answered {health} after the load")
    if after.running or after.waiting:
        rep.failures.append(
            f"not idle {args.settle:.0f} s after the load: {after.running} running, {after.waiting} waiting"
        )
    if start.kv_usage is not None and (after.kv_usage is None or abs(after.kv_usage - start.kv_usage) > 1e-9):
        rep.failures.append(f"KV-cache usage {after.kv_usage} after the load, {start.kv_usage} before: blocks leaked")
    if end.kv_usage is not None and start.kv_usage is not None and abs(end.kv_usage - start.kv_usage) > 1e-9:
        rep.failures.append(f"KV-cache usage {end.kv_usage} after the final burst, {start.kv_usage} before")
    burst_bad = [o for o in burst if not o.ok]
    if burst_bad or len(burst) < min(args.clients, 64):
        rep.failures.append(
            f"final burst: {len(burst) - len(burst_bad)} of {min(args.clients, 64)} short requests "
            f"completed ({[o.why for o in burst_bad][:3]})"
        )
    rss_growth = None
    if warm.rss_bytes and end.rss_bytes:
        rss_growth = end.rss_bytes - warm.rss_bytes
        allowed = max(args.rss_tolerance * warm.rss_bytes, args.rss_tolerance_mib * 2**20)
        if rss_growth > allowed:
            rep.failures.append(
                f"server memory grew by {rss_growth / 2**20:.0f} MiB after warm-up "
                f"({warm.rss_bytes / 2**20:.0f} -> {end.rss_bytes / 2**20:.0f} MiB; allowed "
                f"{allowed / 2**20:.0f} MiB)"
            )
    gpu_growth = None
    if warm.gpu_bytes and end.gpu_bytes:
        gpu_growth = end.gpu_bytes - warm.gpu_bytes
        if gpu_growth > args.rss_tolerance_mib * 2**20:  # vLLM reserves its GPU memory up front: any growth shows
            rep.failures.append(
                f"server GPU memory grew by {gpu_growth / 2**20:.0f} MiB after warm-up "
                f"({warm.gpu_bytes / 2**20:.0f} -> {end.gpu_bytes / 2**20:.0f} MiB)"
            )
    done = [o for o in outs if o.kind in ("stream", "disconnect") and o.ok]
    ttft = [o.ttft_s for o in done if o.ttft_s is not None]
    tokens = sum(o.tokens for o in outs if o.status == 200)
    kv = [s.kv_usage for s in rep.samples if s.kv_usage is not None]
    waiting = [s.waiting for s in rep.samples if s.waiting is not None]
    pre = [s.preemptions for s in (start, end) if s.preemptions is not None]
    preemptions = pre[-1] - pre[0] if len(pre) == 2 else None
    if args.expect_preemption and not preemptions:
        rep.failures.append(f"no preemption happened (vLLM counted {preemptions}); expected the KV budget to force it")
    if args.expect_queueing and not (waiting and max(waiting) > 0):
        rep.failures.append("no request ever waited in vLLM's queue; expected the load to exceed the KV budget")
    return {
        "model": model,
        "max_model_len": mml,
        "clients": args.clients,
        "load_s": round(load_s, 1),
        "requests": len(outs),
        "failed": len(bad),
        "by_kind": dict(sorted(by_kind.items())),
        "generated_tokens": tokens,
        "throughput_tok_s": round(tokens / load_s, 1) if load_s > 0 else None,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "prompt_tokens_completed": sum(o.prompt_tokens for o in done),
        "kv_usage": {
            "start": start.kv_usage,
            "peak": max(kv) if kv else None,
            "after": after.kv_usage,
            "end": end.kv_usage,
        },
        "max_waiting": max(waiting) if waiting else None,
        "preemptions": preemptions,
        "rss_mib": {
            k: round(s.rss_bytes / 2**20, 1) if s.rss_bytes else None
            for k, s in (("start", start), ("after_warmup", warm), ("end", end))
        },
        "rss_growth_mib": round(rss_growth / 2**20, 1) if rss_growth is not None else None,
        "gpu_mib": {
            k: round(s.gpu_bytes / 2**20, 1) if s.gpu_bytes else None
            for k, s in (("start", start), ("after_warmup", warm), ("end", end))
        },
        "gpu_growth_mib": round(gpu_growth / 2**20, 1) if gpu_growth is not None else None,
        "memory_timeline": memory_timeline(rep.samples, start.t),
        "final_burst_ok": sum(o.ok for o in burst),
        "health": health,
        "failures": rep.failures,
        "ok": not rep.failures,
        "outcomes": [asdict(o) for o in outs] if args.keep_outcomes else None,
    }


def memory_timeline(samples: list[Sample], t0: float, points: int = 24) -> list[dict]:
    """At most ``points`` readings (seconds since the start, GPU and RSS MiB, KV usage, running and waiting
    requests), evenly spread, the last included: when memory grew, and whether it followed load (new prompt
    shapes, queueing) or stayed flat after the warm-up (stock vLLM on the H200: flat)."""
    step = max(1, -(-len(samples) // points))
    chosen = samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else [])
    return [
        {
            "t_s": round(x.t - t0, 1),
            "gpu_mib": round(x.gpu_bytes / 2**20) if x.gpu_bytes else None,
            "rss_mib": round(x.rss_bytes / 2**20) if x.rss_bytes else None,
            "kv_usage": x.kv_usage,
            "running": x.running,
            "waiting": x.waiting,
        }
        for x in chosen
    ]


def print_summary(s: dict) -> None:
    print(
        f"load_serve: {s['requests']} requests from {s['clients']} clients in {s['load_s']} s against "
        f"{s['model']!r} (max_model_len {s['max_model_len']})"
    )
    for kind, k in s["by_kind"].items():
        print(
            f"  {kind:24} sent {k['sent']:6}  ok {k['ok']:6}  HTTP 200 {k['http_200']:6}  4xx {k['http_4xx']:6}"
            f"  4xx in a 200 stream {k['in_stream_4xx']:4}"
        )
    fmt = lambda v, f="{:.3f}": "n/a" if v is None else f.format(v)  # noqa: E731
    print(
        f"  throughput {fmt(s['throughput_tok_s'], '{:.1f}')} generated tok/s; TTFT p50 {fmt(s['ttft_p50_s'])} s, "
        f"p99 {fmt(s['ttft_p99_s'])} s"
    )
    kv = s["kv_usage"]
    print(
        f"  KV usage start {kv['start']} peak {kv['peak']} after {kv['after']} end {kv['end']}; max waiting "
        f"{s['max_waiting']}; preemptions {s['preemptions']}"
    )
    print(
        f"  server RSS MiB {s['rss_mib']} (growth after warm-up {s['rss_growth_mib']}); GPU MiB {s['gpu_mib']} "
        f"(growth {s['gpu_growth_mib']}); final burst {s['final_burst_ok']} ok; /health {s['health']}"
    )
    timeline = s.get("memory_timeline") or []
    if any(x["gpu_mib"] for x in timeline):
        print("  GPU MiB over time: " + ", ".join(f"{x['t_s']:.0f}s {x['gpu_mib']}" for x in timeline))
    for f in s["failures"]:
        print(f"  FAIL {f}")
    print("load_serve: " + ("all invariants hold" if s["ok"] else f"{len(s['failures'])} invariant(s) failed"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="load_serve", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1", help="loopback only: 127.0.0.1, ::1 or localhost")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="served model name (default: the server's only one)")
    p.add_argument("--max-model-len", type=int, default=0, help="default: what /v1/models says")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=180.0, help="seconds of new requests (then in-flight finish)")
    p.add_argument("--max-requests", type=int, default=5000)
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=30000)
    p.add_argument("--max-tokens", type=int, default=64, help="each valid request asks for 1..this many tokens")
    p.add_argument(
        "--token-range",
        type=int,
        nargs=2,
        default=[3, 500],
        metavar=("LO", "HI"),
        help="prompt token ids are drawn from [LO, HI) (inside any vocabulary we serve)",
    )
    p.add_argument("--disconnect-frac", type=float, default=0.25)
    p.add_argument("--bad-frac", type=float, default=0.15)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--warmup", type=float, default=20.0, help="seconds before the memory baseline is taken")
    p.add_argument("--settle", type=float, default=60.0, help="seconds to wait for the server to go idle")
    p.add_argument("--sample-every", type=float, default=2.0)
    p.add_argument("--server-pid", type=int, default=None, help="vllm serve's pid: memory of its process tree")
    p.add_argument("--rss-tolerance", type=float, default=0.15, help="allowed RSS growth, fraction of the warm value")
    p.add_argument("--rss-tolerance-mib", type=float, default=256.0, help="... or this many MiB, the larger")
    p.add_argument("--expect-preemption", action="store_true", help="fail unless vLLM preempted at least once")
    p.add_argument("--expect-queueing", action="store_true", help="fail unless requests waited in vLLM's queue")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--keep-outcomes", action="store_true", help="include every request's outcome in the JSON")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Hard limits: the run is bounded in clients, time and requests."""
    for name, value, lo, hi in (
        ("--clients", args.clients, 1, MAX_CLIENTS),
        ("--duration", args.duration, 1, MAX_DURATION_S),
        ("--max-requests", args.max_requests, 1, MAX_REQUESTS),
        ("--request-timeout", args.request_timeout, 1, MAX_DURATION_S),
        ("--min-prompt", args.min_prompt, 1, 10**7),
        ("--max-tokens", args.max_tokens, 1, 10**6),
        ("--settle", args.settle, 0, 3600),
    ):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and lo <= value <= hi):
            raise SystemExit(f"load_serve: {name}: expected a number in [{lo}, {hi}], got {value}")
    if args.max_prompt < args.min_prompt:
        raise SystemExit(f"load_serve: --max-prompt {args.max_prompt} < --min-prompt {args.min_prompt}")
    for name in ("disconnect_frac", "bad_frac"):
        if not 0 <= getattr(args, name) <= 1:
            raise SystemExit(f"load_serve: --{name.replace('_', '-')}: expected a fraction in [0, 1]")
    lo, hi = args.token_range
    if not 0 <= lo < hi:
        raise SystemExit(f"load_serve: --token-range: expected 0 <= LO < HI, got {lo} {hi}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        summary = run(args)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 2
        raise
    print_summary(summary)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
