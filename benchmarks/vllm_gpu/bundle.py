"""Build the vLLM 0.26.0 bundle for the GPU machine (no network there): slim vLLM tar + dependency wheels.

    python benchmarks/vllm_gpu/bundle.py [--dir .devwork/vllm_bundle] [--with-c] [--with-moe] [--no-fa3] [--parts-only]

Runs on a machine with package-index access. Downloads the ``vllm==0.26.0`` manylinux x86_64 wheel
with ``pip download --no-deps``, writes ``vllm-core.tar.gz`` from its members minus what a bf16
dense model on Hopper under TRITON_ATTN does not need (FA2/FA3, the MoE ops, vllm-rs, other
Pythons' deep_gemm builds, CUTLASS headers for JIT) and, by default, minus the 79 MB CUDA op library
``_C_stable_libtorch.abi3.so`` (56 MB even with xz: with it one device call cannot carry the rest),
then downloads cp312 wheels of the pure-Python / binary dependencies the GPU image lacks (DEPS,
found by importing vLLM with ``--no-deps`` in a scratch venv). Parts are at most 60 MB.
FlashAttention 3 goes in its own part ``vllm-fa3.tar.xz`` (153 MB -> 10.6 MB; ``--no-fa3`` skips it);
``--with-c`` writes the op library as an optional part too (78.8 MB -> 55.8 MB with xz -9e: it does not fit one
call with the rest) and ``--with-moe`` the MoE op library (``_moe_C_stable_libtorch``: 47.5 MB -> 40.4 MB; vLLM's
fused-MoE layer calls its ``topk_softmax``, ``moe_align_block_size`` and ``moe_sum`` on every MoE model). Each
optional part comes with a ``.sha256`` file; such parts travel in device calls of their own
(``benchmarks/vllm_gpu/parts.py``, ``snapshot.sh``). ``--parts-only`` writes only the optional parts asked for
(the core tar, the wheels and the other parts stay; no network when the vLLM wheel is already downloaded).
The directory is git-ignored (``.devwork/``); nothing here is committed.
"""

from __future__ import annotations

import argparse
import fnmatch
import io
import json
import lzma
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import parts

VLLM = "vllm==0.26.0"
PART_BYTES = 60 * 10**6
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"] + [
    a
    for p in (
        "manylinux_2_28_x86_64",
        "manylinux_2_27_x86_64",
        "manylinux_2_24_x86_64",
        "manylinux_2_17_x86_64",
        "manylinux2014_x86_64",
        "manylinux_2_5_x86_64",
        "manylinux1_x86_64",
        "manylinux_2_31_x86_64",
        "manylinux_2_34_x86_64",
        "manylinux_2_35_x86_64",
    )
    for a in ("--platform", p)
]
#: wheel members left out of the core tar (fnmatch patterns)
DROP = [
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
    "vllm/_moe_C_stable_libtorch.abi3.so",
    "vllm/_C_stable_libtorch.abi3.so",
    "vllm/vllm-rs",
    "vllm/third_party/deep_gemm/_C.cpython-310-*",
    "vllm/third_party/deep_gemm/_C.cpython-311-*",
    "vllm/third_party/deep_gemm/_C.cpython-313-*",
    "vllm/third_party/deep_gemm/_C.cpython-314-*",
    "vllm/third_party/deep_gemm/include/*",
    "vllm/third_party/fmha_sm100/cutlass/*",
    "vllm/third_party/fmha_sm100/csrc/*",
]
#: optional part key -> the member it holds (vllm-KEY.tar.xz; parts.py moves and unpacks them)
OPTIONAL = parts.MEMBERS
#: what `import vllm.entrypoints.llm` and an offline LLM(...) need beyond the GPU image's packages
#: (KINDS.md list), with versions inside vllm 0.26.0's Requires-Dist
DEPS = [
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "msgspec==0.23.0",
    "pyzmq==27.3.0",
    "cachetools==8.0.2",
    "cbor2==6.3.0",
    "pybase64==1.5.1",
    "blake3==1.0.11",
    "setproctitle==1.3.8",
    "openai==3.57.0",
    "httpx2==2.16.2",
    "sniffio==1.3.1",
    "distro==1.9.0",
    "jiter==0.19.0",
    "openai-harmony==0.0.8",
    "llguidance==1.7.6",
    "apache-tvm-ffi==0.1.10",
    # xgrammar >= 0.2.7 needs a newer tvm-ffi than the 0.1.10 vllm pins (load_lib_module(extra_lib_paths=...))
    "xgrammar==0.2.6",
    # `from vllm import LLM` reaches vllm.entrypoints.serve (fastapi) through the pooling mixin; the rest is
    # what `import vllm.entrypoints.openai.api_server` (vllm serve) needs
    "fastapi==0.136.3",
    "starlette==1.10.0",
    "uvicorn==0.54.0",
    "watchfiles==1.3.0",
    "partial-json-parser==0.2.1.1.post7",
    "model-hosting-container-standards==0.1.16",
    "jmespath==1.1.0",
    # the OpenAI server's /metrics route (vllm serve dies at start-up without it; prometheus-client is in the image)
    "prometheus-fastapi-instrumentator==8.1.0",
]
#: Python packages of the GPU image ('cuda', /work/.library/device/KINDS.md, read there 2026-11-17): the bundle
#: carries only what vLLM imports beyond these (checked on CPU: tests/integrations/vllm/test_serve_imports.py)
GPU_IMAGE = (
    "absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi "
    "charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core "
    "cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock "
    "flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx "
    "huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin "
    "jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax "
    "llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack "
    "multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro "
    "nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft "
    "nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py "
    "nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript "
    "opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec "
    "patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 "
    "py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock "
    "pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu "
    "safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers "
    "setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard "
    "tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio "
    "torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer "
    "typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"
).split()


