"""Several vLLM engines at once for the end-to-end tests (each in its own process, so start-ups overlap)."""

from __future__ import annotations

from jetson_tq.integrations.vllm.compare import run_engine_subprocess


def run_engines_side_by_side(
    runs: dict[str, tuple[dict, str | None]], env: dict | None = None, timeout: float = 900
) -> dict[str, dict]:
    """name -> (job, config) run by ``run_engine_subprocess`` at once (independent processes: start-ups overlap)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, len(runs))) as pool:
        futures = {
            name: pool.submit(run_engine_subprocess, job, cfg, env, timeout) for name, (job, cfg) in runs.items()
        }
        return {name: f.result() for name, f in futures.items()}
