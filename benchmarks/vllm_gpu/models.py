"""Weightless model directories (config.json only) for vLLM's ``load_format="dummy"``: real shapes, no hub.

vLLM builds the model from config.json and fills random weights; with ``skip_tokenizer_init=True``
and token-id prompts no tokenizer is needed. ``max_position_embeddings`` is raised to 131072 so a
128k-token context is allowed for Qwen2.5-7B as well (the weights are random anyway).
"""

from __future__ import annotations

import json
from pathlib import Path

#: name -> HF config dict (the public configs' shapes; head_dim 128, GQA 28/4 and 32/8)
CONFIGS: dict[str, dict] = {
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 28,
        "attention_dropout": 0.0,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128009,
        "attention_bias": False,
        "mlp_bias": False,
    },
}


def write_model_dir(name: str, root: str | Path) -> Path:
    """Write ``root/name/config.json`` from CONFIGS[name] and return the directory."""
    if name not in CONFIGS:
        raise KeyError(f"model {name!r}: expected one of {sorted(CONFIGS)}")
    out = Path(root) / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(CONFIGS[name], indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": CONFIGS[name]["eos_token_id"]}))
    return out


#: a multimodal config's placeholder token ids -> their text (Qwen2.5-VL's), written into tiny tokenizers
MM_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "vision_token_id": "<|vision_pad|>",
}


def write_tokenizer(model_dir: str | Path, vocab_size: int = 32000, config: dict | None = None) -> Path:
    """Add a local WordLevel tokenizer (no hub) so ``vllm serve`` can take and return text; a multimodal
    ``config``'s placeholder tokens are special tokens at its ids."""
    from jetson_tq.models.tiny import write_tokenizer_files

    model_dir = Path(model_dir)
    specials = {int(config[k]): text for k, text in MM_TOKENS.items() if k in (config or {})}
    write_tokenizer_files(model_dir, vocab_size, specials)
    return model_dir


def write_image_processor(model_dir: Path, max_pixels: int = 112 * 112) -> None:
    """A Qwen2-VL image processor config (no hub), images resized to at most ``max_pixels`` (a small vision
    encoder profile on CPU)."""
    config = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "min_pixels": 56 * 56,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": 56 * 56, "longest_edge": max_pixels},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "rescale_factor": 1 / 255,
    }
    (model_dir / "preprocessor_config.json").write_text(json.dumps(config, indent=1))


def kv_bytes_per_token(name: str, element_bytes: int = 2) -> int:
    """Bytes one token's K and V take across all layers in a 16-bit cache (the stock figure)."""
    c = CONFIGS[name]
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * element_bytes


# ------------------------------------------------------------------------------------- the model matrix (issue 21)
MATRIX_YAML = Path(__file__).with_name("model_matrix.yaml")


def matrix_models() -> dict[str, dict]:
    """name -> {hf_id, matrix: {layers, ...}, config: the published config.json keys} (model_matrix.yaml)."""
    import yaml

    return yaml.safe_load(MATRIX_YAML.read_text())


def _layer_pattern(config: dict, layers: int) -> dict:
    """Per-layer lists (layer_types, no_rope_layers) cut to ``layers`` entries; other keys unchanged."""
    out = dict(config)
    for key in ("layer_types", "no_rope_layers"):
        if isinstance(out.get(key), list):
            out[key] = out[key][:layers]
    return out


def shrink(
    config: dict,
    layers: int | None = None,
    *,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    intermediate: int | None = None,
    vocab: int | None = None,
    experts: int | None = None,
    vision: dict | None = None,
    pattern: str | None = None,
) -> dict:
    """A copy of a config with fewer layers and, for CPU tests, smaller widths; every attention feature (window
    pattern, soft cap, head-size ratio, MoE routing, M-RoPE sections) kept. Special token ids move below a smaller
    vocab (the multimodal ones to its top). ``vision``: overrides of a vision tower's config (its output width follows
    the language model's); ``pattern``: a hybrid model's layer letters (Nemotron-H's ``hybrid_override_pattern``)."""
    c = _layer_pattern(dict(config), layers or config["num_hidden_layers"])
    c["num_hidden_layers"] = layers or config["num_hidden_layers"]
    if heads is not None:
        c["num_attention_heads"] = heads
        c["num_key_value_heads"] = kv_heads if kv_heads is not None else heads
    if head_dim is not None:
        c["head_dim"] = head_dim
    if hidden is not None:
        c["hidden_size"] = hidden
        if "mamba_num_heads" in c:  # Nemotron-H's Mamba-2 mixers: heads of 16 spanning the width, a small state
            c.update(mamba_head_dim=16, mamba_num_heads=hidden // 16, ssm_state_size=16, chunk_size=32)
            c["n_groups"] = min(c.get("n_groups", 1), 2)
    if intermediate is not None:
        c["intermediate_size"] = intermediate
        if "moe_intermediate_size" in c:
            c["moe_intermediate_size"] = intermediate
    if experts is not None:
        for key in ("num_experts", "num_local_experts"):
            if key in c:
                c[key] = experts
        c["num_experts_per_tok"] = min(c.get("num_experts_per_tok", 2), experts)
    if vocab is not None:
        c["vocab_size"] = vocab
        c.update(bos_token_id=1, eos_token_id=2)
        if "pad_token_id" in c:
            c["pad_token_id"] = 0
        specials = sorted(
            k for k in c if k.endswith("_token_id") and k not in ("bos_token_id", "eos_token_id", "pad_token_id")
        )
        for i, key in enumerate(specials):
            c[key] = vocab - len(specials) + i
    if "query_pre_attn_scalar" in c and head_dim is not None:
        c["query_pre_attn_scalar"] = head_dim  # Gemma scales queries by 1/sqrt(this): the head dim, as published
    rope = c.get("rope_scaling")
    if isinstance(rope, dict) and "mrope_section" in rope:  # M-RoPE sections cover the head's rotary pairs
        pairs = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]) // 2
        rope = dict(rope, mrope_section=_scaled_sections(rope["mrope_section"], pairs))
        c["rope_scaling"] = rope
    if vision and isinstance(c.get("vision_config"), dict):
        c["vision_config"] = {**c["vision_config"], **vision, "out_hidden_size": c["hidden_size"]}
    if "hybrid_override_pattern" in c and pattern is not None:  # Nemotron-H: one letter per layer
        c["hybrid_override_pattern"] = pattern
        c["num_hidden_layers"] = len(pattern)
    return c


def _scaled_sections(sections: list[int], pairs: int) -> list[int]:
    """M-RoPE sections (rotary pairs per position axis) scaled to ``pairs`` in all, each at least 1."""
    total = sum(sections)
    out = [max(1, round(x * pairs / total)) for x in sections]
    out[-1] += pairs - sum(out)
    return out


def write_config_dir(config: dict, out: str | Path, tokenizer_vocab: int | None = None) -> Path:
    """A weightless model directory (config.json, generation_config.json; a local tokenizer when asked)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    eos = config.get("eos_token_id")
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "bos_token_id": config.get("bos_token_id")})
    )
    if tokenizer_vocab:
        write_tokenizer(out, tokenizer_vocab, config)
        if config.get("model_type") in ("qwen2_5_vl", "qwen2_vl"):
            write_image_processor(out)
    return out
