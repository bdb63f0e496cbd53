"""The vLLM-on-GPU measurements in one command: one subprocess (one engine) per configuration.

    python benchmarks/vllm_gpu/run.py --out DIR [--plan full|short|agg|corr|smoke|ttft|fa3|peers] [--budget S]
        [--only A,B] [--rows '[[8192, 8, -1]]']

Writes DIR/results.jsonl (every ``RESULT`` line of every job), DIR/raw.log (all engine logs, in
order) and DIR/summary.json (the tables + the greedy comparison). Jobs run in priority order; one
that would start after ``--budget`` seconds is skipped (reported), and each job's workloads stop at
the budget too, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from job import steady_outputs  # noqa: E402
from models import kv_bytes_per_token, write_model_dir, write_tokenizer  # noqa: E402

QWEN, LLAMA = "qwen2.5-7b", "llama-3.1-8b"
UTIL = 0.25  # equal memory for every engine: ~16 GB of KV for Qwen2.5-7B on a 141 GB H200 (~8 x 32k stock)
#: --plan peers: every engine gets this much GPU memory whatever the card (0.55 of an 80 GB H100: Qwen2.5-7B's
#: 15.2 GB of weights plus ~28 GB of KV), so an H100 and an H200 run the same budget
PEERS_GIB = 43.8
PEERS_MML = 40960  # 32k prompts plus outputs; 131072 leaves stock too few blocks at this budget
#: --plan peers rows: 16 x 16k (TPOT, TTFT of the last request, decode tok/s), then 32k at the most each cache admits
PEERS_WORK = [[16384, 16, -1], [32768, 0, -1]]
#: the targets of the peers table: ours vs the stock KV cache users pick (fp8) and vs stock bf16 FlashAttention 3
PEERS_TARGETS = {"capacity_x_fp8": 2.0, "tpot_x_fp8": 1.0, "ttft_x_bf16": 1.0}
MML = 131072
WORK_EAGER = [[8192, 8, 32], [32768, 8, 32]]

#: every engine on vLLM's V1 model runner unless a job says otherwise: jetson-tq pins it (its hooks are
#: written against V1's GPUModelRunner) and 0.26 would pick V2 for stock dense models on CUDA
V1 = {"VLLM_USE_V2_MODEL_RUNNER": "0"}


WORK_STOCK = [
    [c, n, max(64, steady_outputs(c, n))]
    for c, n in [(8192, 1), (8192, 8), (8192, 32), (32768, 1), (32768, 8), (130944, 1)]
]
WORK_TQ = WORK_STOCK[:5] + [[32768, 32, steady_outputs(32768, 32)], WORK_STOCK[5]]


def _engine(
    name: str,
    model: str,
    *,
    tq: str | None = None,
    kv: str = "auto",
    backend: str | None = None,
    mml: int = MML,
    seqs: int = 32,
    work=(),
    eager: bool = False,
    timeout: int = 240,
    env=None,
    **extra,
) -> dict:
    return {
        "name": name,
        "model_name": model,
        "tq_config": tq,
        "kv_cache_dtype": kv,
        "backend": backend,
        "gpu_util": UTIL,
        "max_model_len": mml,
        "max_num_seqs": seqs,
        "max_num_batched_tokens": 16384,
        "eager": eager,
        "workloads": [list(w) for w in work],
        "timeout": timeout,
        "env": dict(V1 if env is None else env),
        **extra,
    }


#: --plan fa3's rows (context, concurrency, outputs < 0: every request decodes together); 8k first = engine's first
FA3_ROWS = [[8192, 8, -1], [32768, 8, -1], [32768, 32, -1]]
FA3_UTIL = 0.7  # ~80 GB of KV for stock bf16: 32 x 32k plus outputs fit (57 kB/token)
FA3_TTFT, FA3_TPOT = 1.1, 1.0  # issue 23: ours / stock FA3 at most


def card_util(gib: float = PEERS_GIB) -> float:
    """``gpu_memory_utilization`` that gives ``gib`` GiB on this machine's first GPU (read with nvidia-smi, so the
    driver process holds no CUDA context); 0.55 where no GPU answers (the H100 figure)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        total_gib = float(out.split()[0]) / 1024
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0.55
    return round(min(0.92, gib / total_gib), 4)


