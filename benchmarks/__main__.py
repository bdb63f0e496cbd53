"""The one entry point of the benchmark tools: ``python -m benchmarks NAME [ARGS]`` runs benchmarks/NAME.py.

    python -m benchmarks            # list the tools with their one-line summaries
    python -m benchmarks decode --help

Each tool is a script in this folder (or benchmarks/vllm_gpu/ for the vLLM-on-GPU ones, named ``vllm-NAME``);
benchmarks/README.md says what each measures and where its figures are written up.
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: short name -> script (paths relative to this folder)
TOOLS = {
    "decode": "bench_decode.py",
    "prefill": "bench_prefill.py",
    "flash-plan": "bench_flash_plan.py",
    "flash-step": "bench_flash_step.py",
    "compress": "bench_compress.py",
    "api": "bench_api.py",
    "scores": "bench_scores.py",
    "generate": "bench_generate.py",
    "suite": "gpu_suite.py",
    "targets": "targets.py",
    "jetson-projection": "jetson_projection.py",
    "architecture": "architecture.py",
    "sweep-decode": "sweep_decode.py",
    "profile-api": "profile_api.py",
    "profile-decode": "profile_decode.py",
    "compile-sm90": "compile_sm90.py",
    "fidelity": "fidelity.py",
    "smartmix": "smartmix.py",
    "sink-spread": "sink_spread.py",
    "vllm-run": "vllm_gpu/run.py",
    "vllm-bundle": "vllm_gpu/bundle.py",
    "vllm-profile-step": "vllm_gpu/profile_step.py",
    "vllm-sched": "vllm_gpu/sched_compare.py",
    "vllm-repro-cost": "vllm_gpu/repro_cost.py",
    "vllm-simulate-cuda": "vllm_gpu/simulate_cuda.py",
}


def summary(script: Path) -> str:
    """The first line of a script's module docstring."""
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    return doc.splitlines()[0] if doc else ""


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        width = max(map(len, TOOLS))
        print("usage: python -m benchmarks NAME [ARGS]   (NAME --help for a tool's options)\n")
        for name, script in TOOLS.items():
            print(f"  {name:<{width}}  {summary(HERE / script)}")
        return 0
    name, args = argv[0], argv[1:]
    if name not in TOOLS:
        print(f"python -m benchmarks: unknown tool {name!r}; expected one of {', '.join(TOOLS)}", file=sys.stderr)
        return 2
    script = HERE / TOOLS[name]
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
