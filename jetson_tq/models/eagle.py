"""An EAGLE-3 draft head shaped for a Llama-like target model, written offline as a directory vLLM loads as
``speculative_config={"method": "eagle3", "model": DIR}``.

No EAGLE-3 head is downloadable here, and the checks need only the machinery: a proposer model that reads the
target's hidden states, has its own attention layer and KV cache, and drafts on every step. Two kinds:
- ``draft_config`` alone (``load_format="dummy"``, the GPU benchmark's shapes): random weights, drafts that are
  almost never accepted;
- ``write_repeat_draft``: real weights for a target whose weights are on disk (the tiny Llama of the CPU tests),
  chosen so that the head proposes the token the target has just sampled again (its attention and MLP write zeros,
  its fc passes the target's last hidden state through, its lm_head is the target's): drafts are accepted exactly
  where the target repeats a token, so a run sees both verdicts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

#: the architecture vLLM maps to its Llama EAGLE-3 head (``Eagle3LlamaForCausalLM``; any target that supports
#: EAGLE-3, e.g. Llama and Qwen2, feeds it)
ARCHITECTURE = "LlamaForCausalLMEagle3"

_COPIED = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "hidden_act",
    "bos_token_id",
    "eos_token_id",
)


def aux_layers(num_layers: int) -> list[int]:
    """The three target layers whose outputs the head reads: vLLM's default for Llama-like targets (2, L/2, L-3)
    where those are distinct, else spread over a shallow target (vLLM would read a repeated layer only once and the
    head's input would be short of a third)."""
    ids = [2, num_layers // 2, num_layers - 3]
    if ids[0] < ids[1] < ids[2]:
        return ids
    if num_layers < 3:
        raise ValueError(f"an EAGLE-3 head reads three target layers; the target has {num_layers}")
    return [1, num_layers // 2, num_layers - 1]


def draft_config(target: dict, aux: list[int] | None = None) -> dict:
    """config.json of a one-layer EAGLE-3 head for the target whose config.json is ``target`` (its widths, heads,
    vocabulary; the head's own vocabulary is the target's, so no draft-to-target token map)."""
    cfg = {k: target[k] for k in _COPIED if k in target}
    cfg["head_dim"] = target.get("head_dim") or target["hidden_size"] // target["num_attention_heads"]
    cfg.update(
        architectures=[ARCHITECTURE],
        model_type="llama",
        num_hidden_layers=1,
        tie_word_embeddings=False,
        attention_bias=False,
        draft_vocab_size=target["vocab_size"],
        eagle_aux_hidden_state_layer_ids=list(aux or aux_layers(int(target["num_hidden_layers"]))),
    )
    return cfg


def write_draft_config(out: str | Path, target: dict, aux: list[int] | None = None) -> Path:
    """Write ``draft_config(target)`` to ``out``/config.json (created) for a dummy-weight run; return ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(draft_config(target, aux), indent=1))
    return out


def write_repeat_draft(out: str | Path, target_dir: str | Path, seed: int = 0) -> Path:
    """A head that drafts the target's last sampled token again, for the target in ``target_dir`` (config.json and
    model.safetensors with ``lm_head.weight``; an RMSNorm of unit weight before its lm_head, as the tiny Llama).

    The head reads the target's residual stream after its last layer (aux layer L) through an fc that passes it
    through; attention and MLP outputs are zero (o_proj, down_proj), so its final norm and the target's lm_head
    give the target's own logits at that position: the token just sampled. Its q/k/v projections are random, so
    its attention still reads and writes its KV cache as a trained head's would."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    target_dir = Path(target_dir)
    target = json.loads((target_dir / "config.json").read_text())
    layers = int(target["num_hidden_layers"])
    cfg = draft_config(target, [1, layers // 2, layers])
    out = write_draft_config(out, target, cfg["eagle_aux_hidden_state_layer_ids"])
    with safe_open(str(target_dir / "model.safetensors"), "pt") as f:
        lm_head = f.get_tensor("lm_head.weight")
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).contiguous()

    p = "midlayer."
    w = {
        "fc.weight": torch.cat([torch.zeros(h, 2 * h), torch.eye(h)], dim=1),  # the last of the three aux states
        "norm.weight": torch.ones(h),
        "lm_head.weight": lm_head.clone(),
        p + "hidden_norm.weight": torch.ones(h),
        p + "input_layernorm.weight": torch.ones(h),
        p + "post_attention_layernorm.weight": torch.ones(h),
        p + "self_attn.q_proj.weight": rnd(q, 2 * h),  # the first layer reads [embedding, hidden state]
        p + "self_attn.k_proj.weight": rnd(kv, 2 * h),
        p + "self_attn.v_proj.weight": rnd(kv, 2 * h),
        p + "self_attn.o_proj.weight": torch.zeros(h, q),
        p + "mlp.gate_proj.weight": rnd(inter, h),
        p + "mlp.up_proj.weight": rnd(inter, h),
        p + "mlp.down_proj.weight": torch.zeros(h, inter),
    }
    save_file(w, str(out / "model.safetensors"))
    return out