def peers_plan() -> list[dict]:
    """The KV caches a user would pick instead of ours, at the same memory, most important first: stock FlashAttention
    3 in fp8 (the common choice) and bf16, vLLM's ``int4_per_token_head`` (Triton backend) and vLLM's own TurboQuant
    (it starts on vLLM's V2 runner only)."""
    common = dict(work=PEERS_WORK, seqs=64, mml=PEERS_MML, gpu_util=card_util(), capture_sizes=[1, 8, 16, 32, 48, 64])
    return [
        _engine("peer_ours_mse_k4v3", QWEN, tq="mse_k4v3", timeout=330, **common),
        _engine("peer_fa3_fp8", QWEN, backend="FLASH_ATTN_FIXED", kv="fp8", timeout=240, **common),
        _engine("peer_fa3_bf16", QWEN, backend="FLASH_ATTN_FIXED", timeout=240, **common),
        _engine(
            "peer_int4_per_token_head",
            QWEN,
            backend="TRITON_ATTN_FIXED",
            kv="int4_per_token_head",
            timeout=300,
            **common,
        ),
        _engine("peer_vllm_tq_4bit_nc", QWEN, kv="turboquant_4bit_nc", env={}, timeout=300, **common),
    ]


def plan(kind: str) -> list[dict]:
    """The jobs, most important first."""
    if kind == "peers":
        return peers_plan()
    small = dict(mml=4096, seqs=8, timeout=150)
    smoke = [
        _engine("smoke_stock", QWEN, backend="TRITON_ATTN", work=[[2048, 2, 16]], **small),
        _engine("smoke_ours", QWEN, tq="mse_k4v3", work=[[2048, 2, 16]], **small),
    ]
    if kind == "smoke":
        return smoke
    if kind == "ttft":  # issue 23: the engine's first 8k request vs the next ones of the same shape (warm-up coverage)
        work = [[8192, 1, 8]] * 3  # prefix caching is off: each request prefills all 8k tokens
        return [
            _engine("ttft_ours_mse_k4v3", QWEN, tq="mse_k4v3", work=work, mml=16384, seqs=32, timeout=140),
            _engine(  # chunked: 2048-token steps over compressed history, a partial last chunk
                "ttft_ours_mse_k4v3_chunk2048",
                QWEN,
                tq="mse_k4v3",
                work=[[8191, 1, 8]] * 3,
                mml=16384,
                seqs=32,
                max_num_batched_tokens=2048,
                timeout=140,
            ),
            _engine("ttft_stock_fa3", QWEN, backend="FLASH_ATTN_FIXED", work=work, mml=16384, seqs=32, timeout=100),
        ]
    if kind == "fa3":  # TTFT and TPOT against stock on FlashAttention 3, the engine's first request included
        big = dict(gpu_util=FA3_UTIL, seqs=32, capture_sizes=[1, 8, 16, 32])  # stock must hold 32 x 32k too
        variants = {  # ours with its prefill moved: the Triton loop everywhere (the control), FlashAttention for
            # every row below the 8k rule too (where the crossover lies)
            "fa3_ours_mse_k4v3_triton_prefill": {"JETSON_TQ_FLASH_PREFILL": "0"},
            "fa3_ours_mse_k4v3_flash_all": {"JETSON_TQ_FLASH_MIN_TOKENS": "0"},
        }
        return [
            _engine("fa3_ours_mse_k4v3", QWEN, tq="mse_k4v3", work=FA3_ROWS, timeout=330, **big),
            _engine("fa3_stock", QWEN, backend="FLASH_ATTN_FIXED", work=FA3_ROWS, timeout=200, **big),
            *(
                _engine(name, QWEN, tq="mse_k4v3", work=FA3_ROWS, timeout=330, env=dict(V1, **moved), **big)
                for name, moved in variants.items()
            ),
        ]
    corr = {"requests": 24, "seed": 1, "min_len": 20, "max_len": 3000, "max_out": 48}
    corr_jobs = [  # the default preset under forced preemption; greedy ids of the fp16 preset (every layer on
        # stock attention: bitwise stock) vs stock (eager)
        # 48 blocks of the default's 128 tokens = 6,144 tokens for 10 requests of 2-4k prompt tokens decoding up to
        # 200 each: about two fit, and a running request that crosses into a new block must preempt the newest
        # (call A, 2026-12-01: 128 blocks for 24 requests of 20-3,000 tokens decoding <= 48 never preempted)
        _engine(
            "corr_ours_k4v3_preempt",
            QWEN,
            tq="mse_k4v3",
            mml=4096,
            seqs=32,
            eager=True,
            blocks_override=48,
            correctness=dict(corr, requests=10, min_len=2000, max_len=3900, max_out=200),
            timeout=200,
        ),  # cold imports + warm-up compiles: > 110 s in H200 calls 10, 11
        _engine("corr_stock", QWEN, backend="TRITON_ATTN", mml=4096, seqs=32, correctness=corr, eager=True, timeout=80),
        _engine("corr_ours_fp16", QWEN, tq="fp16", mml=4096, seqs=32, correctness=corr, eager=True, timeout=60),
    ]
    if kind == "corr":
        return corr_jobs
    if kind == "agg":  # the 32k aggregate at each cache's largest admitted concurrency; 32k TTFT (first workload)
        few = dict(capture_sizes=[1, 8, 16, 32, 48])
        work = [[32768, 1, 32], [32768, 0, -1]]
        return [  # ours first: its 40 x 32k prefill is the long job; stock's ~90 s fit what is left
            _engine("ours_mse_k4v3", QWEN, tq="mse_k4v3", work=work, seqs=48, timeout=340, **few),
            _engine("stock_bf16", QWEN, backend="TRITON_ATTN", work=work, seqs=48, timeout=150, **few),
        ]
    if kind == "short":  # one call of ~9 device minutes: the headline rows first, each job time-capped
        cap_only = dict(eager=True, seqs=8, timeout=50)
        few = dict(capture_sizes=[1, 8, 32])  # graph sizes of the rows below only (capture time)
        rows = [[8192, 8, steady_outputs(8192, 8)], [32768, 1, 32], [32768, 8, steady_outputs(32768, 8)]]
        return [
            _engine("stock_bf16", QWEN, backend="TRITON_ATTN", work=rows, timeout=160, **few),
            _engine(
                "ours_mse_k4v3",
                QWEN,
                tq="mse_k4v3",
                work=rows + [[32768, 32, steady_outputs(32768, 32)]],
                timeout=230,
                **few,
            ),
            _engine(
                "vllm_tq_4bit_nc", QWEN, kv="turboquant_4bit_nc", work=rows[:1] + rows[2:], timeout=120, env={}, **few
            ),  # vLLM's own runner choice (V2): under V1 its TurboQuant fails in graph-memory profiling
            _engine("ours_blog_k3v2", QWEN, tq="blog_k3v2", **cap_only),
            _engine("vllm_tq_3bit_nc", QWEN, kv="turboquant_3bit_nc", env={}, **cap_only),  # V2, as the 4-bit one
        ]
    cap_only = dict(eager=True, seqs=8, timeout=45)
    return [
        _engine("stock_bf16", QWEN, backend="TRITON_ATTN", work=WORK_STOCK, timeout=150),
        _engine("ours_mse_k4v3", QWEN, tq="mse_k4v3", work=WORK_TQ, timeout=200),
        _engine("vllm_tq_4bit_nc", QWEN, kv="turboquant_4bit_nc", work=WORK_TQ, timeout=120),
        _engine("ours_blog_k3v2", QWEN, tq="blog_k3v2", work=[[32768, 8, 64], [32768, 32, 64]], timeout=80),
        _engine(
            "stock_fa3",
            QWEN,
            backend="FLASH_ATTN_FIXED",
            work=[[32768, 8, 64], [32768, 1, 64], [8192, 8, 64]],
            timeout=80,
        ),
        _engine(
            "stock_bf16_runner_v2",
            QWEN,
            backend="TRITON_ATTN",
            work=[[32768, 8, 64], [8192, 8, 64]],
            env={},
            timeout=80,
        ),
        _engine("vllm_tq_3bit_nc", QWEN, kv="turboquant_3bit_nc", **cap_only),
        *corr_jobs,
        # Llama-3.1-8B capacity at 32k (131 kB/token stock: 128k does not fit this budget in bf16)
        _engine("llama_stock", LLAMA, backend="TRITON_ATTN", mml=32768, **cap_only),
        _engine("llama_ours_mse_k4v3", LLAMA, tq="mse_k4v3", mml=32768, **cap_only),
        _engine("llama_ours_blog_k3v2", LLAMA, tq="blog_k3v2", mml=32768, **cap_only),
        _engine("llama_vllm_tq_4bit_nc", LLAMA, kv="turboquant_4bit_nc", mml=32768, **cap_only),
        _engine("llama_vllm_tq_3bit_nc", LLAMA, kv="turboquant_3bit_nc", mml=32768, **cap_only),
        _engine(
            "serve_ours_mse_k4v3",
            QWEN,
            tq="mse_k4v3",
            mml=4096,
            seqs=8,
            serve={"port": 8123},
            tokenizer=True,
            timeout=170,
        ),
        _engine("eager_stock", QWEN, backend="TRITON_ATTN", work=WORK_EAGER, eager=True, mml=40000, timeout=70),
        _engine("eager_ours_mse_k4v3", QWEN, tq="mse_k4v3", work=WORK_EAGER, eager=True, mml=40000, timeout=70),
    ]


