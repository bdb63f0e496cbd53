"""CI slice of issue 22's harness (docs/fidelity.md, "Quality at 5x") on the real SmolLM2-135M: the 102 B rows built by
``benchmarks/fidelity.py``'s own row grammar, calibrated on the essays' end, scored on Newton's Opticks (held out).
The transform-coded row is the product's ``key_mode: klt`` format (``_tq``: codes stored in the pages, read back).

Full run (4 x 1,024 tokens, 3 seeds): KL 0.0077 transform-coded keys (the recipe without the sink; +0.70 %
perplexity), 0.0100 split keys (+1.16 %), 0.0169 the 122 B default (+1.27 %).
On this 2 x 512-token slice the order must hold (against the default with margin), and the transform-coded row must
stay near the uncompressed model. The shipped preset (``calibrate``'s defaults: the calibrated sink; full run KL
0.0055, +0.71 %) must read closer to the uncompressed model than its calibration without the sink.
"""

from __future__ import annotations

import pytest
import torch

from jetson_tq.config import load_config
from jetson_tq.models.smollm2 import load_smollm2
from jetson_tq.models.text import opticks_text
from lab.eval import fidelity as F
from lab.eval.calibrate_keys import model_rotary
from lab.eval.decoded_history import CodedKeyLayer
from lab.eval.klt_keys import rope_theta
from lab.eval.smartmix import kv_centers
from lab.eval.split_keys import SplitKeyHistory

pytestmark = pytest.mark.slow  # the real model on CPU, with calibration: a few minutes on 2 cores

KLT, SPLIT = "kl52apv3m_b256_w248_tq", "kx64h4l2v3m_b256_c_e1"  # KLT: the shipped recipe (kl52_smollm2)


@pytest.fixture(scope="module")
def harness():
    import benchmarks.fidelity as bf

    torch.manual_seed(0)
    model, tok = load_smollm2()
    bf.HEAD_DIM, bf.ROPE_THETA = F.model_shape(model)[1], rope_theta(model.config)
    bf.MODEL_ROTARY[:] = [model_rotary(model)]
    bf.CALIBRATION[:] = bf.calibration_capture(model, tok)
    # the offsets ``bf.load_centers`` computes when its file is missing: kv_centers of a capture of the essays' last
    # 2 x 1,024 tokens, the very capture made above (so the model runs over them once, not twice)
    bf.CENTERS[:] = kv_centers(bf.CALIBRATION)
    yield bf, model, tok
    bf.CENTERS.clear()
    bf.CALIBRATION.clear()
    bf.MODEL_ROTARY.clear()


def test_transform_coded_keys_lead_on_held_out_text(harness):
    bf, model, tok = harness
    rows = {name: bf.spec_row(name, "cpu-decoded") for name in (KLT, SPLIT)}
    assert all(v is not None for v in rows.values())
    n_layers, head_dim = F.model_shape(model)
    for v in rows.values():  # both 5x rows: <= 102 B per token per KV head at head dim 128
        assert v.bytes_per_token(n_layers, 128) <= 102
    default = F.Variant("mse_k4v3", "default", load_config("mse_k4v3"), backend="cpu-decoded")
    ids = tok(opticks_text(), return_tensors="pt").input_ids[0]
    windows = F.token_windows(ids, 2, 513)
    stats = F.teacher_forced(model, windows, [*rows.values(), default], chunk=128, batch=2)
    kl = {name: s["kl"] for name, s in stats.items() if name != "reference"}
    # measured on this slice (2026-12-05): KLT 0.0044 (the previous calibration's row: 0.0037), split 0.0047,
    # default 0.0132; top-1 KLT 0.976
    assert kl[KLT] < kl[SPLIT] < 0.75 * kl["mse_k4v3"] and kl[KLT] < 0.4 * kl["mse_k4v3"], kl
    assert stats[KLT]["top1"] >= 0.93 and stats[KLT]["ppl"] < stats["reference"]["ppl"] * 1.02, stats

    # split keys read their own key coder (the shared layer wrapper); KLT keys are the product format's stored codes
    cache = rows[SPLIT].make_cache(model)
    with torch.no_grad():
        model(windows[:1, :300], past_key_values=cache)
    coded = [layer for layer in cache.layers if isinstance(layer, CodedKeyLayer)]
    assert len(coded) == n_layers and all(isinstance(layer.decoded, SplitKeyHistory) for layer in coded)
    cache = rows[KLT].make_cache(model)
    with torch.no_grad():
        model(windows[:1, :300], past_key_values=cache)
    stores = [layer.store for layer in cache.layers]
    assert all(s is not None and s.fmt.key_mode == "klt" and s.codec.key_coder is not None for s in stores)
    assert all(s.compressed_fields(1)["key_code"].shape[-1] == 26 for s in stores)  # 52 B at D=128 = 26 B at D=64


def test_the_shipped_preset_with_its_calibrated_sink_on_held_out_text(harness):
    """The preset as users build it (``python -m jetson_tq calibrate``'s defaults: the essays' last 2 x 1,024 tokens,
    the calibrated sink) through ``TurboQuantCache`` on the same Opticks slice: its sink layers are SmolLM2's constant
    ones, and it reads closer to the uncompressed model than the calibration without the sink
    (``--sink none``)."""
    from jetson_tq.calibration.sink import sink_first_tokens
    from jetson_tq.models.text import text_by_name
    from lab.eval.calibrate_keys import calibrate_model

    bf, model, tok = harness
    rows = tok(text_by_name("essays"), return_tensors="pt").input_ids[0][-2048:].reshape(2, 1024)
    shipped = calibrate_model(model, rows, 52, sink_firsts=sink_first_tokens(rows, tok.all_special_ids))
    assert [i for i, t in enumerate(shipped) if t.has_sink] == list(range(12, 29))
    plain = calibrate_model(model, rows, 52)  # calibrate --sink none: position 0 fitted into every layer
    config = load_config("kl52_smollm2")
    variants = [
        F.Variant(name, "klt", config, backend="cpu-decoded", key_transforms=transforms)
        for name, transforms in (("shipped", shipped), ("no sink", plain))
    ]
    ids = tok(opticks_text(), return_tensors="pt").input_ids[0]
    stats = F.teacher_forced(model, F.token_windows(ids, 2, 513), variants, chunk=128, batch=2)
    # measured on this slice (2026-12-05): KL 0.0029 with the sink, 0.0044 without; top-1 0.978 / 0.976; perplexity
    # +0.43 % / +0.15 % (1,024 tokens: noise at this size, so only KL is compared)
    assert stats["shipped"]["kl"] < 0.9 * stats["no sink"]["kl"], stats
    assert stats["shipped"]["top1"] >= 0.93 and stats["shipped"]["ppl"] < stats["reference"]["ppl"] * 1.02, stats


def test_key_coder_rows_have_their_own_plot_family():
    """The frontier plot shows split and transform-coded keys as their own series (harness-only formats)."""
    import benchmarks.fidelity as bf

    assert "key_mode klt" in bf.key_coder_family(KLT) and "harness only" in bf.key_coder_family("kl52alv3m_b256_c_e1")
    assert "split" in bf.key_coder_family(SPLIT)
    assert bf.key_coder_family("k3v3g128_b256") is None and bf.key_coder_family("mse_k4v3") is None
