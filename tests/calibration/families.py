"""Tiny real-shaped decoders of every family the plugin compresses (random weights, seeded), and a word tokenizer
over the shipped calibration text, for the calibration tests."""

from __future__ import annotations

import re
from collections import Counter

import torch

from jetson_tq.calibration.text import calibration_text

#: Common to every tiny config: 2 layers, hidden 64, 4 query heads over 2 KV heads (GQA), head dim 16 x 2.
BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,
    max_position_embeddings=4096,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

#: family -> (config class name, extra fields): each family's own features (biases, q/k norms, partial rotary,
#: fused qkv, RoPE scaling, Granite's multipliers, MoE).
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            }
        },
    ),
    "qwen2": ("Qwen2Config", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen3": ("Qwen3Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "phi3": (
        "Phi3Config",
        {
            "head_dim": None,
            "partial_rotary_factor": 0.75,
            "hidden_size": 96,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
    ),
    "gemma2": (
        "Gemma2Config",
        {
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "layer_types": ["full_attention"] * 2,
            "query_pre_attn_scalar": 32,
        },
    ),
    "gemma3": ("Gemma3TextConfig", {"layer_types": ["full_attention"] * 2, "query_pre_attn_scalar": 32}),
    "granite": (
        "GraniteConfig",
        {"attention_multiplier": 0.05, "embedding_multiplier": 4.0, "residual_multiplier": 0.5, "logits_scaling": 4.0},
    ),
    "olmo2": ("Olmo2Config", {}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1},
    ),
}


def tiny_model(family: str, seed: int = 0, **changes):
    """A tiny random model of ``family`` (eval mode, fp32; ``changes`` to its config), weights scaled so attention is
    not uniform."""
    import transformers

    cls_name, extra = FAMILIES[family]
    fields = {**BASE, **extra, **changes}
    if fields.get("head_dim") is None:
        fields.pop("head_dim")
    config = getattr(transformers, cls_name)(**fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                p.mul_(4.0)  # sharper scores: keys and queries with structure
    return model


def word_tokenizer(vocab_size: int = 512):
    """A WordLevel tokenizer over the calibration text's most frequent words (ids 0-2 special)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Counter(re.findall(r"\w+|[^\w\s]", calibration_text()))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w, _ in words.most_common(vocab_size - len(vocab)):
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", model_max_length=1 << 20
    )