def fa3_present() -> bool:
    """True when the bundle's optional FA3 part is unpacked (found without importing vLLM)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    roots = list(spec.submodule_search_locations or []) if spec else []
    return any((Path(r) / "vllm_flash_attn" / "_vllm_fa3_C.abi3.so").exists() for r in roots)


def adapt(jobs: list[dict], stock_backend: str, fa3: bool) -> list[dict]:
    """Stock jobs on ``stock_backend``; vLLM-TurboQuant jobs marked unrunnable without FA3 (its prefill)."""
    out = []
    for j in jobs:
        j = dict(j)
        if j["backend"] == "TRITON_ATTN":
            j["backend"] = stock_backend
        if j["backend"] == "FLASH_ATTN_FIXED":  # the FA3 row of the full plan, whatever the stock choice
            j["backend"] = "FLASH_ATTN"
        if j["backend"] == "TRITON_ATTN_FIXED":  # a cache only vLLM's Triton backend serves (int4_per_token_head)
            j["backend"] = "TRITON_ATTN"
        if j["kv_cache_dtype"].startswith("turboquant") and not fa3:
            j["unrunnable"] = "vLLM's TurboQuant prefill calls flash_attn_varlen_func: needs the FA3 part"
        if stock_backend == "FLASH_ATTN" and not fa3 and j["backend"] == "FLASH_ATTN":
            j["unrunnable"] = "FLASH_ATTN needs the FA3 part"
        out.append(j)
    return out


def run_job(spec: dict, out: Path, deadline: float) -> list[dict]:
    """Run one job in its own process; its output goes to raw.log, its RESULT lines are returned.

    The job gets its own timeout, cut to what is left of the budget (jobs run in priority order).
    """
    t = time.time()
    timeout = min(spec.pop("timeout"), max(10, deadline - t))
    spec = dict(spec, deadline=t + timeout - 10)  # workloads that would start later are skipped
    results: list[dict] = []
    with open(out / "raw.log", "a") as log:
        log.write(f"\n===== job {spec['name']} {json.dumps(spec)}\n")
        log.flush()
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "job.py"), json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=os.environ.copy(),
        )
        try:
            deadline_job = t + timeout
            for line in proc.stdout:
                log.write(line)
                if line.startswith("RESULT "):
                    rec = json.loads(line[7:])
                    results.append(rec)
                    print(
                        json.dumps(
                            {k: v for k, v in rec.items() if k not in ("ids", "prompt_lens", "log", "logprobs")}
                        ),
                        flush=True,
                    )
                if time.time() > deadline_job:
                    proc.kill()
                    results.append({"job": spec["name"], "kind": "error", "error": f"killed after {timeout:.0f} s"})
                    break
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.write(f"===== job {spec['name']} rc={proc.returncode} {time.time() - t:.1f} s\n")
    if proc.returncode not in (0, None) and not any(r["kind"] == "error" for r in results):
        results.append({"job": spec["name"], "kind": "error", "error": f"exit code {proc.returncode}"})
    return results


def summarize(results: list[dict]) -> dict:
    """Capacity table, workload table and greedy comparisons from the RESULT lines."""
    caps = {r["job"]: r for r in results if r["kind"] == "capacity"}
    summary: dict = {"capacity": {}, "workloads": [], "errors": [r for r in results if r["kind"] == "error"]}
    for job, c in caps.items():
        model = LLAMA if job.startswith("llama") else QWEN
        base = caps.get("llama_stock" if model == LLAMA else "stock_bf16")
        summary["capacity"][job] = {
            "kv_tokens": c["kv_tokens"],
            "num_gpu_blocks": c["num_gpu_blocks"],
            "x_stock": round(c["kv_tokens"] / base["kv_tokens"], 3) if base else None,
            "stock_bytes_per_token": kv_bytes_per_token(model),
        }
    summary["workloads"] = [r for r in results if r["kind"] == "workload"]
    for job in dict.fromkeys(r["job"] for r in summary["workloads"] if "ttft_first_s" in r):
        ttfts = [r["ttft_first_s"] for r in summary["workloads"] if r["job"] == job and "ttft_first_s" in r]
        if job.startswith("ttft_") and len(ttfts) > 1:  # --plan ttft: the first request vs the later ones
            later = min(ttfts[1:])
            summary.setdefault("ttft_first_vs_next", {})[job] = {
                "ttft_s": ttfts,
                "first_over_next": round(ttfts[0] / later, 3) if later > 0 else None,
            }
    corr = {r["job"]: r for r in results if r["kind"] == "correctness"}
    if "corr_stock" in corr:
        ref = corr["corr_stock"]
        for job, c in corr.items():
            first_div, dlp = [], []
            for i, (a, b) in enumerate(zip(ref["ids"], c["ids"])):
                d = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
                first_div.append(d)
                # dummy weights give near-tied logits: the sampled tokens' logprobs over the common prefix
                # say whether a divergence is a flipped tie or a real difference
                la, lb = ref.get("logprobs", [[]] * (i + 1))[i], c.get("logprobs", [[]] * (i + 1))[i]
                n = min(len(a), len(b)) if d is None else d
                dlp += [abs(x - y) for x, y in zip(la[:n], lb[:n])]
            summary[f"greedy_{job}_vs_stock"] = {
                "identical_requests": sum(a == b for a, b in zip(ref["ids"], c["ids"])),
                "of": len(ref["ids"]),
                "first_divergence": first_div,
                "nonfinite_logprobs": c["nonfinite_logprobs"],
                "preemptions": c.get("preemptions"),
                "max_abs_logprob_diff_common_prefix": round(max(dlp), 5) if dlp else None,
            }
    return summary


def _rows(results: list[dict], job: str) -> dict[tuple[int, int], dict]:
    return {
        (r["context"], r["concurrency"]): r
        for r in results
        if r["job"] == job and r["kind"] == "workload" and "skipped" not in r
    }


def targets(
    results: list[dict], ours: str = "ours_mse_k4v3", stock: str = "stock_bf16", theirs: str = "vllm_tq_4bit_nc"
) -> dict:
    """Issue 10's targets, met / missed / not measured, from the RESULT lines."""
    caps = {r["job"]: r["kv_tokens"] for r in results if r["kind"] == "capacity"}
    o, s, t = _rows(results, ours), _rows(results, stock), _rows(results, theirs)
    out: dict = {}

    def verdict(name: str, value, ok) -> None:
        out[name] = {"value": value, "verdict": "not measured" if value is None else ("met" if ok else "missed")}

    cap = caps[ours] / caps[stock] if ours in caps and stock in caps else None
    verdict("capacity_x_stock>=3.9", None if cap is None else round(cap, 3), cap is not None and cap >= 3.9)

    def best32k(rows):
        got = [r["decode_tok_s"] for (ctx, _), r in rows.items() if ctx == 32768 and r.get("decode_tok_s")]
        return max(got) if got else None

    bo, bs = best32k(o), best32k(s)
    agg = bo / bs if bo and bs else None
    verdict("aggregate_32k_x_stock>=2", None if agg is None else round(agg, 3), agg is not None and agg >= 2)
    tpot = {
        f"{c}x{n}": round(o[k]["tpot_ms"] / s[k]["tpot_ms"], 3)
        for k in sorted(o.keys() & s.keys())
        for c, n in [k]
        if o[k].get("tpot_ms") and s[k].get("tpot_ms")
    }
    verdict("tpot_x_stock<=1.3", tpot or None, bool(tpot) and max(tpot.values()) <= 1.3)
    k = (32768, 1)
    ttft = o[k]["ttft_first_s"] / s[k]["ttft_first_s"] if k in o and k in s else None
    verdict("ttft_32k_x_stock<=1.5", None if ttft is None else round(ttft, 3), ttft is not None and ttft <= 1.5)
    vs = {
        f"{c}x{n}": round(o[k]["decode_tok_s"] / t[k]["decode_tok_s"], 3)
        for k in sorted(o.keys() & t.keys())
        for c, n in [k]
        if o[k].get("decode_tok_s") and t[k].get("decode_tok_s")
    }
    verdict("decode_x_vllm_turboquant>1_every_row", vs or None, bool(vs) and min(vs.values()) > 1)
    return out


