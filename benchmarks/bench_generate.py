"""transformers on the GPU: greedy decode ms/token with TurboQuantCache vs DynamicCache (SDPA), same model, same run.

    python benchmarks/bench_generate.py [--layers 8] [--prompts 16384,65536] [--new-tokens 128] [--json out.json]

The model is Llama-3.1-8B-shaped (hidden 4096, 32/8 heads, head dim 128, MLP 14336, vocab 128256) with random
fp16 weights and ``--layers`` layers (no hub). Both caches are filled by the same chunked prefill (4096 tokens
per forward), then ``--new-tokens`` greedy steps are timed one forward at a time (what ``generate`` does per
token), the first 8 steps excluded (kernel compilation). Reported: ms/token, KV bytes held, peak device memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jetson_tq.config import DEFAULT_PRESET

WARMUP_STEPS = 8
PREFILL_CHUNK = 4096


def llama8b_shaped(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        torch_dtype=torch.float16,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).half().eval()
    return model


def kv_bytes(cache) -> int:
    if hasattr(cache, "used_bytes"):
        return int(cache.used_bytes())
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@torch.inference_mode()
def run(model, cache, prompt: torch.Tensor, new_tokens: int) -> dict:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(0, prompt.shape[1], PREFILL_CHUNK):
        out = model(prompt[:, i : i + PREFILL_CHUNK], past_key_values=cache, use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    tokens, t_start = [], None
    for step in range(new_tokens):
        if step == WARMUP_STEPS:
            torch.cuda.synchronize()
            t_start = time.perf_counter()
        out = model(nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(nxt[0, 0]) if step < 16 else 0)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t_start) / (new_tokens - WARMUP_STEPS) * 1e3
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:  # one more step, for the record
        model(nxt, past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
    top = prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60)
    print(f"---- one decode step, {type(cache).__name__}, {prompt.shape[1]} tokens\n{top}", flush=True)
    return {
        "prefill_s": prefill_s,
        "ms_per_token": ms,
        "kv_bytes": kv_bytes(cache),
        "peak_bytes": torch.cuda.max_memory_allocated(),
        "first_tokens": tokens[:16],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompts", default="16384,65536")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--config", default=DEFAULT_PRESET)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from transformers import DynamicCache

    from jetson_tq.integrations.transformers import TurboQuantCache

    model = llama8b_shaped(args.layers)
    print(
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, Llama-3.1-8B-shaped x {args.layers} layers, "
        f"fp16, random weights, cache {args.config}",
        flush=True,
    )
    rows = []
    for n in (int(x) for x in args.prompts.split(",")):
        prompt = torch.randint(0, 128256, (1, n), device="cuda")
        dyn = run(model, DynamicCache(config=model.config), prompt, args.new_tokens)
        torch.cuda.empty_cache()
        tq = run(model, TurboQuantCache(model, args.config), prompt, args.new_tokens)
        torch.cuda.empty_cache()
        r = {
            "prompt": n,
            "dynamic": dyn,
            "turboquant": tq,
            "ms_ratio": tq["ms_per_token"] / dyn["ms_per_token"],
            "kv_ratio": dyn["kv_bytes"] / tq["kv_bytes"],
        }
        rows.append(r)
        print(json.dumps(r), flush=True)
        print(
            f"prompt {n}: DynamicCache {dyn['ms_per_token']:.2f} ms/token, TurboQuantCache {tq['ms_per_token']:.2f} "
            f"ms/token ({r['ms_ratio']:.2f}x), KV {dyn['kv_bytes'] / 2**20:.0f} vs {tq['kv_bytes'] / 2**20:.0f} MiB "
            f"({r['kv_ratio']:.2f}x less), peak {dyn['peak_bytes'] / 2**30:.1f} vs {tq['peak_bytes'] / 2**30:.1f} GiB",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
