"""One vLLM engine in one process: capacity, timed workloads and/or a greedy correctness run -> JSON lines.

    python benchmarks/vllm_gpu/job.py '<spec json>'

Prints ``RESULT {json}`` lines (the driver collects them). The engine runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the CUDA-graph counters below see the worker. Spec keys:
name, model (a directory with config.json), tq_config (JETSON_TQ_CONFIG or null), kv_cache_dtype,
backend (attention backend name or null), gpu_util, max_model_len, max_num_seqs, max_num_batched_tokens,
eager, workloads ([[context, concurrency, output_tokens], ...]; concurrency 0 = the most the cache admits,
output_tokens -1 = enough to keep every request decoding together: ``resolve_workload``), correctness ({requests, seed,
blocks_override} or null), env (extra environment), serve ({port} or null: run `vllm serve` instead), deadline (epoch
seconds: workloads that would start later are skipped).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections import Counter

SPEC: dict = json.loads(sys.argv[1]) if __name__ == "__main__" else {}
if __name__ == "__main__":
    if SPEC.get("tq_config"):
        os.environ["JETSON_TQ_CONFIG"] = SPEC["tq_config"]
    else:
        os.environ.pop("JETSON_TQ_CONFIG", None)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # the bundle has no flashinfer (H200 call 3)
    os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")  # bf16 models: nothing to warm, skip the JIT probe
    os.environ.update(SPEC.get("env", {}))

T_START = time.time()


def emit(kind: str, **fields) -> None:
    """One machine-readable result line."""
    rec = {"job": SPEC["name"], "kind": kind, **fields}
    print("RESULT " + json.dumps(rec), flush=True)


class _Grab(logging.Handler):
    """Keeps vLLM's capacity log lines ("GPU KV cache size", "Maximum concurrency", jetson-tq's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "KV cache size" in msg or "Maximum concurrency" in msg or "jetson-tq" in msg or "cudagraph" in msg.lower():
            self.lines.append(msg)


GRAPH = Counter()


def _count_graphs() -> None:
    """Count model calls that ran inside a CUDA graph (capture or replay) vs eagerly."""
    from vllm.compilation import cuda_graph
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available

    cls = cuda_graph.CUDAGraphWrapper
    original = cls.__call__

    def __call__(self, *args, **kwargs):
        if is_forward_context_available():
            ctx = get_forward_context()
            mode = ctx.cudagraph_runtime_mode
            graphed = mode != CUDAGraphMode.NONE and mode == self.runtime_mode
            GRAPH["graph" if graphed else "eager"] += 1
        return original(self, *args, **kwargs)

    cls.__call__ = __call__


def _count_attention_calls() -> None:
    """Count Python-level attention forward calls (zero during a replayed full CUDA graph)."""
    from vllm.model_executor.layers.attention.attention import Attention

    original = Attention.forward

    def forward(self, *args, **kwargs):
        GRAPH["attn_py"] += 1
        return original(self, *args, **kwargs)

    Attention.forward = forward


def build_llm():
    """The engine of this spec (stock, vLLM's TurboQuant or jetson-tq) with the shared settings."""
    from vllm import LLM

    kw = dict(
        model=SPEC["model"],
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=SPEC["max_model_len"],
        gpu_memory_utilization=SPEC["gpu_util"],
        max_num_seqs=SPEC["max_num_seqs"],
        max_num_batched_tokens=SPEC["max_num_batched_tokens"],
        enable_prefix_caching=False,
        enforce_eager=bool(SPEC.get("eager")),
        seed=0,
        kv_cache_dtype=SPEC.get("kv_cache_dtype") or "auto",
        # no Inductor (engine start in seconds) but full CUDA graphs for decode batches; native
        # PyTorch for vLLM's custom ops, whose C++ library is not in the bundle (see docs/vllm.md)
        compilation_config={
            "mode": 0,
            "cudagraph_mode": "FULL_DECODE_ONLY",
            "custom_ops": ["none"],
            "cudagraph_capture_sizes": SPEC.get("capture_sizes", [1, 2, 4, 8, 16, 32]),
        },
        ir_op_priority={"rms_norm": ["native"], "fused_add_rms_norm": ["native"]},
    )
    if SPEC.get("backend"):
        kw["attention_config"] = {"backend": SPEC["backend"]}
    if SPEC.get("blocks_override"):
        kw["num_gpu_blocks_override"] = SPEC["blocks_override"]
    if SPEC.get("correctness"):
        kw["disable_log_stats"] = False  # vLLM's counters say whether the budget forced preemption
    kw.update(SPEC.get("extra", {}))
    return LLM(**kw)


