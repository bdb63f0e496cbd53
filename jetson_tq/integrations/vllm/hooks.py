"""The few wraps of vLLM methods the plugin installs when the switch is on (no fork, no copied code).

- ``Attention.__init__``: decides per layer, from the layer's features (``spec.LayerFacts``) and its format under
  the active config (one that stores keys and values exactly runs stock), whether it runs on our backend (passed
  as the layer's ``attn_backend``) or on the attention vLLM would choose anyway; refuses,
  by layer name, only what neither can serve (``spec.refusal``).
- ``Attention.get_kv_cache_spec``: layers on our backend report ``TurboQuantPagedSpec`` (packed page size), or
  ``TurboQuantSlidingSpec`` for a sliding-window layer; the first call logs which layers are compressed and why the
  others are not.
- worker ``determine_available_memory``: the recent-buffer pools are taken out of the KV budget.
- ``GPUModelRunner.initialize_kv_cache`` (the CPU runner inherits it): remembers the runner (request ids
  for recent-buffer rows), takes each compressed layer's final page from vLLM's KV cache config, allocates
  the pools once vLLM's own KV cache exists and logs the resulting capacity.
- ``EngineArgs.create_engine_config``: leaves prefix caching as vLLM set it (on by default) when every ring
  is a block window (``window: block``) whose block divides vLLM's block size, turns it off (logged) otherwise
  (sliding windows need the exact copies of tokens a hit skips); with speculative decoding, switches async scheduling
  off (logged): it hands the attention metadata optimistic host lengths (every draft accepted).
Each wrap is installed once per process and calls the original first (``Attention.__init__``: with the
backend chosen).
"""

from __future__ import annotations

import inspect
import time
import weakref

import torch

from ...errors import ConfigError, UnsupportedModelError
from ...ops import report_compiles
from .recent import RecentSlots, pool_bytes
from .settings import (
    active_config,
    compresses,
    enabled,
    logger,
    preferred_block_size,
    sliding_windows,
    window_block,
)
from .spec import (
    EXACT_FORMAT_REASON,
    LayerFacts,
    describe_layers,
    hybrid_page,
    layer_format,
    layer_index,
    prefill_transient_bytes,
    refusal,
    stock_page_at,
    stock_reason,
    window_unit,
)

_RUNNER: weakref.ReferenceType | None = None
_SLOTS: RecentSlots | None = None


def current_runner():
    """The model runner of this worker process (None before its KV cache is initialized)."""
    return _RUNNER() if _RUNNER is not None else None


def recent_rows(vllm_config) -> int:
    """Rows of each recent-buffer pool (one per concurrently running request)."""
    return int(vllm_config.scheduler_config.max_num_seqs)


def recent_slots(vllm_config) -> RecentSlots:
    """The process-wide request -> ring-row map (shared by every layer's metadata builder)."""
    global _SLOTS
    if _SLOTS is None or _SLOTS.num_rows != recent_rows(vllm_config):
        _SLOTS = RecentSlots(recent_rows(vllm_config))
    return _SLOTS


def our_layers(vllm_config) -> dict:
    """Attention layers (name -> module) whose impl is jetson-tq's."""
    ctx = vllm_config.compilation_config.static_forward_context
    return {name: layer for name, layer in ctx.items() if is_ours(getattr(layer, "impl", None))}


def is_ours(impl) -> bool:
    """True for jetson-tq's attention impl (by its marker, so this module need not import the backend)."""
    return bool(getattr(impl, "is_jetson_tq", False))


def configure_all(vllm_config) -> dict:
    """Give every jetson-tq layer its format (idempotent); returns our layers."""
    layers = our_layers(vllm_config)
    for name, layer in layers.items():
        layer.impl.configure(name, vllm_config)
    return layers


# ------------------------------------------------------------------------------------- per-layer decision
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


def _init_wrap(original):
    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        if not enabled():  # installed by an earlier engine of this process whose switch was on
            return original(self, *args, **kwargs)
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        facts = layer_facts(bound.arguments, vllm_config)
        ctx = vllm_config.compilation_config.static_forward_context
        compressed = {n for n, layer in ctx.items() if getattr(layer, STOCK_ATTR, "") is None}
        why_not = refusal(facts, compressed)
        if why_not:
            raise UnsupportedModelError(f"layer {facts.name}: {why_not}")
        model_config = vllm_config.model_config
        why = stock_reason(facts, model_config.max_model_len if model_config is not None else None)
        if why is None and model_config is not None:  # features allow it; the format is looked up only then
            why = stock_reason(facts, model_config.max_model_len, planned_format(facts, model_config))
        if why is None:
            bound.arguments["attn_backend"] = _BACKEND[0]
        original(*bound.args, **bound.kwargs)
        setattr(self, STOCK_ATTR, why)

    return __init__


def planned_format(facts: LayerFacts, model_config):
    """The format the active config gives this layer (the one ``backend.pick_format`` configures it with)."""
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


#: on each compressed layer: (vLLM's block size it was planned for, (block size, page bytes per KV head or 0))
PLAN_ATTR = "_jetson_tq_plan"
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


