"""Several vLLM engines at once for the end-to-end tests (each in its own process, so start-ups overlap)."""

from __future__ import annotations

import os
import random

from lab.vllm_compare import run_engine_subprocess, run_engines_in_one_process

PORTS_PER_ENGINE = 100  # each engine scans upward from its own base, below Linux's ephemeral range (32768+)


def _at_once(tasks: dict[str, tuple], run, env: dict | None, timeout: float) -> dict[str, dict]:
    """name -> ``run(*args, env, timeout)`` for each name -> args, all at once in threads (each starting its own
    process), each with its own ``VLLM_PORT`` range so that two start-ups never race for the same port."""
    from concurrent.futures import ThreadPoolExecutor

    base_env = dict(os.environ if env is None else env)
    first_port = random.Random().randrange(20000, 32000 - PORTS_PER_ENGINE * len(tasks), PORTS_PER_ENGINE)
    with ThreadPoolExecutor(max(1, len(tasks))) as pool:
        futures = {
            name: pool.submit(run, *args, dict(base_env, VLLM_PORT=str(first_port + PORTS_PER_ENGINE * i)), timeout)
            for i, (name, args) in enumerate(tasks.items())
        }
        return {name: f.result() for name, f in futures.items()}


def run_engines_side_by_side(
    runs: dict[str, tuple[dict, str | None]], env: dict | None = None, timeout: float = 900
) -> dict[str, dict]:
    """name -> (job, config) run by ``run_engine_subprocess`` at once (independent processes: start-ups overlap)."""
    return _at_once(runs, run_engine_subprocess, env, timeout)


def run_engine_groups_side_by_side(
    groups: dict[str, tuple[dict[str, dict], str | None]], env: dict | None = None, timeout: float = 900
) -> dict[str, dict[str, dict]]:
    """name -> (jobs, config): each group's engines one after another in one process (vLLM imported once per
    config, ``run_engines_in_one_process``), the groups at once."""
    return _at_once(groups, run_engines_in_one_process, env, timeout)