def fa3_targets(results: list[dict], ours: str = "fa3_ours_mse_k4v3", stock: str = "fa3_stock") -> dict:
    """Issue 23's vLLM rows: per (context, concurrency), ours / stock FA3 for the first and last request's TTFT and
    for TPOT, with met / missed (TTFT <= 1.1x, TPOT <= 1.0x)."""
    o, s = _rows(results, ours), _rows(results, stock)
    out: dict = {}
    for key in sorted(o.keys() & s.keys()):
        row: dict = {}
        for field, limit in (("ttft_first_s", FA3_TTFT), ("ttft_last_s", FA3_TTFT), ("tpot_ms", FA3_TPOT)):
            a, b = o[key].get(field), s[key].get(field)
            x = round(a / b, 3) if a and b else None
            row[field] = {"ours": a, "fa3": b, "x": x, "verdict": "not measured" if x is None else _verdict(x, limit)}
        out[f"{key[0] // 1024}k x {key[1]}"] = row
    return out


def peers_table(results: list[dict], ours: str = "peer_ours_mse_k4v3") -> dict:
    """Per engine of --plan peers: vLLM's KV tokens, 16 x 16k TPOT / TTFT of the last / decode tok/s, the 32k row at
    the most it admits (concurrency, TPOT, tok/s); then ours against the targets (PEERS_TARGETS)."""
    caps = {r["job"]: r["kv_tokens"] for r in results if r["kind"] == "capacity"}
    rows: dict = {}
    for job in dict.fromkeys(r["job"] for r in results if r["job"].startswith("peer_")):
        w = _rows(results, job)
        r16 = w.get((16384, 16), {})
        r32 = next((r for (c, _), r in sorted(w.items()) if c == 32768), {})
        rows[job] = {
            "kv_tokens": caps.get(job),
            "16kx16_tpot_ms": r16.get("tpot_ms"),
            "16kx16_ttft_last_s": r16.get("ttft_last_s"),
            "16kx16_decode_tok_s": r16.get("decode_tok_s"),
            "32k_admitted": r32.get("concurrency"),
            "32k_tpot_ms": r32.get("tpot_ms"),
            "32k_decode_tok_s": r32.get("decode_tok_s"),
        }
        errors = [r["error"] for r in results if r["job"] == job and r["kind"] == "error"]
        if errors:
            rows[job]["error"] = errors[0][:200]
    o, fp8, bf16 = rows.get(ours, {}), rows.get("peer_fa3_fp8", {}), rows.get("peer_fa3_bf16", {})

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    measured = {
        "capacity_x_fp8": ratio(o.get("kv_tokens"), fp8.get("kv_tokens")),
        "tpot_x_fp8": ratio(o.get("16kx16_tpot_ms"), fp8.get("16kx16_tpot_ms")),
        "ttft_x_bf16": ratio(o.get("16kx16_ttft_last_s"), bf16.get("16kx16_ttft_last_s")),
    }
    verdicts = {}
    for name, limit in PEERS_TARGETS.items():
        x = measured[name]
        ok = x is not None and (x >= limit if name.startswith("capacity") else x <= limit)
        verdicts[name] = {"value": x, "target": limit, "verdict": "not measured" if x is None else _met(ok)}
    return {"engines": rows, "targets": verdicts}


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def print_peers(table: dict) -> None:
    """The peers table as text (the last lines of a device call's output)."""
    cols = list(next(iter(table["engines"].values()), {}).keys())
    print("engine".ljust(28) + "".join(c[:22].rjust(23) for c in cols if c != "error"))
    for job, row in table["engines"].items():
        cells = "".join(str(row.get(c)).rjust(23) for c in cols if c != "error")
        print(job.ljust(28) + cells + (f"   error: {row['error']}" if row.get("error") else ""))
    for name, v in table["targets"].items():
        print(f"target {name}: {v['value']} (target {v['target']}) -> {v['verdict']}")


