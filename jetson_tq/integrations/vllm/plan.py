"""The page of each compressed layer: planned before vLLM sizes the KV cache (``model_plan``: vLLM's block size, or
a hybrid page when stock layers of another kind share vLLM's hybrid KV-cache groups) and adopted after vLLM grouped
the layers (``adopt_final_specs``: it may scale a group's block size).

One plan per model and block size, kept on the layers (``PLAN_ATTR``): every layer's impl asks for it when it is
configured, and the start-up log reports it.
"""

from __future__ import annotations

from .runtime import our_layers
from .settings import active_config, window_block
from .spec import hybrid_page, stock_page_at, window_unit

#: on each compressed layer: (vLLM's block size it was planned for, (block size, page bytes per KV head or 0))
PLAN_ATTR = "_jetson_tq_plan"


def model_plan(vllm_config) -> dict[str, tuple[int, int]]:
    """Compressed layer name -> (block size, page bytes per KV head or 0 for packed): vLLM's block size, unless
    stock layers of another kind (sliding window, Mamba, ...) put the model in vLLM's hybrid KV-cache groups,
    which share one page size: then ``spec.hybrid_page`` (a whole multiple of the largest stock page)."""
    ours = our_layers(vllm_config)
    bs = vllm_config.cache_config.block_size
    # planned for this block size (kept on the model's layers); vLLM sets the block size after loading the model,
    # and a plan made before (the start-up log, while a speculative-decoding head loads) would give our layers
    # another block size than stock layers get, which no page-size unification can join
    if ours and all(getattr(layer, PLAN_ATTR, (None,))[0] == bs for layer in ours.values()):
        return {name: getattr(layer, PLAN_ATTR)[1] for name, layer in ours.items()}
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    ctx = vllm_config.compilation_config.static_forward_context
    plan = {name: (bs, 0) for name in ours}
    if ours and not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        plan.update(_hybrid_plan(vllm_config, ctx, ours, bs, FullAttentionSpec))
    for name, layer in ours.items():
        setattr(layer, PLAN_ATTR, (bs, plan[name]))
    return plan


def _hybrid_plan(vllm_config, ctx, ours: dict, bs: int, FullAttentionSpec) -> dict[str, tuple[int, int]]:
    """The compressed layers' pages when stock layers of another kind share vLLM's hybrid groups (else {})."""
    stock = [
        layer.get_kv_cache_spec(vllm_config)
        for name, layer in ctx.items()
        if name not in ours
        and hasattr(layer, "get_kv_cache_spec")
        and not getattr(layer, "kv_sharing_target_layer_name", None)
    ]
    stock = [s for s in stock if s is not None]
    sliding_ours = any(layer.impl.extras.sliding_window is not None for layer in ours.values())
    if not stock or (all(isinstance(s, FullAttentionSpec) for s in stock) and not sliding_ours):
        return {}  # one group of full-attention layers, each with its own page size (or ours alone, one page)
    page = max(stock_page_at(s, bs) for s in stock)
    unit = window_unit(bs, window_block(active_config()))
    plan = {}
    for name, layer in ours.items():
        fmt, _ = layer.impl.pick_format(name, vllm_config)
        plan[name] = hybrid_page(fmt, layer.impl.head_size, layer.impl.num_kv_heads, page, unit)
    return plan


def adopt_final_specs(vllm_config, kv_cache_config) -> None:
    """Give each compressed layer the page vLLM finally grouped it with (it may scale a block size)."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    ours = our_layers(vllm_config)
    for group in kv_cache_config.kv_cache_groups:
        for name in group.layer_names:
            if name in ours:
                spec = group.kv_cache_spec
                if isinstance(spec, UniformTypeKVCacheSpecs):
                    spec = spec.kv_cache_specs[name]
                ours[name].impl.adopt(spec)
