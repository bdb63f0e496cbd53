"""Kernel vs reference agreement and a decode micro-benchmark vs SDPA, through the public API (``jetson_tq.api``).

The entry module (``attention_decode(q, cache, backend="auto"|"triton"|"reference")``, the public API by default; tests
pass stand-ins) is imported lazily: when it is absent, ``load_dispatch`` returns None and callers report SKIPPED, never
a pass. On a CPU machine the Triton kernel runs through the Triton interpreter: ``TRITON_INTERPRET=1`` must be set
before triton is first imported, so ``agreement_cpu_interpreted`` runs the check in a child process with that variable
set, on a tiny shape.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from jetson_tq.cache.compressed import CompressedKVCache
from jetson_tq.config import DEFAULT_PRESET, load_config

DISPATCH_MODULE = "jetson_tq.api"
#: Agreement tolerance: fp16 outputs (ulp ~1e-3 at 1.0) of O(1) values, fp32 accumulation in both paths,
#: the same packed cache read by both (so only summation order and the final cast differ).
TOL_MAX_ABS = 1e-2
TOL_MEAN_ABS = 1e-3
#: Tiny CPU shape for the interpreter: two ragged sequences, one with compressed history + buffer, one buffer-only.
CPU_SHAPE = {"batch": 2, "q_heads": 4, "kv_heads": 2, "head_dim": 64, "lengths": [200, 70]}
GPU_SHAPE = {"batch": 2, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "lengths": [3000, 777]}
INTERPRETER_TIMEOUT_S = 600


def load_dispatch(module: str = DISPATCH_MODULE):
    """The dispatch module, or None when it is not in this build (other import errors propagate)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            return None
        raise


def build_case(shape: dict, device: str | torch.device, config: str = DEFAULT_PRESET, seed: int = 0):
    """A filled cache (ragged lengths) and a decode query for ``shape``."""
    g = torch.Generator().manual_seed(seed)
    fmt = load_config(config).default
    b, hq, hkv, d = shape["batch"], shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    cache = CompressedKVCache(fmt, hkv, d, b, device=device, dtype=torch.float16, seed=seed)
    for i, n in enumerate(shape["lengths"]):
        k = torch.randn(hkv, n, d, generator=g).to(device=device, dtype=torch.float16)
        v = torch.randn(hkv, n, d, generator=g).to(device=device, dtype=torch.float16)
        cache.append(k, v, seq=i)
    q = torch.randn(b, hq, d, generator=g).to(device=device, dtype=torch.float16)
    return q, cache


def agreement(dispatch, shape: dict, device: str | torch.device) -> dict:
    """max/mean |triton - reference| of one decode step on ``shape`` (reference = attention.reference)."""
    q, cache = build_case(shape, device)
    ref = dispatch.attention_decode(q, cache, backend="reference").float()
    out = dispatch.attention_decode(q, cache, backend="triton").float()
    diff = (out - ref).abs()
    return {
        "device": str(device),
        "shape": shape,
        "max_abs": float(diff.max()),
        "mean_abs": float(diff.mean()),
        "ref_max_abs": float(ref.abs().max()),
        "tol_max_abs": TOL_MAX_ABS,
        "tol_mean_abs": TOL_MEAN_ABS,
        "ok": float(diff.max()) <= TOL_MAX_ABS and float(diff.mean()) <= TOL_MEAN_ABS,
    }


def agreement_cpu_interpreted(
    module: str = DISPATCH_MODULE, shape: dict | None = None, timeout_s: float = INTERPRETER_TIMEOUT_S
) -> dict:
    """Run ``agreement`` on CPU in a child with TRITON_INTERPRET=1 (set before triton is imported)."""
    root = Path(__file__).resolve().parents[2]
    env = {
        "OMP_NUM_THREADS": "1",
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p),
    }
    code = (
        "import json, sys; from lab.reports.kernel_check import _child; "
        "print(json.dumps(_child(sys.argv[1], json.loads(sys.argv[2]))))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, module, json.dumps(shape or CPU_SHAPE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=root,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"ok": False, "error": f"interpreter child exit {proc.returncode}: {proc.stderr.strip()[-800:]}"}
    return json.loads(lines[-1])


def _child(module: str, shape: dict) -> dict:
    """Entry point of the interpreter child (TRITON_INTERPRET=1 already in the environment)."""
    dispatch = load_dispatch(module)
    if dispatch is None:
        return {"ok": False, "skipped": True, "error": f"{module} missing"}
    result = agreement(dispatch, shape, "cpu")
    result["triton_interpret"] = os.environ.get("TRITON_INTERPRET")
    return result


def decode_benchmark(
    dispatch,
    contexts=(4096, 16384),
    batch: int = 1,
    q_heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    progress=None,
) -> list[dict]:
    """Median µs of ``attention_decode(backend="triton")`` vs torch SDPA (flash) on fp16 K/V of the same shape
    (CUDA)."""
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    rows = []
    for i, ctx in enumerate(contexts):
        shape = {
            "batch": batch,
            "q_heads": q_heads,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "lengths": [ctx] * batch,
        }
        q, cache = build_case(shape, "cuda", seed=i)
        ref = dispatch.attention_decode(q, cache, backend="reference").float()
        max_abs = float((dispatch.attention_decode(q, cache, backend="triton").float() - ref).abs().max())
        k = torch.randn(batch, kv_heads, ctx, head_dim, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        q4 = q.unsqueeze(2)
        backend = "flash"
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                scaled_dot_product_attention(q4, k, v, enable_gqa=True)
        except RuntimeError:
            backend = "default"

        # sdpa and the lambda below run inside this iteration (do_bench), so the loop's current values are meant
        def sdpa():
            if backend == "flash":  # noqa: B023
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return scaled_dot_product_attention(q4, k, v, enable_gqa=True)  # noqa: B023
            return scaled_dot_product_attention(q4, k, v, enable_gqa=True)  # noqa: B023

        cache.validate = False  # timed: the kernel, not the per-call query check (docs/robustness.md)
        t_tq = triton.testing.do_bench(
            lambda: dispatch.attention_decode(q, cache, backend="triton"),  # noqa: B023 (timed in this iteration)
            return_mode="median",
        )
        t_sdpa = triton.testing.do_bench(sdpa, return_mode="median")
        rows.append(
            {
                "context": ctx,
                "batch": batch,
                "q_heads": q_heads,
                "kv_heads": kv_heads,
                "head_dim": head_dim,
                "triton_us": t_tq * 1e3,
                "sdpa_us": t_sdpa * 1e3,
                "sdpa_backend": backend,
                "speedup_vs_sdpa": t_sdpa / t_tq,
                "max_abs_vs_reference": max_abs,
                "gpu": torch.cuda.get_device_name(0),
            }
        )
        if progress:
            progress(i + 1, len(contexts), f"ctx {ctx}")
    return rows
