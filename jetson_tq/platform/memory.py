"""How many bytes can the KV cache and the weights use on this machine?

- integrated GPU (Jetson): ``MemAvailable`` from /proc/meminfo. CPU and GPU share the RAM, and
  ``torch.cuda.mem_get_info`` on Tegra leaves out reclaimable page cache (vLLM also budgets from
  available RAM there).
- discrete GPU: ``torch.cuda.mem_get_info()`` free bytes of device 0.
- CPU only: available RAM (``MemAvailable``, else psutil).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from .detect import PlatformInfo, sysroot


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes available to a model on this machine, and where the figure came from."""

    source: str  # "MemAvailable" | "cuda.mem_get_info" | "RAM" | "none"
    available_bytes: int | None
    total_bytes: int | None
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def read_meminfo(root: str | os.PathLike | None = None) -> dict[str, int]:
    """/proc/meminfo as {key: bytes} (empty when unreadable)."""
    path = Path(root if root is not None else sysroot()) / "proc/meminfo"
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key.strip()] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        return {}
    return out


def _ram_budget(root, note: str) -> MemoryBudget:
    info = read_meminfo(root)
    if "MemAvailable" in info:
        return MemoryBudget("MemAvailable", info["MemAvailable"], info.get("MemTotal"), note)
    try:
        import psutil

        vm = psutil.virtual_memory()
        return MemoryBudget("RAM", int(vm.available), int(vm.total), note + " (psutil)")
    except Exception as e:
        return MemoryBudget("none", None, None, f"no /proc/meminfo and psutil failed: {e}")


def _default_mem_get_info() -> tuple[int, int]:
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(free), int(total)


def memory_budget(
    info: PlatformInfo,
    root: str | os.PathLike | None = None,
    cuda_mem_get_info: Callable[[], tuple[int, int]] | None = None,
) -> MemoryBudget:
    """The memory budget of this platform (never raises: a failure gives ``available_bytes=None``)."""
    if info.integrated:
        return _ram_budget(root, "unified memory: MemAvailable (CPU and GPU share it)")
    if info.kind == "cuda-dgpu":
        try:
            free, total = (cuda_mem_get_info or _default_mem_get_info)()
            return MemoryBudget("cuda.mem_get_info", free, total, "discrete GPU: free device memory")
        except Exception as e:
            return MemoryBudget(
                "none",
                None,
                info.gpu_memory_bytes,
                f"discrete GPU but torch.cuda.mem_get_info failed ({type(e).__name__}: {e})",
            )
    return _ram_budget(root, "CPU only: available RAM")
