"""Cheap fidelity proxies for the 4-bit key codebook at equal bytes: Lloyd-Max vs a uniform grid.

    python benchmarks/key_codebook_proxy.py [--tokens 1024]

Keys are quantized with each codebook (TurboQuant_mse, same rotation and seed, same bytes); values and
queries stay exact, so the numbers isolate the key codebook. Reports per case the relative key MSE
||k - k~||^2 / ||k||^2 and the attention output's relative error and cosine against exact keys:
(1) Gaussian keys and queries, D = 64 and 128, 4096 keys, 64 queries (one softmax over all keys);
(2) SmolLM2-135M's real post-RoPE queries and keys (all 30 layers, every head, GQA 9/3, causal) on
``--tokens`` tokens of the essays, captured with a forward pre-hook on each attention module.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from jetson_tq.codec.kv import KVCodec  # noqa: E402
from jetson_tq.config import load_config  # noqa: E402

PRESETS = ("mse_k4v3", "mse_k4v3u")


def _quantized_keys(name: str, k: torch.Tensor) -> torch.Tensor:
    codec = KVCodec(load_config(name).default, k.shape[-1])
    return codec.decode_keys(codec.encode_keys(k))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v in float64; q [..., Tq, D], k/v [..., Tk, D]."""
    s = (q.double() @ k.double().transpose(-1, -2)) / q.shape[-1] ** 0.5
    if causal:
        tq, tk = s.shape[-2:]
        s = s.masked_fill(torch.ones(tq, tk, dtype=torch.bool).triu(tk - tq + 1), float("-inf"))
    return torch.softmax(s, -1) @ v.double()


def _errors(out: torch.Tensor, ref: torch.Tensor, k: torch.Tensor, kq: torch.Tensor) -> dict:
    cos = torch.nn.functional.cosine_similarity(out.flatten(0, -2), ref.flatten(0, -2), dim=-1)
    return {"key_rel_mse": ((kq - k).pow(2).sum(-1) / k.pow(2).sum(-1)).mean().item(),
            "out_rel_err": ((out - ref).norm() / ref.norm()).item(), "out_cos_mean": cos.mean().item(),
            "out_cos_min": cos.min().item()}


def gaussian_rows() -> list[dict]:
    rows = []
    for d in (64, 128):
        gen = torch.Generator().manual_seed(d)
        k, v = torch.randn(4096, d, generator=gen), torch.randn(4096, d, generator=gen)
        q = torch.randn(64, d, generator=gen) * 2  # sharper than unit-variance scores
        ref = _attention(q, k, v, False)
        for name in PRESETS:
            kq = _quantized_keys(name, k)
            rows.append({"case": f"gaussian D={d}", "keys": name, **_errors(_attention(q, kq, v, False), ref, k, kq)})
    return rows


def smollm2_rows(tokens: int) -> list[dict]:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from jetson_tq.models.smollm2 import load_smollm2
    from jetson_tq.models.text import essay_text

    model, tok = load_smollm2()
    ids = tok(essay_text(), return_tensors="pt").input_ids[:, :tokens]
    captured = []

    def hook(mod, args, kwargs):
        h = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        shape = (*h.shape[:-1], -1, mod.head_dim)
        q = mod.q_proj(h).view(shape).transpose(1, 2)
        k = mod.k_proj(h).view(shape).transpose(1, 2)
        v = mod.v_proj(h).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        captured.append((q[0].detach(), k[0].detach(), v[0].detach()))

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        model(ids)
    for hd in handles:
        hd.remove()
    totals = {name: [] for name in PRESETS}
    for q, k, v in captured:
        g = q.shape[0] // k.shape[0]
        ref = _attention(q, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0), True)
        for name in PRESETS:
            kq = _quantized_keys(name, k)
            totals[name].append(_errors(_attention(q, kq.repeat_interleave(g, 0), v.repeat_interleave(g, 0), True),
                                        ref, k, kq))
    rows = []
    for name, per_layer in totals.items():
        mean = {key: sum(r[key] for r in per_layer) / len(per_layer) for key in per_layer[0]}
        mean["out_cos_min"] = min(r["out_cos_min"] for r in per_layer)
        rows.append({"case": f"SmolLM2-135M, {tokens} tokens, {len(per_layer)} layers (mean)", "keys": name, **mean})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = gaussian_rows() + smollm2_rows(args.tokens)
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
