"""``register()``: the ``vllm.general_plugins`` entry point, run by vLLM in each of its processes.

Off (``JETSON_TQ_CONFIG`` unset): logs at debug level and changes nothing, whatever vLLM is installed.
On: checks the vLLM version (UnsupportedPlatformError naming the supported ones), loads the config
(ConfigError for a bad one), overrides the platform's attention backend (CPU_ATTN on CPU, CUSTOM on
CUDA) with ``TurboQuantAttentionBackend`` and installs the hooks.
"""

from __future__ import annotations

import logging

from ... import ops
from . import settings
from .versions import check_vllm_version

_log = logging.getLogger(settings.LOGGER_NAME)


def register() -> None:
    """Hook jetson-tq into vLLM when the switch is on; do nothing otherwise."""
    if not settings.enabled():
        _log.debug("jetson-tq: %s not set, vLLM runs stock", settings.ENV_CONFIG)
        return
    version = check_vllm_version()
    cfg = settings.active_config()
    ops.configured()  # a bad JETSON_TQ_BACKEND fails here, before vLLM builds anything
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from . import hooks
    from .backend import BACKEND_PATH, registered_name

    member = AttentionBackendEnum[registered_name()]
    register_backend(member, BACKEND_PATH)
    hooks.install()
    settings.logger().info(
        "jetson-tq: TurboQuant KV cache '%s' on vLLM %s (backend %s, kernels %s)", cfg.name, version,
        member.name, ops.configured())
