"""What machine are we on? A probe that never raises: Jetson Thor / Orin, discrete CUDA GPU, or CPU only.

Sources, in order: ``/etc/nv_tegra_release`` (L4T release -> JetPack), ``/proc/device-tree/model`` or
its copy ``/tmp/nv_jetson_model`` inside a container, ``nvidia-smi`` (with a timeout: it can be slow,
and on Orin/JetPack 6 it is a stub), then torch. Every failure is recorded in ``errors`` instead of
raised, so the launcher, the demo and the capacity report always get an answer.

``JETSON_TQ_SYSROOT`` (default ``/``) prefixes every file read here: tests point it at fake boards.
"""

from __future__ import annotations

import os
import platform as _stdplatform
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import env

KINDS = ("thor", "orin", "jetson", "cuda-dgpu", "cpu")
NVIDIA_SMI_TIMEOUT_S = 10.0

#: L4T release -> JetPack version (NVIDIA's JetPack archive).
_JETPACK_EXACT = {
    "38.2": "7.0",
    "38.4": "7.1",
    "36.4.0": "6.1",
    "36.4.3": "6.2",
    "36.4.4": "6.2.1",
    "36.3": "6.0",
    "36.2": "6.0 DP",
}
#: Compute capability of the Jetson GPUs, used when torch cannot tell (no CUDA build in a venv).
_JETSON_CC = {"thor": "11.0", "orin": "8.7"}


@dataclass
class PlatformInfo:
    """Everything the launcher, the memory budget and the reports need to know about this machine."""

    kind: str = "cpu"  # one of KINDS
    arch: str = ""  # uname machine: aarch64, x86_64
    l4t: str | None = None  # "38.2.0"
    jetpack: str | None = None  # "7.0"
    board: str | None = None  # "NVIDIA Jetson AGX Thor Developer Kit"
    gpu_name: str | None = None
    compute_capability: str | None = None  # "11.0"
    integrated: bool = False  # GPU shares system RAM (Jetson)
    gpu_memory_bytes: int | None = None
    cuda_available: bool = False  # torch sees a CUDA device
    torch_version: str | None = None
    in_container: bool = False
    sources: dict[str, str] = field(default_factory=dict)  # which file/tool told us what
    errors: list[str] = field(default_factory=list)  # what failed (never raised)

    @property
    def is_jetson(self) -> bool:
        return self.kind in ("thor", "orin", "jetson")

    @property
    def l4t_major(self) -> int | None:
        return int(self.l4t.split(".")[0]) if self.l4t else None

    def to_dict(self) -> dict:
        return asdict(self)


def sysroot() -> Path:
    """Root prefix of the files the probe reads (``JETSON_TQ_SYSROOT``, default /)."""
    return env.read().sysroot


def parse_tegra_release(text: str) -> str | None:
    """First line ``# R38 (release), REVISION: 2.0, ...`` -> ``"38.2.0"`` (None if it does not parse)."""
    m = re.match(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text.strip())
    if not m:
        return None
    parts = [m.group(1)] + m.group(2).split(".")
    while len(parts) < 3:
        parts.append("0")
    return ".".join(parts[:3])


def jetpack_for_l4t(l4t: str | None) -> str | None:
    """JetPack version of an L4T release ("39.x" -> "7.2"); None when unknown."""
    if not l4t:
        return None
    major, minor, patch = (l4t.split(".") + ["0", "0"])[:3]
    if major == "39":
        return "7.2"
    for key in (f"{major}.{minor}.{patch}", f"{major}.{minor}"):
        if key in _JETPACK_EXACT:
            return _JETPACK_EXACT[key]
    if major == "35":
        return "5.1"
    return None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_bytes().replace(b"\x00", b"").decode(errors="replace").strip() or None
    except OSError:
        return None


def _kind_from_names(*names: str | None) -> str | None:
    text = " ".join(n for n in names if n).lower()
    if "thor" in text:
        return "thor"
    if "orin" in text:
        return "orin"
    return None