def capacity(llm, grab: _Grab, init_s: float) -> dict:
    """vLLM's own KV capacity figures after init."""
    cc = llm.llm_engine.vllm_config.cache_config
    blocks, bs = cc.num_gpu_blocks, cc.block_size
    rec = {
        "num_gpu_blocks": blocks,
        "block_size": bs,
        "kv_tokens": (blocks or 0) * bs,
        "init_s": round(init_s, 1),
        "log": [line for line in grab.lines if "KV cache size" in line or "concurrency" in line or "jetson-tq" in line],
    }
    for line in grab.lines:
        if "GPU KV cache size" in line:
            rec["logged_kv_tokens"] = int(line.split(":")[1].split("tokens")[0].replace(",", "").strip())
    cm = llm.llm_engine.vllm_config.compilation_config
    rec["cudagraph_mode"] = str(cm.cudagraph_mode)
    rec["compile_mode"] = str(cm.mode)
    return rec


def admitted(kv_tokens: int, block_size: int, ctx: int, out: int) -> int:
    """Requests of ctx + out tokens whose blocks fit in the cache at once."""
    per = math.ceil((ctx + out) / block_size) * block_size
    return kv_tokens // per


def steady_outputs(ctx: int, conc: int, batched: int = 16384, decode_steps: int = 32) -> int:
    """Output tokens per request so that all ``conc`` requests still decode together for ``decode_steps`` steps:
    a request that finished prefill early emits one token per engine step while the others prefill."""
    return -(-ctx * conc // batched) + decode_steps


def resolve_workload(ctx: int, conc: int, out: int, kv: int, block_size: int, seqs: int) -> tuple[int, int]:
    """``conc`` 0 = as many requests as the cache admits at once (at most ``seqs``); ``out`` < 0 = steady_outputs."""
    if conc == 0:
        conc = next((c for c in range(seqs, 0, -1) if admitted(kv, block_size, ctx, steady_outputs(ctx, c)) >= c), 1)
    return conc, steady_outputs(ctx, conc) if out < 0 else out


def run_workload(llm, ctx: int, conc: int, out: int, seed: int) -> dict:
    """conc requests of ctx random prompt tokens, out greedy tokens each; TTFT, decode window, graph use."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = llm.llm_engine
    rng = np.random.default_rng(seed)
    vocab = SPEC.get("vocab", 32000)
    sp = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    for i in range(conc):
        ids = rng.integers(100, vocab, size=ctx).tolist()
        eng.add_request(f"w{ctx}_{conc}_{i}", TokensPrompt(prompt_token_ids=ids), sp)
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    count: dict[str, int] = {}
    steps: list[tuple[float, int, int, int]] = []  # (time, total tokens, graph calls, eager calls)
    while eng.has_unfinished_requests():
        outs = eng.step()
        t = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids)
            count[o.request_id] = n
            if n > 0 and o.request_id not in first:
                first[o.request_id] = t
            if n >= out and o.request_id not in done:
                done[o.request_id] = t
        steps.append((t, sum(count.values()), GRAPH["graph"], GRAPH["eager"], GRAPH["attn_py"]))
    t_end = time.perf_counter()
    all_first = max(first.values())
    # the window in which every request decodes: from the last first token to the step before the first request
    # finishes (H200 call 6 timed to the end instead, and its 32 x 32k window held ~8 rows: a tail, not 32-way)
    first_done = min(done.values())
    window = [s for s in steps if all_first <= s[0] < first_done] or [s for s in steps if s[0] >= all_first]
    w0, w1 = window[0], window[-1]
    dt = w1[0] - w0[0]
    nsteps = len(window) - 1
    toks = w1[1] - w0[1]
    ttft = sorted(v - t0 for v in first.values())
    marks = [t0] + [s[0] for s in steps[:6]]  # the first six steps' ends: their durations show one-time costs
    return {
        "context": ctx,
        "concurrency": conc,
        "output_tokens": out,
        "wall_s": round(t_end - t0, 3),
        "ttft_first_s": round(ttft[0], 4),
        "ttft_last_s": round(ttft[-1], 4),
        "first_steps_s": [round(b - a, 4) for a, b in zip(marks, marks[1:])],
        "decode_steps": nsteps,
        "decode_tokens": toks,
        "rows": round(toks / nsteps, 2) if nsteps else None,
        "tpot_ms": round(1000 * dt / nsteps, 3) if nsteps else None,
        "decode_tok_s": round(toks / dt, 1) if dt > 0 else None,
        "graph_calls": w1[2] - w0[2],
        "eager_calls": w1[3] - w0[3],
        "attn_python_calls": w1[4] - w0[4],
    }


def correctness(llm, spec: dict) -> dict:
    """Greedy ids + sampled-token logprobs of ragged requests (NaN-free check); ids go to the driver."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(spec.get("seed", 1))
    lens = rng.integers(spec.get("min_len", 20), spec.get("max_len", 3000), size=spec["requests"]).tolist()
    outs_n = rng.integers(8, spec.get("max_out", 48), size=spec["requests"]).tolist()
    prompts = [
        TokensPrompt(prompt_token_ids=rng.integers(100, SPEC.get("vocab", 32000), size=n).tolist()) for n in lens
    ]
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=1) for m in outs_n
    ]
    t0 = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    ids, lps, bad = [], [], 0
    for r in res:
        c = r.outputs[0]
        ids.append(list(c.token_ids))
        lps.append([round(step[tok].logprob, 5) for step, tok in zip(c.logprobs or [], c.token_ids)])
        bad += sum(not math.isfinite(v) for v in lps[-1])
    from lab.vllm_compare import engine_counters

    return {
        "requests": len(res),
        "prompt_lens": lens,
        "ids": ids,
        "logprobs": lps,
        "nonfinite_logprobs": bad,
        "preemptions": engine_counters(llm, ("vllm:num_preemptions",))["vllm:num_preemptions"],
        "wall_s": round(wall, 2),
        "sampled_logprob_mean": float(
            np.mean([r.outputs[0].logprobs[j][t].logprob for r in res for j, t in enumerate(r.outputs[0].token_ids)])
        ),
    }


