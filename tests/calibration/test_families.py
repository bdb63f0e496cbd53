"""``auto`` for every family the plugin compresses, on tiny real-shaped configs with random weights: the model
calibrates from its own weights and the shipped text, serves through TurboQuantCache, and a second cache reads the
calibration back from the cache without calibrating again."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache

from jetson_tq.calibration import keys as calibration_keys
from jetson_tq.codec.klt import load_transforms, spread_transform
from jetson_tq.config import AUTO_FORMAT
from jetson_tq.integrations.transformers import TurboQuantCache, model_dims
from tests.calibration.families import FAMILIES, tiny_model

pytestmark = pytest.mark.slow  # a calibration per family (~2-5 s each on 2 cores)


def _logits(model, cache, ids, chunk):
    with torch.no_grad():
        return torch.cat(
            [model(ids[:, s : s + chunk], past_key_values=cache).logits for s in range(0, ids.shape[1], chunk)], 1
        )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_calibrates_serves_and_reads_back(family, tokenizer, calibration_dir, monkeypatch):
    model = tiny_model(family)
    config = model.config
    layers, _, kv_heads, head_dim = model_dims(config)
    cache = TurboQuantCache(model, "auto", tokenizer=tokenizer, backend="reference")
    cfg = cache.tq_config
    assert cfg.default.key_mode == AUTO_FORMAT["keys"]["mode"] and cfg.needs_key_transform
    path = cfg.key_transform
    assert path.startswith(str(calibration_dir)) and path.endswith(".pt")
    transforms, meta = load_transforms(path)
    assert len(transforms) == layers and meta["head_dim"] == head_dim and meta["kv_heads"] == kv_heads
    for t in transforms:
        assert t is not None and (t.num_heads, t.head_dim) == (kv_heads, head_dim)
        assert t.code_bits == cfg.default.key_code_bits(head_dim)
    # the RoPE the calibration read is the model's own (partial rotary: Phi-3's 0.75 of the head)
    rotary = transforms[0].rotary
    fraction = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    assert rotary.rotary_dim == int(head_dim * fraction) // 2 * 2
    buffers = [b for n, b in model.named_buffers() if n.endswith("inv_freq")]
    assert any(torch.equal(rotary.inv_freq, b.float()) for b in buffers)

    # serves: 320 tokens (past the 256-token exact block, so the oldest are read from their codes), chunks of 64
    ids = tokenizer(word_tokenizer_sample(tokenizer), return_tensors="pt").input_ids[:, :320]
    got = _logits(model, cache, ids, 64)
    want = _logits(model, DynamicCache(), ids, 64)
    assert torch.isfinite(got).all()
    late = slice(256, None)  # rows whose attention read compressed keys
    rel = float((got[:, late] - want[:, late]).norm() / want[:, late].norm())
    # no worse than the same format with an uncalibrated transform (identity, bits spread evenly) and the model's RoPE:
    # measured over 10 families x seeds 0-1 at 0.73-0.97 of it (random weights have little structure to find)
    plain = [replace(spread_transform(t.num_heads, t.head_dim, t.code_bits), rotary=t.rotary) for t in transforms]
    uncal = _logits(model, TurboQuantCache(model, cfg, backend="reference", key_transforms=plain), ids, 64)
    rel_uncal = float((uncal[:, late] - want[:, late]).norm() / want[:, late].norm())
    assert 0 < rel < 0.3 and rel <= 1.02 * rel_uncal, f"{family}: relative logit error {rel:.3g} vs {rel_uncal:.3g}"

    # reads back: a second cache finds the entry and never calibrates
    def refuse(*args, **kwargs):
        raise AssertionError("calibrated again instead of reading the cache")

    monkeypatch.setattr(calibration_keys, "calibrate_model", refuse)
    monkeypatch.setattr("jetson_tq.calibration.auto.calibrate_model", refuse)
    again = TurboQuantCache(model, "auto", tokenizer=tokenizer, backend="reference")
    assert again.tq_config.key_transform == path


def word_tokenizer_sample(tokenizer) -> str:
    """Held-out words for serving: the calibration text's vocabulary in another order (a fixed shuffle)."""
    vocab = sorted(tokenizer.get_vocab())
    order = torch.randperm(len(vocab), generator=torch.Generator().manual_seed(1)).tolist()
    return " ".join(vocab[i] for i in (order * 2)[:400])
