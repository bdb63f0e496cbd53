"""What a key calibration reads from any transformers decoder: per attention layer the queries, keys and values as
the attention saw them (after the projections, q/k norms and RoPE), the RoPE it applied and its score scale.

Features, not model names: the attention modules are the ones transformers hands to its attention interface (every
model in transformers 5 calls ``ALL_ATTENTION_FUNCTIONS``), and the RoPE is read from the ``position_embeddings``
(cos, sin) each of them receives, so GQA, q/k norms (Qwen3, OLMo-2, Gemma 3), partial rotary (Phi-4-mini) and a RoPE
per layer type (Gemma 3's local and global layers) come from the model itself. A model whose attention gets no
(cos, sin), or whose RoPE is not the ``rotate_half`` kind, is refused with ``UnsupportedModelError``.
"""

from __future__ import annotations

import inspect
import math
import sys
from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from ..codec.klt import RotaryParams
from ..errors import UnsupportedModelError

CAPTURE = "jetson_tq_calibration"
#: The largest distance between the model's (cos, sin) and the RoPE read from them, relative to its scale: the fp32
#: angles of a 2k-token window differ from float64's by ~1e-4 rad; a RoPE not of the static kind misses by far more.
ROPE_TOLERANCE = 2e-3
#: RoPE types whose frequencies change with the sequence length: one calibration cannot serve every length.
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


@dataclass
class AttentionCapture:
    """One attention layer over the calibration ids: post-RoPE q [B, Hq, T, D], k and v [B, H, T, D], the RoPE the
    model applied, and the score scale."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    rotary: RotaryParams
    scaling: float


def decoder_config(model):
    """The model's text decoder config (a multimodal model's language part)."""
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def check_rope_type(config) -> None:
    """UnsupportedModelError for a RoPE whose frequencies change with the length (``DYNAMIC_ROPE_TYPES``)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kinds = [params] if "rope_type" in params or "type" in params else list(params.values())
    for p in kinds:
        kind = (p or {}).get("rope_type", (p or {}).get("type", "default")) if isinstance(p, dict) else "default"
        if kind in DYNAMIC_ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE type {kind!r}: its frequencies change with the sequence length, one calibration cannot serve "
                "every length"
            )


def _takes_position_embeddings(module: torch.nn.Module) -> bool:
    try:
        return "position_embeddings" in inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False


def _model_inv_freqs(model) -> list[torch.Tensor]:
    """Every RoPE frequency buffer of the model (``*inv_freq``), float64 on the CPU."""
    return [b.detach().double().cpu() for n, b in model.named_buffers() if n.endswith("inv_freq") and b.dim() == 1]


def rotary_from_tables(cos: torch.Tensor, sin: torch.Tensor, known: list[torch.Tensor], head_dim: int) -> RotaryParams:
    """The RoPE behind one row of (cos, sin) [T, R] at positions 0..T-1: ``rotate_half`` pairs (c, c + R/2), scale s =
    cos at position 0, frequencies from the angles (the model's own ``inv_freq`` buffer where one matches, exactly);
    UnsupportedModelError when the tables are not of that kind. Tables in a low-precision dtype (a bf16 model on the
    GPU) are checked to that dtype's rounding: bf16 rounds cos to ~4e-3."""
    eps = torch.finfo(cos.dtype).eps if cos.dtype.is_floating_point else 0.0
    cos, sin = cos.double().cpu(), sin.double().cpu()
    t, r = cos.shape
    if r % 2 or r > head_dim or t < 2:
        raise UnsupportedModelError(f"RoPE tables of width {r} at head dim {head_dim}: expected an even width <= it")
    half = r // 2
    if not (torch.allclose(cos[:, :half], cos[:, half:], atol=1e-5) and torch.allclose(sin[:, :half], sin[:, half:])):
        raise UnsupportedModelError("RoPE is not of the rotate_half kind (pairs c, c + R/2): interleaved RoPE")
    scale = float(cos[0, 0])
    if scale <= 0 or not math.isfinite(scale):
        raise UnsupportedModelError(f"RoPE scale {scale}: expected a positive cos at position 0")
    est = torch.atan2(sin[1, :half], cos[1, :half])  # the angle at position 1
    p = t - 1  # unwrap at the last position: precision ~1e-7 / p
    far = torch.atan2(sin[p, :half], cos[p, :half])
    freq = (far + 2 * math.pi * torch.round((est * p - far) / (2 * math.pi))) / p
    for buf in known:
        if buf.numel() == half and bool(((buf - freq).abs() <= 1e-6 + 2 * eps / p + 1e-4 * freq.abs()).all()):
            freq = buf
            break
    rotary = RotaryParams(freq.float(), scale)
    pos = torch.arange(t, dtype=torch.float64)[:, None]
    miss = ((scale * torch.cos(pos * freq) - cos[:, :half]).abs().max() / scale).item()
    if miss > max(ROPE_TOLERANCE, eps):
        raise UnsupportedModelError(f"RoPE tables are not s cos(p f) of a static frequency set (off by {miss:.2e})")
    return rotary