def _query_nvidia_smi(info: PlatformInfo) -> None:
    """Fill GPU name / compute capability / memory from nvidia-smi (missing or slow -> an error note)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        info.sources["nvidia-smi"] = "not found"
        return
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError) as e:
        info.errors.append(f"nvidia-smi: {type(e).__name__}: {e}")
        return
    line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    if not line:
        info.errors.append(f"nvidia-smi: exit {out.returncode}, no GPU listed")
        return
    cells = [c.strip() for c in line.split(",")]
    info.gpu_name = info.gpu_name or cells[0]
    info.sources["gpu_name"] = info.sources.get("gpu_name", "nvidia-smi")
    if len(cells) > 1 and re.fullmatch(r"\d+\.\d+", cells[1]):
        info.compute_capability = info.compute_capability or cells[1]
    if len(cells) > 2 and cells[2].isdigit():  # MiB; "[N/A]" / "Not Supported" on Jetson
        info.gpu_memory_bytes = int(cells[2]) * 2**20


def _query_torch(info: PlatformInfo) -> None:
    """Fill CUDA facts from torch when it is importable (a Jetson host without a venv has none)."""
    try:
        import torch
    except Exception as e:
        info.sources["torch"] = f"not importable ({type(e).__name__})"
        return
    info.torch_version = torch.__version__
    try:
        if not torch.cuda.is_available():
            return
        props = torch.cuda.get_device_properties(0)
        info.cuda_available = True
        info.gpu_name = props.name
        info.sources["gpu_name"] = "torch"
        info.compute_capability = f"{props.major}.{props.minor}"
        info.gpu_memory_bytes = int(props.total_memory)
        info.integrated = info.integrated or bool(getattr(props, "is_integrated", False))
    except Exception as e:
        info.errors.append(f"torch.cuda: {type(e).__name__}: {e}")


def probe(root: str | os.PathLike | None = None, use_torch: bool = True) -> PlatformInfo:
    """Describe this machine; never raises (failures land in ``PlatformInfo.errors``)."""
    info = PlatformInfo()
    try:
        _probe_into(info, Path(root) if root is not None else sysroot(), use_torch)
    except Exception as e:
        info.errors.append(f"probe: {type(e).__name__}: {e}")
    return info


def _probe_into(info: PlatformInfo, root: Path, use_torch: bool) -> None:
    info.arch = _stdplatform.machine()
    info.in_container = (root / ".dockerenv").exists() or (root / "run/.containerenv").exists()
    release = _read_text(root / "etc/nv_tegra_release")
    if release is not None:
        info.sources["l4t"] = "/etc/nv_tegra_release"
        info.l4t = parse_tegra_release(release)
        if info.l4t is None:
            info.errors.append(f"/etc/nv_tegra_release: unrecognised first line {release.splitlines()[0]!r}")
        info.jetpack = jetpack_for_l4t(info.l4t)
    for path in ("proc/device-tree/model", "tmp/nv_jetson_model"):
        board = _read_text(root / path)
        if board:
            info.board, info.sources["board"] = board, "/" + path
            break
    if release is None and not (info.board and "jetson" in info.board.lower()):
        # Not a Jetson: a discrete GPU if nvidia-smi or torch sees one, else CPU.
        _query_nvidia_smi(info)
        if use_torch:
            _query_torch(info)
        info.kind = "cuda-dgpu" if (info.gpu_name or info.cuda_available) else "cpu"
        return
    info.integrated = True
    _query_nvidia_smi(info)
    if use_torch:
        _query_torch(info)
    kind = _kind_from_names(info.board) or _kind_from_names(info.gpu_name)
    if kind is None and info.l4t_major == 38:
        kind = "thor"  # L4T r38 (JetPack 7.0/7.1) ships for Thor only
    if kind is None and info.l4t_major == 36:
        kind = "orin"  # JetPack 6 supports the Orin family only
    info.kind = kind or "jetson"
    if info.compute_capability is None and info.kind in _JETSON_CC:
        info.compute_capability = _JETSON_CC[info.kind]
        info.sources["compute_capability"] = "known for this board"
