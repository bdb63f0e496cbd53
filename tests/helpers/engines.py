"""Several vLLM engines at once for the end-to-end tests (each in its own process, so start-ups overlap)."""

from __future__ import annotations

import os
import random

from jetson_tq.integrations.vllm.compare import run_engine_subprocess

PORTS_PER_ENGINE = 100  # each engine scans upward from its own base, below Linux's ephemeral range (32768+)


def run_engines_side_by_side(
    runs: dict[str, tuple[dict, str | None]], env: dict | None = None, timeout: float = 900
) -> dict[str, dict]:
    """name -> (job, config) run by ``run_engine_subprocess`` at once (independent processes: start-ups overlap).
    Each engine gets its own ``VLLM_PORT`` range so that two start-ups never race for the same port."""
    from concurrent.futures import ThreadPoolExecutor

    base_env = dict(os.environ if env is None else env)
    first_port = random.Random().randrange(20000, 32000 - PORTS_PER_ENGINE * len(runs), PORTS_PER_ENGINE)
    with ThreadPoolExecutor(max(1, len(runs))) as pool:
        futures = {
            name: pool.submit(
                run_engine_subprocess,
                job,
                cfg,
                dict(base_env, VLLM_PORT=str(first_port + PORTS_PER_ENGINE * i)),
                timeout,
            )
            for i, (name, (job, cfg)) in enumerate(runs.items())
        }
        return {name: f.result() for name, f in futures.items()}


def run_engine_groups_side_by_side(
    groups: dict[str, tuple[dict[str, dict], str | None]], env: dict | None = None, timeout: float = 900
) -> dict[str, dict[str, dict]]:
    """name -> (jobs, config): each group's engines one after another in one process (vLLM imported once per
    config, ``run_engines_in_one_process``), the groups at once, each with its own ``VLLM_PORT`` range."""
    from concurrent.futures import ThreadPoolExecutor

    from jetson_tq.integrations.vllm.compare import run_engines_in_one_process

    base_env = dict(os.environ if env is None else env)
    first_port = random.Random().randrange(20000, 32000 - PORTS_PER_ENGINE * len(groups), PORTS_PER_ENGINE)
    with ThreadPoolExecutor(max(1, len(groups))) as pool:
        futures = {
            name: pool.submit(
                run_engines_in_one_process,
                jobs,
                cfg,
                dict(base_env, VLLM_PORT=str(first_port + PORTS_PER_ENGINE * i)),
                timeout,
            )
            for i, (name, (jobs, cfg)) in enumerate(groups.items())
        }
        return {name: f.result() for name, f in futures.items()}