def recent_pool_bytes(vllm_config) -> int:
    """Bytes all recent-buffer pools take (K and V, every layer, max_num_seqs + 1 rows), their undo pools for
    speculative decoding's rejected drafts included."""
    elt = torch.empty((), dtype=vllm_config.model_config.dtype).element_size()
    total = 0
    for layer in configure_all(vllm_config).values():
        impl = layer.impl
        width = impl.fmt.buffer_tokens + impl.undo_tokens
        total += pool_bytes(recent_rows(vllm_config) + 1, impl.num_kv_heads, width, impl.head_size, elt)
    return total


def prefill_reserve_bytes(vllm_config) -> int:
    """Bytes the largest prefill chunk's kernel temporaries take (the worst compressed layer; layers run one after
    another and the caching allocator reuses the blocks): 0 off CUDA (the reference path) and when the user fixed
    the KV cache's bytes (``kv_cache_memory_bytes``: vLLM sizes nothing from the profile then)."""
    if getattr(vllm_config.cache_config, "kv_cache_memory_bytes", None):
        return 0
    if torch.device(vllm_config.device_config.device).type != "cuda":
        return 0
    elt = torch.empty((), dtype=vllm_config.model_config.dtype).element_size()
    tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
    max_len = int(vllm_config.model_config.max_model_len)
    return max(
        (
            prefill_transient_bytes(
                layer.impl.fmt,
                layer.impl.num_heads,
                layer.impl.num_kv_heads,
                layer.impl.head_size,
                tokens,
                max_len,
                elt,
            )
            for layer in configure_all(vllm_config).values()
        ),
        default=0,
    )


# ------------------------------------------------------------------------------------- the wraps
def bound_cache(layer) -> torch.Tensor | None:
    """The KV cache tensor vLLM bound to an attention layer (a list per virtual engine in some versions)."""
    cache = getattr(layer, "kv_cache", None)
    if isinstance(cache, (list, tuple)):
        cache = cache[0] if cache else None
    return cache if isinstance(cache, torch.Tensor) and cache.numel() else None


def _wrap(cls, name: str, make):
    """Replace ``cls.name`` by ``make(original)`` once."""
    original = cls.__dict__.get(name)
    if original is None or getattr(original, "_jetson_tq", False):
        return
    wrapped = make(original)
    wrapped._jetson_tq = True
    wrapped.__wrapped__ = original
    setattr(cls, name, wrapped)


def _spec_wrap(original):
    def get_kv_cache_spec(self, vllm_config):
        announce(vllm_config)
        spec = original(self, vllm_config)
        if spec is None or not is_ours(self.impl):
            return spec
        self.impl.configure(self.layer_name, vllm_config)
        return self.impl.kv_cache_spec()

    return get_kv_cache_spec


def _memory_wrap(original):
    def determine_available_memory(self, *args, **kwargs):
        available = original(self, *args, **kwargs)
        transient = prefill_reserve_bytes(self.vllm_config)
        reserved = recent_pool_bytes(self.vllm_config) + transient
        if transient:
            logger().info(
                "jetson-tq: %.1f MiB of the KV budget set aside for prefill kernel temporaries (a %d-token chunk; "
                "vLLM's profile run does not reach them)",
                transient / 2**20,
                self.vllm_config.scheduler_config.max_num_batched_tokens,
            )
        if reserved:
            if reserved >= available:
                raise ConfigError(
                    f"jetson-tq recent buffers and prefill temporaries need {reserved / 2**20:.1f} MiB but the KV "
                    f"budget is {available / 2**20:.1f} MiB; lower max_num_seqs, buffer.recent_tokens or "
                    f"max_num_batched_tokens"
                )
            logger().info(
                "jetson-tq: %.1f MiB of the KV budget reserved for fp16 recent buffers "
                "(%d rows + 1 scratch) and prefill temporaries; %.1f MiB left for compressed pages",
                reserved / 2**20,
                recent_rows(self.vllm_config),
                (available - reserved) / 2**20,
            )
        return available - reserved

    return determine_available_memory