def _verdict(x: float, limit: float) -> str:
    return "met" if x <= limit else "missed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plan", default="full", choices=["full", "short", "agg", "corr", "smoke", "ttft", "fa3", "peers"])
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all jobs")
    ap.add_argument("--only", default="", help="comma-separated job names")
    ap.add_argument(
        "--rows",
        type=json.loads,
        default=None,
        help="JSON [[context, concurrency, outputs], ...]: every job's workloads instead of the plan's "
        "(outputs < 0: every request decodes together); jobs without workloads (capacity or correctness only) "
        "are left out",
    )
    ap.add_argument(
        "--stock-backend",
        default="TRITON_ATTN",
        choices=["TRITON_ATTN", "FLASH_ATTN"],
        help="stock vLLM's attention (FLASH_ATTN = FA3, needs the optional bundle part)",
    )
    args = ap.parse_args()
    start = time.time()
    deadline = start + args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    models = args.out.parent / "models" if os.environ.get("JTQ_MODELS") is None else Path(os.environ["JTQ_MODELS"])
    jobs = adapt(plan(args.plan), args.stock_backend, fa3_present())
    if args.only:
        keep = set(args.only.split(","))
        unknown = keep - {j["name"] for j in jobs}
        if unknown:
            ap.error(f"--only: no job {', '.join(sorted(unknown))} in --plan {args.plan}")
        jobs = [j for j in jobs if j["name"] in keep]
    if args.rows is not None:
        if not (isinstance(args.rows, list) and all(isinstance(r, list) and len(r) == 3 for r in args.rows)):
            ap.error("--rows: expected a JSON list of [context, concurrency, outputs] triples")
        jobs = [dict(j, workloads=[list(map(int, r)) for r in args.rows]) for j in jobs if j["workloads"]]
    results: list[dict] = []
    for i, spec in enumerate(jobs):
        spec = dict(spec, model=str(write_model_dir(spec["model_name"], models)))
        if spec.pop("tokenizer", False):
            spec["model"] = str(write_tokenizer(write_model_dir(spec["model_name"], models / "with_tokenizer")))
        if spec.get("unrunnable"):
            results.append({"job": spec["name"], "kind": "skipped", "why": spec["unrunnable"]})
            print(json.dumps(results[-1]), flush=True)
            continue
        if time.time() > deadline - 30:
            results.append({"job": spec["name"], "kind": "skipped", "why": "budget"})
            print(json.dumps(results[-1]), flush=True)
            continue
        got = run_job(spec, args.out, deadline)
        results.extend(got)
        started = any(r["kind"] == "capacity" for r in results)
        if i == 1 and not started:  # stock and ours both failed at start-up: the rest would fail the same way
            results.append({"job": "all", "kind": "error", "error": "the first two engines did not start: stopping"})
            print(json.dumps(results[-1]), flush=True)
            deadline = 0
        with open(args.out / "results.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
        (args.out / "summary.json").write_text(
            json.dumps(
                dict(
                    summarize(results),
                    targets=targets(results),
                    fa3=fa3_targets(results),
                    fa3_flash_all=fa3_targets(results, ours="fa3_ours_mse_k4v3_flash_all"),
                )
                | {"peers": peers_table(results)},
                indent=1,
            )
        )
    if args.plan == "peers":
        print_peers(peers_table(results))
    print(f"all jobs: {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
