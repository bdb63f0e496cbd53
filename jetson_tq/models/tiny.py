"""A tiny random Llama (GQA, >= 6 layers) written offline as a vLLM-loadable model directory.

Used by the end-to-end tests and ``python -m jetson_tq vllm --model tiny``: config.json, fp32
safetensors weights from a seeded generator and a WordLevel tokenizer built with ``tokenizers``
(no hub access). The weights are scaled so attention is not uniform (keys/queries have structure),
which makes token agreement between baseline and compressed cache a meaningful check.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = (
    "the a cat dog sat on mat and ran to big small red blue house tree we you they it is was "
    "over under with from jetson thor orin memory cache token fast slow one two three four five"
).split()


def _tokenizer_files(out: Path, vocab_size: int, specials: dict[int, str] | None = None) -> None:
    """A WordLevel tokenizer of ``vocab_size`` ids; ``specials`` (id -> text, e.g. a VLM's image placeholder) are
    special tokens at those ids."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    specials = specials or {}
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    i = 0
    while len(vocab) < vocab_size:
        word = specials.get(len(vocab), f"w{i}")
        i += word not in specials.values()
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if specials:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials.values()])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 4096,
                "add_bos_token": False,
            }
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )


write_tokenizer_files = _tokenizer_files  # public name for scripts that need a local tokenizer


def make_tiny_llama(
    out: str | Path,
    *,
    layers: int = 6,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_size: int = 512,
    intermediate: int = 256,
    seed: int = 0,
    extra_config: dict | None = None,
) -> Path:
    """Write the model to ``out`` (created) and return it; head_dim = hidden / heads.

    ``extra_config`` entries are merged into config.json (e.g. sliding-window layer types, to check
    that an unsupported attention feature is refused).
    """
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attention_bias": False,
        "mlp_bias": False,
        **(extra_config or {}),
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).contiguous()

    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rnd(vocab_size, hidden, std=1.0),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": rnd(vocab_size, hidden, std=hidden**-0.5),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        w[p + "self_attn.q_proj.weight"] = rnd(heads * head_dim, hidden, std=2.0 * hidden**-0.5)
        w[p + "self_attn.k_proj.weight"] = rnd(kv_heads * head_dim, hidden, std=2.0 * hidden**-0.5)
        w[p + "self_attn.v_proj.weight"] = rnd(kv_heads * head_dim, hidden, std=hidden**-0.5)
        w[p + "self_attn.o_proj.weight"] = rnd(hidden, heads * head_dim, std=hidden**-0.5)
        w[p + "mlp.gate_proj.weight"] = rnd(intermediate, hidden, std=hidden**-0.5)
        w[p + "mlp.up_proj.weight"] = rnd(intermediate, hidden, std=hidden**-0.5)
        w[p + "mlp.down_proj.weight"] = rnd(hidden, intermediate, std=intermediate**-0.5)
    save_file(w, str(out / "model.safetensors"))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    _tokenizer_files(out, vocab_size)
    return out