def block_table_width(runner, block_size: int) -> int:
    """Columns of the runner's block table for ``block_size``-token blocks (the row stride our kernels get; vLLM
    sizes it ``cdiv(max_model_len, block_size)``, which is the fallback)."""
    tables = getattr(getattr(getattr(runner, "input_batch", None), "block_table", None), "block_tables", None) or []
    for table in tables:
        if getattr(table, "block_size", None) == block_size:
            return int(table.max_num_blocks_per_req)
    return -(-int(runner.model_config.max_model_len) // block_size)


#: a launch slower than this on a new launch key compiled (Triton's in-memory and disk caches answer in ms)
LATE_COMPILE_S = 0.05


def _late_compile(kernel: str, key: tuple, seconds: float) -> None:
    """A kernel compiled after the warm-up: a request waited for it (the warm-up's coverage missed this key)."""
    if seconds < LATE_COMPILE_S:
        return
    logger().warning(
        "jetson-tq: %s compiled while serving (%.2f s, a request waited): not covered by the warm-up, key %s",
        kernel,
        seconds,
        str(key)[:400],
    )


def _runner_wrap(original):
    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        global _RUNNER
        _RUNNER = weakref.ref(self)
        out = original(self, kv_cache_config, *args, **kwargs)
        configure_all(self.vllm_config)
        adopt_final_specs(self.vllm_config, kv_cache_config)
        log_capacity(self.vllm_config, kv_cache_config)
        log_encoder_attention(self)
        warmed: set = set()
        for layer in our_layers(self.vllm_config).values():
            layer.impl.allocate_recent(
                recent_rows(self.vllm_config), torch.device(self.device), self.model_config.dtype
            )
            key = (layer.impl.fmt, layer.impl.num_heads, layer.impl.num_kv_heads, layer.impl.head_size)
            cache = bound_cache(layer)
            if torch.device(self.device).type == "cuda" and cache is not None and key not in warmed:
                try:  # Triton compiles now, not in the first request (once per format)
                    sched, start = self.vllm_config.scheduler_config, time.perf_counter()
                    layer.impl.warm_up(
                        cache,
                        max_rows=int(sched.max_num_seqs),
                        table_width=block_table_width(self, layer.impl.layout.block_size),
                        max_len=int(self.model_config.max_model_len),
                        budget=int(sched.max_num_batched_tokens),
                    )
                    logger().info("jetson-tq: kernel warm-up of %s took %.2f s", key, time.perf_counter() - start)
                except Exception as exc:  # the first request then compiles, and raises if the path is broken
                    logger().warning("jetson-tq: kernel warm-up skipped (%s: %s)", type(exc).__name__, exc)
                warmed.add(key)
        if warmed:
            report_compiles(_late_compile)
        return out

    return initialize_kv_cache


def _config_wrap(original):
    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        if not enabled():  # installed by an earlier engine of this process whose switch was on
            return config
        log = logger()
        from vllm.platforms import current_platform

        why = prefix_caching_blocker(active_config(), config.cache_config, current_platform.is_cpu())
        if config.cache_config.enable_prefix_caching and why:
            log.info("jetson-tq: prefix caching switched off: %s", why)
            config.cache_config.enable_prefix_caching = False
        if (
            config.speculative_config is not None
            and config.scheduler_config.async_scheduling
            and compresses(active_config())
        ):
            log.info(
                "jetson-tq: async scheduling switched off: with speculative decoding it gives the attention "
                "metadata optimistic host lengths (every draft accepted), and the recent buffers need the exact ones"
            )
            config.scheduler_config.async_scheduling = False
        # the attention backend vLLM (or the user) chose stays: it serves the layers kept on stock attention;
        # compressed layers get ours from the Attention.__init__ wrap
        return config

    return create_engine_config


def prefix_caching_blocker(cfg, cache_config, is_cpu: bool) -> str | None:
    """Why prefix caching must be off under ``cfg`` (None when hits are safe): a hit starts a request at a block
    boundary with nothing in its fp16 ring, which only a block window restarting at that boundary expects."""
    if sliding_windows(cfg):
        return (
            "a sliding window (buffer.window: sliding) reads the last recent_tokens exactly, and a prefix-cache "
            "hit would start attention without the cached tokens' exact copies (buffer.window: block allows hits)"
        )
    from vllm.config.cache import CacheConfig

    w = window_block(cfg)
    # the block size is final here on CPU or when the user set it; else the backend will ask for a multiple of w
    final = is_cpu or cache_config.user_specified_block_size
    size = cache_config.block_size if final else preferred_block_size(CacheConfig.DEFAULT_BLOCK_SIZE, cfg)
    if size and size % w:
        return (
            f"block windows restart every {w} tokens but vLLM's block size is {size} (a hit may start inside a "
            f"window); set --block-size to a multiple of {w}"
        )
    unit = getattr(cache_config, "prefix_match_unit", None)  # vLLM 0.27: hits at finer boundaries than a block
    if unit and unit % w:
        return f"block windows restart every {w} tokens but prefix_match_unit is {unit}; set it to a multiple of {w}"
    return None


#: the attention backend class compressed layers get (given by ``install``: this module does not import the backend,
#: which imports it)
_BACKEND: list[type] = []


def install(backend: type) -> None:
    """Install every wrap (idempotent); layers the backend reproduces get ``backend``."""
    _BACKEND[:] = [backend]
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap(Attention, "__init__", _init_wrap)
    _wrap(Attention, "get_kv_cache_spec", _spec_wrap)
    _wrap(GPUModelRunner, "initialize_kv_cache", _runner_wrap)
    _wrap(EngineArgs, "create_engine_config", _config_wrap)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
        from vllm.v1.worker.cpu_worker import CPUWorker

        _wrap(CPUModelRunner, "initialize_kv_cache", _runner_wrap)
        _wrap(CPUWorker, "determine_available_memory", _memory_wrap)
    else:
        from vllm.v1.worker.gpu_worker import Worker

        _wrap(Worker, "determine_available_memory", _memory_wrap)
