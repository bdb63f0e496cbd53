"""Platform layer: what machine this is (probe), its memory budget, jtop telemetry, and its container image."""

from .detect import KINDS, PlatformInfo, jetpack_for_l4t, parse_tegra_release, probe
from .images import ContainerTarget, container_target, image_tag, vllm_support
from .memory import MemoryBudget, memory_budget, read_meminfo
from .telemetry import jtop_snapshot

__all__ = [
    "KINDS",
    "PlatformInfo",
    "probe",
    "parse_tegra_release",
    "jetpack_for_l4t",
    "MemoryBudget",
    "memory_budget",
    "read_meminfo",
    "jtop_snapshot",
    "ContainerTarget",
    "container_target",
    "image_tag",
    "vllm_support",
]
