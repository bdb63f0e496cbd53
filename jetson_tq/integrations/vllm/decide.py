"""Per layer, at ``Attention.__init__``: compressed on our backend, stock attention (and why), or refused.

The decision reads the layer's features (``spec.LayerFacts``, gathered here from the constructor's arguments and
vLLM's config) and, when they allow it, the format the active config gives the layer: one that stores keys and values
exactly runs stock. It is kept on the layer (``STOCK_ATTR``) for the page plan, the log and ``layer_decisions``.
"""

from __future__ import annotations

from ...errors import UnsupportedModelError
from .settings import active_config
from .spec import LayerFacts, layer_format, layer_index, refusal, stock_reason

STOCK_ATTR = "_jetson_tq_stock"  # on each Attention layer: None = compressed, else why it runs stock


def _non_causal(vllm_config) -> bool:
    """True when vLLM runs the model's attention non-causally (prefix-LM multimodal models, use_non_causal)."""
    model_config = vllm_config.model_config
    try:
        mm_prefix = bool(model_config is not None and model_config.is_mm_prefix_lm)
    except (AttributeError, TypeError):
        mm_prefix = False
    return mm_prefix or bool(getattr(vllm_config.attention_config, "use_non_causal", False))


def layer_facts(args: dict, vllm_config) -> LayerFacts:
    """The facts of one ``Attention.__init__`` call (its bound arguments, defaults applied)."""
    cache_config, quant_config = args.get("cache_config"), args.get("quant_config")
    window = args.get("per_layer_sliding_window")
    if window is None and cache_config is not None:
        window = cache_config.sliding_window  # a model-wide window (vLLM sets it only when every layer slides)
    kv_dtype = cache_config.cache_dtype if cache_config is not None else "auto"
    if getattr(quant_config, "kv_cache_scheme", None) is not None and kv_dtype == "auto":
        kv_dtype = "fp8 (the checkpoint's kv_cache_scheme)"
    extra = dict(args.get("extra_impl_args") or {})
    sinks = extra.pop("sinks", None) is not None
    own = args.get("attn_backend")
    attn_type = args.get("attn_type")
    return LayerFacts(
        name=args.get("prefix", ""),
        head_size=int(args["head_size"]),
        num_heads=int(args["num_heads"]),
        num_kv_heads=int(args.get("num_kv_heads") or args["num_heads"]),
        head_size_v=args.get("head_size_v"),
        attn_type=str(getattr(attn_type, "value", attn_type) or "decoder"),
        sliding_window=window,
        logits_soft_cap=args.get("logits_soft_cap") or None,
        alibi=args.get("alibi_slopes") is not None or bool(args.get("use_alibi_sqrt")),
        sinks=sinks,
        kv_sharing_target=args.get("kv_sharing_target_layer_name"),
        kv_cache_dtype=str(kv_dtype),
        non_causal=_non_causal(vllm_config),
        extra=tuple(sorted(k for k, v in extra.items() if v not in (None, False))),
        own_backend=own.get_name() if own is not None else None,
        draft=_building_draft_model(),
    )


#: vLLM's model tags of speculative-decoding proposer models (``compilation.backends.set_model_tag``)
DRAFT_MODEL_TAGS = ("eagle_head", "draft_model", "medusa_head", "dspark_head", "dflash_head")


def _building_draft_model() -> bool:
    """True while vLLM builds a speculative-decoding proposer (EAGLE / MTP head, draft model): its layers keep
    stock attention (a draft pass writes positions the target then verifies: none of the ring's bookkeeping)."""
    try:
        from vllm.compilation import backends
    except ImportError:
        return False
    return getattr(backends, "model_tag", "") in DRAFT_MODEL_TAGS


def decide(facts: LayerFacts, vllm_config) -> str | None:
    """None when the layer runs on our backend, else why it runs on stock attention; raises UnsupportedModelError,
    naming the layer, for what neither can serve (``spec.refusal``)."""
    ctx = vllm_config.compilation_config.static_forward_context
    compressed = {n for n, layer in ctx.items() if getattr(layer, STOCK_ATTR, "") is None}
    why_not = refusal(facts, compressed)
    if why_not:
        raise UnsupportedModelError(f"layer {facts.name}: {why_not}")
    model_config = vllm_config.model_config
    why = stock_reason(facts, model_config.max_model_len if model_config is not None else None)
    if why is None and model_config is not None:  # features allow it; the format is looked up only then
        why = stock_reason(facts, model_config.max_model_len, planned_format(facts, model_config))
    return why


def planned_format(facts: LayerFacts, model_config):
    """The format the active config gives this layer (the one ``impl.pick_format`` configures it with)."""
    num_layers = int(model_config.hf_text_config.num_hidden_layers)
    return layer_format(active_config(), layer_index(facts.name), num_layers, facts.head_size)


def layer_decisions(vllm_config) -> dict[str, str | None]:
    """Attention layer name -> None (compressed) or why it runs on stock attention, in model order."""
    ctx = vllm_config.compilation_config.static_forward_context
    out = {}
    for name, layer in ctx.items():
        if hasattr(layer, STOCK_ATTR):
            out[name] = getattr(layer, STOCK_ATTR)
        elif hasattr(layer, "get_kv_cache_spec"):  # MLA, Mamba, ...: not an Attention layer
            out[name] = f"{type(layer).__name__} (not a standard attention layer)"
    return out
