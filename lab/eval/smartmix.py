"""SmartMix: per-layer key/value bits for a target average bytes per token, from measured per-layer sensitivity.

Calibration (cheap enough for a 2-core CPU):

1. one exact forward over calibration text records, per layer, the post-RoPE queries, keys and
   values and the layer's residual-stream input (``capture``);
2. for every layer and every candidate format, the layer's attention is recomputed the way the
   chunked cache serves it (chunks of ``chunk`` tokens; history older than the fp16 recent buffer
   compressed, following the format's flush rule) and its error is measured where it lands: the
   change of the attention block's output (after ``o_proj``) relative to the residual stream,
   ``sum ||o_proj(attn_c - attn)||^2 / sum ||h||^2`` (``layer_errors``);
3. a knapsack over layers picks one candidate per layer minimising the summed error under the
   byte budget ``target_bytes * num_layers`` (``allocate``, exact dynamic programme);
4. the choice is written as a per-layer YAML config (``to_config``: the most common choice is the
   default, the rest ``layers.overrides``), which ``jetson_tq.config`` loads like any preset.

The errors are a first-order proxy (each layer perturbed alone, on exact inputs); whether the mix
beats the uniform default is measured separately, on other text, by ``benchmarks/fidelity.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from jetson_tq.codec.kv import KVCodec
from jetson_tq.config import TurboQuantConfig
from jetson_tq.format import FP16_FORMAT, KVFormat, exact_count
from jetson_tq.integrations.transformers import TurboQuantCache, enable_turboquant

from .decoded_history import BACKEND
from .decoded_history import register as register_decoded

CAPTURE = "jetson_tq_capture"


@dataclass
class LayerCapture:
    """What one layer saw in the exact forward: q [B, Hq, T, D], k and v [B, Hkv, T, D], residual input h [B, T,
    hidden]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    h: torch.Tensor


@torch.no_grad()
def capture(model, ids: torch.Tensor) -> list[LayerCapture]:
    """One exact forward of ids [B, T]; per layer its attention inputs and residual-stream input."""
    records: dict[int, dict] = {}

    def attn(module, query, key, value, attention_mask, **kwargs):
        records.setdefault(module.layer_idx, {}).update(q=query.detach(), k=key.detach(), v=value.detach())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    hooks = [
        layer.register_forward_pre_hook(_residual_hook(records, i), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)
    ]
    AttentionInterface.register(CAPTURE, attn)
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)
    before = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE)
    try:
        model(ids)
    finally:
        model.set_attn_implementation(before)
        for hk in hooks:
            hk.remove()
    return [LayerCapture(**records[i]) for i in range(len(model.model.layers))]