def serve(spec: dict) -> dict:
    """``vllm serve`` (OpenAI server, engine core in its own process) + one streaming completions request."""
    import subprocess
    import urllib.request

    port = int(spec.get("port", 8123))
    args = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        SPEC["model"],
        "--port",
        str(port),
        "--load-format",
        "dummy",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(SPEC["max_model_len"]),
        "--gpu-memory-utilization",
        str(SPEC["gpu_util"]),
        "--max-num-seqs",
        str(SPEC["max_num_seqs"]),
        "--no-enable-prefix-caching",
        "--served-model-name",
        "m",
        "--compilation-config",
        json.dumps(
            {
                "mode": 0,
                "cudagraph_mode": "FULL_DECODE_ONLY",
                "custom_ops": ["none"],
                "cudagraph_capture_sizes": [1, 2, 4, 8],
            }
        ),
        "--ir-op-priority",
        json.dumps({"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}),
    ]
    if SPEC.get("backend"):
        args += ["--attention-backend", SPEC["backend"]]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    t0 = time.time()
    proc = subprocess.Popen(args, env=env, stdout=sys.stdout, stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None:
                return {"ok": False, "why": f"server exited with {proc.returncode}"}
            if time.time() - t0 > spec.get("start_timeout_s", 150):
                return {"ok": False, "why": "server did not become healthy in time"}
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        up = time.time() - t0
        body = json.dumps(
            {"model": "m", "prompt": "the cat sat on the mat and", "max_tokens": 16, "temperature": 0, "stream": True}
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        chunks, text, t1 = 0, "", time.time()
        with urllib.request.urlopen(req, timeout=60) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks += 1
                    text += json.loads(line[6:])["choices"][0].get("text", "")
        return {
            "ok": chunks > 1,
            "startup_s": round(up, 1),
            "stream_chunks": chunks,
            "text": text,
            "request_s": round(time.time() - t1, 3),
        }
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    if SPEC.get("serve"):
        emit("serve", **serve(SPEC["serve"]))
        return
    import vllm.logger  # noqa: F401 - configures vLLM's loggers first (it would drop a handler added before)

    grab = _Grab()
    logging.getLogger("vllm").addHandler(grab)
    _count_graphs()
    _count_attention_calls()
    t = time.time()
    try:
        llm = build_llm()
    except Exception as e:
        import traceback

        traceback.print_exc()
        emit("error", stage="init", error=f"{type(e).__name__}: {e}"[:2000])
        return
    cap = capacity(llm, grab, time.time() - t)
    emit("capacity", **cap, import_and_init_s=round(time.time() - T_START, 1))
    if SPEC.get("tq_config") and not any("jetson-tq: TurboQuant KV cache" in line for line in grab.lines):
        # without the entry point vLLM silently runs stock attention: no figure of this job would be ours
        emit("error", stage="plugin", error="JETSON_TQ_CONFIG set but the jetson-tq plugin did not register")
        return
    kv, bs = cap["kv_tokens"], cap["block_size"]
    for ctx, conc, out in SPEC.get("workloads", []):
        conc, out = resolve_workload(ctx, conc, out, kv, bs, SPEC["max_num_seqs"])
        fits = admitted(kv, bs, ctx, out)
        left = SPEC.get("deadline", 1e18) - time.time()
        if conc > fits:
            emit("workload", context=ctx, concurrency=conc, skipped=f"not admitted: {fits} fit at once")
            continue
        if left < SPEC.get("min_left_s", 20):
            emit("workload", context=ctx, concurrency=conc, skipped=f"deadline ({left:.0f} s left)")
            continue
        try:
            emit("workload", **run_workload(llm, ctx, conc, out, seed=ctx + conc), admitted_at_once=fits)
        except Exception as e:
            import traceback

            traceback.print_exc()
            emit("error", stage=f"workload {ctx}x{conc}", error=f"{type(e).__name__}: {e}"[:2000])
            return
    if SPEC.get("correctness"):
        try:
            emit("correctness", **correctness(llm, SPEC["correctness"]))
        except Exception as e:
            import traceback

            traceback.print_exc()
            emit("error", stage="correctness", error=f"{type(e).__name__}: {e}"[:2000])
    emit("done", total_s=round(time.time() - T_START, 1), graph_counts=dict(GRAPH))


if __name__ == "__main__":
    main()