def _model_attention(module, implementation: str):
    """The attention function the model runs with: a registered one (sdpa, flash, ...) or, for "eager", the model's
    own (its modeling module defines one), else SDPA."""
    if implementation != "eager" and implementation in AttentionInterface._global_mapping:
        return AttentionInterface._global_mapping[implementation]
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None) or sdpa_attention_forward


@torch.no_grad()
def capture_attention(model, ids: torch.Tensor) -> list[AttentionCapture]:
    """One exact forward of ids [B, T] (positions 0..T-1); per attention layer (model order) what it saw. The
    attention itself is the one the model runs with (its eager one: soft caps, sinks as the model defines them)."""
    config = decoder_config(model)
    check_rope_type(config)
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    records: dict[int, dict] = {}

    def pre_hook(module, args, kwargs):
        pe = kwargs.get("position_embeddings")
        if pe is None and len(args) > 1:
            pe = args[1]
        if isinstance(pe, (tuple, list)) and len(pe) == 2:
            tables[id(module)] = (pe[0][0].detach(), pe[1][0].detach())

    def attention(module, query, key, value, attention_mask, **kwargs):
        index = getattr(module, "layer_idx", None)
        index = len(records) if index is None else int(index)
        records[index] = {"q": query.detach(), "k": key.detach(), "v": value.detach(), "module": module}
        return _model_attention(module, before)(module, query, key, value, attention_mask, **kwargs)

    hooks = [
        m.register_forward_pre_hook(pre_hook, with_kwargs=True)
        for m in model.modules()
        if _takes_position_embeddings(m) and not hasattr(m, "layers")
    ]
    before = model.config._attn_implementation or "eager"
    AttentionInterface.register(CAPTURE, attention)
    AttentionMaskInterface.register(CAPTURE, AttentionMaskInterface._global_mapping.get(before, sdpa_mask))
    try:
        model.set_attn_implementation(CAPTURE)
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model  # no LM head: its logits go unread
        (decoder if decoder is not None else model)(input_ids=ids.to(model.device), use_cache=False)
    finally:
        model.set_attn_implementation(before)
        for h in hooks:
            h.remove()
    if not records:
        raise UnsupportedModelError(f"{type(model).__name__}: no attention layer called transformers' attention")
    known = _model_inv_freqs(model)
    out = []
    for index in sorted(records):
        rec = records[index]
        module, q, k = rec["module"], rec["q"], rec["k"]
        if id(module) not in tables:
            raise UnsupportedModelError(
                f"attention layer {index} ({type(module).__name__}) receives no RoPE (cos, sin)"
            )
        if q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1] or k.shape[2] != ids.shape[1]:
            raise UnsupportedModelError(
                f"attention layer {index}: queries {tuple(q.shape)} and keys {tuple(k.shape)} are not grouped-query "
                f"attention over the {ids.shape[1]} calibration tokens"
            )
        cos, sin = tables[id(module)]
        rotary = rotary_from_tables(cos, sin, known, k.shape[-1])
        scaling = float(getattr(module, "scaling", k.shape[-1] ** -0.5))
        out.append(AttentionCapture(q, k, rec["v"], rotary, scaling))
    if sorted(records) != list(range(len(records))):
        raise UnsupportedModelError(f"attention layers {sorted(records)}: expected indices 0..{len(records) - 1}")
    return out