def dist_name(requirement: str) -> str:
    """'pydantic-core==2.50.5' -> 'pydantic-core' (PEP 503 normalized: lower case, runs of -_. as one -)."""
    import re

    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]).lower()


def link_site(allowed: set[str], out: Path, search: list[str] | None = None) -> set[str]:
    """Link into ``out`` every installed distribution named in ``allowed`` (its top-level modules and dist-info):
    a site with exactly those packages, for an import check without network. Returns the names linked."""
    import importlib.metadata as md

    out.mkdir(parents=True, exist_ok=True)
    linked: set[str] = set()
    for dist in md.distributions(path=search) if search is not None else md.distributions():
        name = dist_name(dist.metadata["Name"] or "")
        if name not in allowed or name in linked:
            continue
        root = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in (dist.files or []) if not str(f).startswith("..")}
        for top in tops:
            src = root / top
            if src.exists() and not (out / top).exists():
                (out / top).symlink_to(src)
        linked.add(name)
    return linked


#: files added to the core tar: (path in the tar, source next to this script)
STUBS = {"vllm/_C_stable_libtorch.py": "c_stub.py"}
#: textual patches of vLLM members: path -> (old, new). Without FA2/FA3 vllm_flash_attn raises at import,
#: and on CUDA fa_utils imports it unconditionally (every model import reaches it): keep the flags False.
PATCHES = {
    "vllm/vllm_flash_attn/__init__.py": (
        "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise ImportError(",
        "if False and not (FA2_AVAILABLE or FA3_AVAILABLE):  # jetson-tq bundle: FA left out\n    raise ImportError(",
    ),
    # vLLM's built-in TurboQuant forces FA2 for its boundary layers and prefill; FA2 (304 MB, 85 MB with xz) does
    # not fit a device call, FA3 does. The check the override guards against (FA metadata builders asserting
    # FlashAttentionImpl) skips non-FA layers in 0.26 (`_get_sliding_window_configs`), so FA3 is used instead.
    "vllm/engine/arg_utils.py": (
        'if resolved_cache_dtype.startswith("turboquant_") and (',
        'if False and resolved_cache_dtype.startswith("turboquant_") and (  # jetson-tq bundle: FA3, not FA2',
    ),
    # The bundle has no C++ op library (its stand-in raises a named error): engines that do not choose their
    # custom ops (eager, no Inductor: vLLM picks "all" and vllm_c kernels) get PyTorch's native ops instead,
    # as run.py's jobs ask explicitly — so the tests' own engines (tests/integrations/vllm/test_vllm_scheduling.py) run
    # too.
    "vllm/config/vllm.py": (
        'self.compilation_config.custom_ops.append("all")',
        'self.compilation_config.custom_ops.append("none")  # jetson-tq bundle: no C++ op library',
    ),
    "vllm/platforms/cuda.py": (
        'default = ["native"] if using_inductor else ["vllm_c", "native"]',
        'default = ["native"]  # jetson-tq bundle: no vllm_c op library',
    ),
}


def pip(*args: str) -> None:
    """Run pip of this interpreter (raises on failure)."""
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def dropped(name: str, keep: set[str]) -> bool:
    """True when a wheel member stays out of the core tar (optional libraries named in keep stay in)."""
    return name not in keep and any(fnmatch.fnmatch(name, p) for p in DROP)


def patched(name: str, data: bytes) -> bytes:
    """A member's bytes after PATCHES (ValueError when a patch no longer applies: wrong vLLM version)."""
    if name not in PATCHES:
        return data
    old, new = PATCHES[name]
    text = data.decode()
    if text.count(old) != 1:
        raise ValueError(f"{name}: expected exactly one {old!r} to patch, found {text.count(old)}")
    return text.replace(old, new).encode()


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime = len(data), mode, 0
    tar.addfile(ti, io.BytesIO(data))