def kv_centers(caps: list[LayerCapture], skip: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the mean key and mean value [H, D] (float32) over positions >= ``skip`` of the captured text: the
    offsets a centered cache subtracts (the first position, an attention sink with an atypical key, is left out)."""
    return [(c.k[:, :, skip:].float().mean((0, 2)), c.v[:, :, skip:].float().mean((0, 2))) for c in caps]


def _residual_hook(records: dict, index: int) -> Callable:
    def hook(module, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        records.setdefault(index, {})["h"] = h.detach()

    return hook


def compressed_counts(fmt: KVFormat, total: int, chunk: int) -> list[int]:
    """Tokens a cache reads only compressed when each chunk of ``chunk`` tokens arrives (``compressed_lens``)."""
    return [start - exact_count(start, fmt.recent_tokens, fmt.block_window) for start in range(0, total, chunk)]


@torch.no_grad()
def chunked_attention(cap: LayerCapture, fmt: KVFormat | None, chunk: int, scale: float) -> torch.Tensor:
    """Attention output [B, T, Hq*D] as the cache serves it (``fmt`` None: exact): a query at position p reads
    positions older than ``fmt.exact_start(p)`` compressed and the rest exactly (the window rule); ``chunk`` bounds
    memory."""
    q, k, v = cap.q.float(), cap.k.float(), cap.v.float()
    b, hq, t, d = q.shape
    group = hq // k.shape[1]
    compressed = fmt is not None and not fmt.is_passthrough
    if compressed:
        assert fmt is not None  # compressed implies a format
        codec = KVCodec(fmt, d)
        f = codec.encode(k, v)
        kd, vd = codec.decode_keys(f).float(), codec.decode_values(f).float()
    outs = []
    for s in range(0, t, chunk):
        e = min(s + chunk, t)
        p = torch.arange(s, e, device=q.device).unsqueeze(1)
        j = torch.arange(e, device=q.device).unsqueeze(0)
        causal = j <= p
        if compressed:
            assert fmt is not None
            exact = causal & (j >= fmt.exact_start(p))
            keys = torch.cat([kd[:, :, :e], k[:, :, :e]], 2).repeat_interleave(group, 1)
            vals = torch.cat([vd[:, :, :e], v[:, :, :e]], 2).repeat_interleave(group, 1)
            mask = torch.cat([causal & ~exact, exact], 1)
        else:
            keys, vals, mask = k[:, :, :e].repeat_interleave(group, 1), v[:, :, :e].repeat_interleave(group, 1), causal
        outs.append(F.scaled_dot_product_attention(q[:, :, s:e], keys, vals, attn_mask=mask, scale=scale))
    return torch.cat(outs, 2).transpose(1, 2).reshape(b, t, hq * d)


@torch.no_grad()
def layer_errors(
    model,
    caps: list[LayerCapture],
    candidates: dict[str, KVFormat],
    chunk: int = 128,
    progress: Callable[[str], None] = lambda _: None,
) -> list[dict[str, float]]:
    """Per layer, per candidate: ||o_proj(attn_candidate - attn_exact)||^2 / ||residual input||^2 (summed over
    tokens)."""
    out = []
    for i, (cap, layer) in enumerate(zip(caps, model.model.layers)):
        scale = layer.self_attn.scaling
        exact = chunked_attention(cap, None, chunk, scale)
        o_proj = layer.self_attn.o_proj
        denom = float(cap.h.float().pow(2).sum())
        row = {}
        for name, fmt in candidates.items():
            delta = chunked_attention(cap, fmt, chunk, scale) - exact
            row[name] = float(F.linear(delta, o_proj.weight.float()).pow(2).sum()) / denom
        out.append(row)
        progress(f"[smartmix] layer {i}: " + ", ".join(f"{k} {v:.2e}" for k, v in row.items()))
    return out


@torch.no_grad()
def layer_kl(
    model,
    ids: torch.Tensor,
    low: KVFormat,
    chunk: int = 128,
    backend: str = "cpu-decoded",
    progress: Callable[[str], None] = lambda _: None,
) -> list[float]:
    """Per layer: mean KL(exact || model) per token when only that layer's cache is stored in ``low`` (the rest
    exact)."""
    if backend == BACKEND:
        register_decoded()
    enable_turboquant(model)
    ref_cache = DynamicCache(config=model.config)
    ref = [
        model(ids[:, s : s + chunk], past_key_values=ref_cache).logits.float().log_softmax(-1)
        for s in range(0, ids.shape[1], chunk)
    ]
    out = []
    for i in range(model.config.num_hidden_layers):
        cfg = TurboQuantConfig(name=f"only{i}", default=FP16_FORMAT, overrides={i: low})
        cache = TurboQuantCache(model, cfg, backend=backend)
        kl, n = 0.0, 0
        for c, s in enumerate(range(0, ids.shape[1], chunk)):
            logp = model(ids[:, s : s + chunk], past_key_values=cache).logits.float().log_softmax(-1)
            kl += float((ref[c].exp() * (ref[c] - logp)).sum(-1).clamp_min(0).sum())
            n += logp.shape[0] * logp.shape[1]
        out.append(kl / n)
        progress(f"[smartmix] layer {i} alone in {low.key_bits}/{low.value_bits} bits: KL {out[-1]:.2e}")
    return out


def weight_errors(errors: list[dict[str, float]], kl: list[float], probe: str) -> list[dict[str, float]]:
    """Rescale each layer's proxy errors so that its ``probe`` candidate's error equals the measured KL of that
    layer."""
    return [{k: v * w / row[probe] for k, v in row.items()} for row, w in zip(errors, kl)]


def allocate(errors: list[dict[str, float]], cost: dict[str, int], budget: int) -> list[str]:
    """One candidate per layer minimising the summed error with summed ``cost`` <= ``budget`` (exact knapsack DP)."""
    best: dict[int, tuple[float, list[str]]] = {0: (0.0, [])}
    for row in errors:
        nxt: dict[int, tuple[float, list[str]]] = {}
        for spent, (err, picks) in best.items():
            for name, e in row.items():
                s = spent + cost[name]
                if s <= budget and (s not in nxt or err + e < nxt[s][0]):
                    nxt[s] = (err + e, picks + [name])
        if not nxt:
            raise ValueError(f"budget {budget} B is below the cheapest choice for every layer")
        best = nxt
    return min(best.values(), key=lambda x: x[0])[1]


def format_section(fmt: KVFormat) -> dict:
    """The YAML keys/values sections of a format (the rest comes from the config's default)."""
    values = {"mode": fmt.value_mode, "bits": fmt.value_bits}
    if fmt.value_mode == "group":
        values["group_size"] = fmt.value_group
    return {"keys": {"mode": fmt.key_mode, "bits": fmt.key_bits}, "values": values}


def to_config(name: str, description: str, picks: list[str], candidates: dict[str, KVFormat]) -> dict:
    """A per-layer YAML mapping: the most common pick as the default, every other layer as an override."""
    common = max(set(picks), key=picks.count)
    base = candidates[common]
    raw = {
        "name": name,
        "description": description,
        **format_section(base),
        "norm_dtype": base.norm_dtype,
        "rotation": base.rotation,
        "buffer": {"recent_tokens": base.recent_tokens, "window": base.window, "flush_chunk": base.flush_chunk},
        "seed": base.seed,
        "layers": {
            "keep_fp16_first": 0,
            "keep_fp16_last": 0,
            "overrides": {i: format_section(candidates[p]) for i, p in enumerate(picks) if p != common},
        },
    }
    return raw
