"""The EAGLE-3 draft heads the speculative-decoding checks generate (``jetson_tq.models.eagle``)."""

from __future__ import annotations

import json

import pytest
import torch

from jetson_tq.models.eagle import ARCHITECTURE, aux_layers, draft_config, write_repeat_draft
from jetson_tq.models.tiny import make_tiny_llama


def test_aux_layers_are_vllms_default_where_distinct_else_spread():
    assert aux_layers(28) == [2, 14, 25]  # Qwen2.5-7B: vLLM's own choice, (2, L/2, L-3)
    assert aux_layers(32) == [2, 16, 29]
    assert aux_layers(6) == [1, 3, 5]  # (2, 3, 3) would feed the head two states, not three
    with pytest.raises(ValueError, match="three target layers"):
        aux_layers(2)


def test_draft_config_takes_the_targets_shape():
    target = {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "rms_norm_eps": 1e-6,
    }
    cfg = draft_config(target)
    assert cfg["architectures"] == [ARCHITECTURE] and cfg["num_hidden_layers"] == 1
    assert (cfg["hidden_size"], cfg["head_dim"], cfg["num_key_value_heads"]) == (3584, 128, 4)
    assert cfg["draft_vocab_size"] == cfg["vocab_size"] == 152064
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 14, 25]


def test_repeat_draft_passes_the_last_hidden_state_to_the_targets_lm_head(tmp_path):
    from safetensors.torch import load_file

    target = make_tiny_llama(tmp_path / "tiny", layers=6)
    draft = write_repeat_draft(tmp_path / "eagle3", target)
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]  # 6: after the last layer
    w, t = load_file(str(draft / "model.safetensors")), load_file(str(target / "model.safetensors"))
    h = cfg["hidden_size"]
    assert torch.equal(w["fc.weight"][:, 2 * h :], torch.eye(h)) and not w["fc.weight"][:, : 2 * h].any()
    assert torch.equal(w["lm_head.weight"], t["lm_head.weight"])
    assert not w["midlayer.self_attn.o_proj.weight"].any() and not w["midlayer.mlp.down_proj.weight"].any()
