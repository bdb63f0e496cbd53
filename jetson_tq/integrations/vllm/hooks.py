"""Every wrap of a vLLM method the plugin installs when the switch is on (no fork, no copied code), each named with
the reason it exists in one table, ``PATCHES``, which ``install`` applies.

Each wrap is installed once per process and calls the original first (``Attention.__init__``: with the backend
chosen; the plugin's ``auto`` wrap: after resolving the switch); what a wrap does lives in the module of its job
(``decide``, ``report``, ``plan``, ``memory``, ``warmup``, ``engine_config``), so a wrap here is only the seam.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...ops import report_compiles
from .decide import STOCK_ATTR, decide, layer_facts
from .engine_config import adjust_engine_config
from .memory import kv_budget
from .plan import adopt_final_specs
from .report import announce, log_capacity, log_encoder_attention
from .runtime import configure_all, is_ours, our_layers, recent_rows, remember_runner
from .settings import enabled
from .warmup import late_compile, warm_up_layer

Wrap = Callable[[Callable], Callable]  # original method -> its wrap


def _init_wrap(original):
    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        if not enabled():  # installed by an earlier engine of this process whose switch was on
            return original(self, *args, **kwargs)
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        why = decide(layer_facts(bound.arguments, vllm_config), vllm_config)
        if why is None:
            bound.arguments["attn_backend"] = _BACKEND[0]
        original(*bound.args, **bound.kwargs)
        setattr(self, STOCK_ATTR, why)

    return __init__


def _spec_wrap(original):
    def get_kv_cache_spec(self, vllm_config):
        announce(vllm_config)
        spec = original(self, vllm_config)
        if spec is None or not is_ours(self.impl):
            return spec
        self.impl.configure(self.layer_name, vllm_config)
        return self.impl.kv_cache_spec()

    return get_kv_cache_spec


def _runner_wrap(original):
    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        remember_runner(self)
        out = original(self, kv_cache_config, *args, **kwargs)
        configure_all(self.vllm_config)
        adopt_final_specs(self.vllm_config, kv_cache_config)
        log_capacity(self.vllm_config, kv_cache_config)
        log_encoder_attention(self)
        warmed: set = set()
        report_compiles(None)  # this engine's warm-up compiles are not late (an earlier engine of the process set it)
        for layer in our_layers(self.vllm_config).values():
            layer.impl.allocate_recent(
                recent_rows(self.vllm_config), torch.device(self.device), self.model_config.dtype
            )
            warm_up_layer(self, layer, warmed)
        if warmed:
            report_compiles(late_compile)
        return out

    return initialize_kv_cache


def _memory_wrap(original):
    def determine_available_memory(self, *args, **kwargs):
        return kv_budget(self.vllm_config, original(self, *args, **kwargs))

    return determine_available_memory


def _config_wrap(original):
    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        if not enabled():  # installed by an earlier engine of this process whose switch was on
            return config
        adjust_engine_config(config)
        return config

    return create_engine_config


ALWAYS, CPU, GPU = "always", "cpu", "gpu"  # which vLLM platform a patch is installed on (GPU: any but CPU)
MARK = "_jetson_tq"  # set on each installed wrap: a second install leaves it alone
AUTO_MARK = "_jetson_tq_auto"  # the plugin's ``auto`` wrap goes on top of ours, so it has its own mark

ATTENTION = "vllm.model_executor.layers.attention.attention:Attention"
GPU_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
ENGINE_ARGS = "vllm.engine.arg_utils:EngineArgs"


@dataclass(frozen=True)
class Patch:
    """One wrapped vLLM method: ``owner`` ("module:Class").``method`` becomes ``make(original)``."""

    owner: str
    method: str
    make: Wrap | None  # None: given to ``install`` by its caller
    platform: str
    why: str
    mark: str = MARK


#: every vLLM method the plugin wraps, in the order ``install`` wraps them (a later wrap of a method is outermost)
PATCHES: tuple[Patch, ...] = (
    Patch(
        ATTENTION,
        "__init__",
        _init_wrap,
        ALWAYS,
        "decide per layer, from its features and its format under the active config, whether it runs on our backend "
        "(passed as the layer's attn_backend) or on the attention vLLM would choose anyway; refuse by layer name "
        "only what neither can serve (decide)",
    ),
    Patch(
        ATTENTION,
        "get_kv_cache_spec",
        _spec_wrap,
        ALWAYS,
        "layers on our backend report TurboQuantPagedSpec (the packed page size vLLM sizes the cache from), or "
        "TurboQuantSlidingSpec for a sliding-window layer; the first call logs which layers are compressed and why "
        "the others are not (report)",
    ),
    Patch(
        GPU_RUNNER,
        "initialize_kv_cache",
        _runner_wrap,
        ALWAYS,
        "remember the runner (request ids for ring rows), take each compressed layer's final page from vLLM's KV "
        "cache config, allocate the ring pools once vLLM's own KV cache exists, log the capacity, warm the "
        "kernels up (runtime, plan, report, warmup)",
    ),
    Patch(
        ENGINE_ARGS,
        "create_engine_config",
        _config_wrap,
        ALWAYS,
        "prefix caching off unless every ring is a block window dividing vLLM's block size (a hit starts with an "
        "empty ring); async scheduling off with speculative decoding (optimistic host lengths) (engine_config)",
    ),
    Patch(
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
        "initialize_kv_cache",
        _runner_wrap,
        CPU,
        "as GPUModelRunner's: vLLM's CPU runner overrides it (and calls GPUModelRunner's: configuring is "
        "idempotent, the capacity is logged once per KV cache config)",
    ),
    Patch(
        "vllm.v1.worker.cpu_worker:CPUWorker",
        "determine_available_memory",
        _memory_wrap,
        CPU,
        "take the ring pools (and undo pools) out of the KV budget before vLLM sizes the pages (memory)",
    ),
    Patch(
        "vllm.v1.worker.gpu_worker:Worker",
        "determine_available_memory",
        _memory_wrap,
        GPU,
        "take the ring pools (and undo pools) and the largest prefill chunk's kernel temporaries, which vLLM's "
        "profile run does not reach, out of the KV budget before vLLM sizes the pages (memory)",
    ),
    Patch(
        ENGINE_ARGS,
        "create_engine_config",
        None,  # plugin.auto_wrap: the plugin owns the switch and its resolution
        ALWAYS,
        "only with JETSON_TQ_CONFIG=auto: calibrate the model from its checkpoint and set the switch before vLLM "
        "reads the config, in the process that starts the engine (its workers inherit the switch); outermost, so "
        "it resolves before the wrap above reads the config",
        AUTO_MARK,
    ),
)

#: the attention backend class compressed layers get (given by ``install``: this module does not import the backend)
_BACKEND: list[type] = []


def _wrapped_by(method, mark: str) -> bool:
    """True when ``method`` or a method it wraps (``__wrapped__``) carries ``mark``: two of our wraps share
    create_engine_config, so the outer one hides the inner one's mark."""
    while method is not None:
        if getattr(method, mark, False):
            return True
        method = getattr(method, "__wrapped__", None)
    return False


def _wrap(cls, name: str, make: Wrap, mark: str = MARK) -> None:
    """Replace ``cls.name`` by ``make(original)`` once."""
    original = cls.__dict__.get(name)
    if original is None or _wrapped_by(original, mark):
        return
    wrapped = make(original)
    setattr(wrapped, mark, True)
    wrapped.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(cls, name, wrapped)


def install(backend: type, auto: Wrap | None = None) -> None:
    """Install every wrap of ``PATCHES`` for vLLM's platform (idempotent); layers the backend reproduces get
    ``backend``; ``auto`` is the wrap of the patch whose ``make`` is None (skipped when it is None too)."""
    _BACKEND[:] = [backend]
    from vllm.platforms import current_platform

    platform = CPU if current_platform.is_cpu() else GPU
    for patch in PATCHES:
        make = patch.make or auto
        if make is None or patch.platform not in (ALWAYS, platform):
            continue
        module, cls = patch.owner.split(":")
        _wrap(getattr(importlib.import_module(module), cls), patch.method, make, patch.mark)
