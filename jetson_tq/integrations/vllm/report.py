"""What the plugin tells the user about a model, and keeps for tests and reports: which layers are compressed and why
the others run stock (``announce``, ``LAST_DECISIONS``), the KV cache capacity vLLM computes (``log_capacity``,
``LAST_CAPACITY``) and the encoder attention modules that always run stock (``LAST_ENCODER_LAYERS``).

Logged once per model (a marker on its layers: vLLM asks every layer for its spec) and once per KV cache config (the
CPU runner's hook runs inside the GPU runner's).
"""

from __future__ import annotations

from .decide import layer_decisions
from .plan import model_plan
from .settings import enabled, logger
from .spec import EXACT_FORMAT_REASON, describe_layers

ANNOUNCED_ATTR = "_jetson_tq_announced"  # on each attention layer once its model's decisions were logged
#: the decisions of the last model this process built (layer name -> None or why stock), for tests and reports
LAST_DECISIONS: dict[str, str | None] = {}
#: vLLM's capacity of the last KV cache this process allocated (``capacity``), stock engines too
LAST_CAPACITY: dict = {}
#: the encoder attention modules (a vision tower's) of the last model whose KV cache this process allocated
LAST_ENCODER_LAYERS: list[str] = []


def encoder_attention_modules(model) -> list[str]:
    """Names of ``model``'s encoder attention modules (vLLM's ``MMEncoderAttention``: a vision tower's
    bidirectional attention over image patches). They hold no KV cache and are no ``Attention`` layers, so the plugin
    never sees them: they always run on vLLM's own attention."""
    try:
        from vllm.model_executor.layers.attention import MMEncoderAttention
    except ImportError:  # a vLLM without it has no such modules
        return []
    return [name for name, module in model.named_modules() if isinstance(module, MMEncoderAttention)]


def log_encoder_attention(runner) -> None:
    """Keep (``LAST_ENCODER_LAYERS``) and log the model's encoder attention modules, when it has any."""
    try:
        model = runner.get_model()
    except Exception:  # no model loaded (a runner under test)
        return
    names = encoder_attention_modules(model)
    LAST_ENCODER_LAYERS[:] = names
    if names and enabled():
        logger().info(
            "jetson-tq: %d encoder attention modules (vision tower, MMEncoderAttention: no KV cache) run on vLLM's "
            "own attention: %s",
            len(names),
            ", ".join(names) if len(names) <= 4 else f"{names[0]} ... {names[-1]}",
        )


def announce(vllm_config) -> None:
    """Log once per model which layers are compressed and why the others run on stock attention."""
    ctx = vllm_config.compilation_config.static_forward_context
    if not enabled() or any(getattr(layer, ANNOUNCED_ATTR, False) for layer in ctx.values()):
        return
    for layer in ctx.values():
        try:
            setattr(layer, ANNOUNCED_ATTR, True)
        except AttributeError:  # not every registered object takes attributes; one marked layer suffices
            pass
    decisions = layer_decisions(vllm_config)
    LAST_DECISIONS.clear()
    LAST_DECISIONS.update(decisions)
    log = logger()
    ours = [n for n, why in decisions.items() if why is None]
    if ours == [] and set(decisions.values()) == {EXACT_FORMAT_REASON}:
        log.info("jetson-tq: %s; vLLM runs every layer on stock attention", describe_layers(decisions))
        return
    if not ours:
        log.warning(
            "jetson-tq: no attention layer of this model can be compressed; vLLM runs it on stock attention (%s)",
            describe_layers(decisions),
        )
        return
    log.info("jetson-tq: %s", describe_layers(decisions))
    plan = model_plan(vllm_config)
    hybrid = {v for n, v in plan.items() if v[1]}
    if hybrid:
        log.info(
            "jetson-tq: stock layers of another kind share vLLM's hybrid KV-cache page size: compressed layers "
            "use blocks of %s tokens (page per KV head %s B)",
            sorted({b for b, _ in hybrid}),
            sorted({p for _, p in hybrid}),
        )


def capacity(vllm_config, kv_cache_config) -> dict:
    """vLLM's own capacity of a KV cache config: requests of max_model_len that fit at once, and that times the
    length (the "KV cache size: N tokens" vLLM logs), with the blocks and groups behind it."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    concurrency = get_max_concurrency_for_kv_cache_config(vllm_config, kv_cache_config)
    mml = vllm_config.model_config.max_model_len
    return {
        "num_blocks": int(kv_cache_config.num_blocks),
        "groups": len(kv_cache_config.kv_cache_groups),
        "concurrency": round(float(concurrency), 3),
        "kv_tokens": int(concurrency * mml),
        "max_model_len": mml,
    }


def log_capacity(vllm_config, kv_cache_config) -> None:
    """Keep (``LAST_CAPACITY``) and, when layers are compressed, log the capacity that results (once per config)."""
    if getattr(kv_cache_config, "_jetson_tq_logged", False):
        return
    kv_cache_config._jetson_tq_logged = True  # the CPU runner's wrap calls the GPU runner's: once
    cap = capacity(vllm_config, kv_cache_config)
    LAST_CAPACITY.clear()
    LAST_CAPACITY.update(cap)
    decisions = layer_decisions(vllm_config)
    n_ours = sum(why is None for why in decisions.values())
    if not n_ours:
        return
    logger().info(
        "jetson-tq: KV cache of %d blocks in %d group(s), %d of %d attention layers compressed: "
        "%s tokens (%.2f requests of %d tokens at once)",
        cap["num_blocks"],
        cap["groups"],
        n_ours,
        len(decisions),
        f"{cap['kv_tokens']:,}",
        cap["concurrency"],
        cap["max_model_len"],
    )