def write_tar(whl: Path, out: Path, select, mode: str = "w:gz", stubs: bool = True) -> int:
    """Write the members accepted by ``select`` (patched) plus STUBS into a tar (xz at -9e, the smallest for the
    op libraries' CUDA code); returns uncompressed bytes."""
    total = 0
    opts = {"preset": 9 | lzma.PRESET_EXTREME} if mode == "w:xz" else {}
    with zipfile.ZipFile(whl) as z, tarfile.open(out, mode, **opts) as tar:
        for info in z.infolist():
            if info.is_dir() or not select(info.filename):
                continue
            data = patched(info.filename, z.read(info))
            _add(tar, info.filename, data, 0o755 if info.filename.endswith(".so") else 0o644)
            total += len(data)
        for name, src in STUBS.items() if stubs else ():
            data = (Path(__file__).parent / src).read_bytes()
            _add(tar, name, data)
            total += len(data)
    return total


def split(path: Path) -> list[Path]:
    """Split a file into <= PART_BYTES pieces (path.partNN); the whole file is removed."""
    data_parts = []
    with open(path, "rb") as f:
        i = 0
        while chunk := f.read(PART_BYTES):
            p = path.with_name(f"{path.name}.part{i:02d}")
            p.write_bytes(chunk)
            data_parts.append(p)
            i += 1
    path.unlink()
    return data_parts


def write_optional(whl: Path, d: Path, key: str) -> list[Path]:
    """``vllm-KEY.tar.xz`` (split when over PART_BYTES) and its ``.sha256``; returns the pieces."""
    for old in d.glob(f"vllm-{key}.tar.xz*"):
        old.unlink()
    opt = d / f"vllm-{key}.tar.xz"
    write_tar(whl, opt, lambda n, m=OPTIONAL[key]: n == m, mode="w:xz", stubs=False)
    pieces = split(opt) if opt.stat().st_size > PART_BYTES else [opt]
    parts.write_checksums(pieces)
    return pieces


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path(".devwork/vllm_bundle"))
    ap.add_argument("--with-c", action="store_true", help="also write vllm-c.tar.xz (CUDA op library, 55.8 MB)")
    ap.add_argument("--with-moe", action="store_true", help="also write vllm-moe.tar.xz (MoE op library, 40.4 MB)")
    ap.add_argument(
        "--no-fa3",
        dest="with_fa3",
        action="store_false",
        help="leave out vllm-fa3.tar.xz (FlashAttention 3: 10.6 MB with xz; vLLM's TurboQuant prefill and "
        "the FLASH_ATTN stock baseline need it)",
    )
    ap.add_argument(
        "--parts-only", action="store_true", help="write only --with-c / --with-moe parts; keep the rest (FA3 too)"
    )
    args = ap.parse_args()
    d = args.dir
    dl, wheels = d / "download", d / "wheels"
    dl.mkdir(parents=True, exist_ok=True)
    wheels.mkdir(parents=True, exist_ok=True)
    t = time.time()
    whl = dl / "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    if not whl.exists():
        pip("download", "--no-deps", *PLATFORM, "-d", str(dl), VLLM)
    keys = [k for k in OPTIONAL if getattr(args, f"with_{k}")]
    if args.parts_only:
        if not (d / "manifest.json").exists():
            raise SystemExit(f"--parts-only: no {d / 'manifest.json'}; build the whole bundle first")
        manifest = json.loads((d / "manifest.json").read_text())
        keys = [k for k in keys if k != "fa3"]  # the FA3 part of the full build stays as it is
    else:
        for old in d.glob("vllm-*.tar*"):
            old.unlink()
        core = d / "vllm-core.tar.gz"
        raw = write_tar(whl, core, lambda n: not dropped(n, set()))
        manifest = {
            "vllm": VLLM,
            "wheel_bytes": whl.stat().st_size,
            "core_uncompressed": raw,
            "core_bytes": core.stat().st_size,
            "dropped": DROP,
        }
        core_parts = split(core) if core.stat().st_size > PART_BYTES else [core]
        manifest["core_parts"] = [p.name for p in core_parts]
    for key in keys:
        manifest[f"optional_{key}"] = [p.name for p in write_optional(whl, d, key)]
    if not args.parts_only:
        for old in wheels.glob("*.whl"):
            old.unlink()
        pip("download", "--no-deps", *PLATFORM, "-d", str(wheels), *DEPS)
        manifest["wheels"] = sorted(p.name for p in wheels.glob("*.whl"))
        manifest["wheel_bytes_total"] = sum(p.stat().st_size for p in wheels.glob("*.whl"))
    files = [p for p in sorted(d.glob("vllm-*.tar*")) if not p.name.endswith(".sha256")] + sorted(wheels.glob("*.whl"))
    manifest["sha256"] = {p.name: parts.sha256(p) for p in files}
    manifest["bytes"] = {p.name: p.stat().st_size for p in files if p.name.startswith("vllm-")}
    manifest["build_s"] = round(time.time() - t, 1)
    (d / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(json.dumps({k: v for k, v in manifest.items() if k not in ("sha256", "dropped")}, indent=1))


if __name__ == "__main__":
    main()
