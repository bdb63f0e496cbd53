"""Head dims whose size the default preset's value group (64) does not divide: 80, 96, 112, 160 (and 32, 50).

The format fits the group (``KVFormat.value_group_for``: the largest divisor of the head dim not above
the preset's group) and every layer uses that one choice: bytes per token, codec, CompressedKVCache,
reference attention, capacity report and the vLLM page spec.
"""

from __future__ import annotations

import math

import pytest
import torch

from jetson_tq import attention_decode, attention_prefill
from jetson_tq.cache.compressed import CompressedKVCache
from jetson_tq.codec.kv import KVCodec
from jetson_tq.config import config_from_dict, load_config
from jetson_tq.errors import ConfigError, FormatError
from jetson_tq.format import KVFormat, PagedLayout, fp16_bytes_per_token, packed_bytes
from jetson_tq.models.specs import load_model_spec, model_spec_from_dict
from jetson_tq.reports.capacity import KVBudget, capacity_report, format_report, layer_formats, measure_cache

DEFAULT = load_config().default  # mse_k4v3: 4-bit mse keys, 3-bit values in groups of 64
FITTED = {80: 40, 96: 48, 112: 56, 160: 40}
ODD_DIMS = sorted(FITTED)


def _by_hand(d: int, g: int) -> int:
    """mse_k4v3 bytes per token per head: 4-bit key indices + fp16 norm, 3-bit codes + fp16 scale and zero per group."""
    return math.ceil(d / 8) * 4 + 2 + math.ceil(d / 8) * 3 + 4 * (d // g)


@pytest.mark.parametrize("d", ODD_DIMS)
def test_default_preset_fits_its_value_group(d):
    assert DEFAULT.value_group == 64 and DEFAULT.value_group_for(d) == FITTED[d]
    DEFAULT.check_head_dim(d)
    assert DEFAULT.bytes_per_token(d) == _by_hand(d, FITTED[d])
    assert DEFAULT.breakdown(d)["val_scale"] == 2 * (d // FITTED[d])
    assert DEFAULT.compression_ratio(d) > 3.9  # 80 B at D=80 (4.0x), 94 at 96, 108 at 112, 158 at 160
    assert DEFAULT.value_group_for(64) == 64 and DEFAULT.value_group_for(128) == 64  # divisors are kept


def test_group_rule_edges_and_the_one_refusal():
    assert KVFormat(value_group=64).value_group_for(32) == 32  # head dim below the group: one group
    assert KVFormat(value_group=32).value_group_for(50) == 25
    # a prime head dim above the group leaves groups of 1: 4 B of scale+zero per coordinate, more than fp16
    fmt = KVFormat(value_bits=2, value_group=16)
    assert fmt.value_group_for(17) == 1
    with pytest.raises(FormatError, match="not less than fp16"):
        fmt.bytes_per_token(17)
    with pytest.raises(ConfigError, match="layer 0: value_group 16 does not divide head_dim 17"):
        config_from_dict({"values": {"group_size": 16}}).check_model(2, 17)
    KVFormat(value_group=1).check_head_dim(17)  # a group that divides is the user's explicit choice: kept


@pytest.mark.parametrize("d", ODD_DIMS)
def test_codec_round_trip_within_the_group_bound(d):
    gen = torch.Generator().manual_seed(d)
    codec = KVCodec(DEFAULT, d)
    k, v = torch.randn(3, 2, 40, d, generator=gen), torch.randn(3, 2, 40, d, generator=gen)
    f = codec.encode(k, v)
    assert {n: t.shape[-1] for n, t in f.items()} == {x.name: x.count for x in DEFAULT.fields(d)}
    vd = codec.decode_values(f)
    g = FITTED[d]
    vg = v.reshape(*v.shape[:-1], d // g, g)
    half_step = (vg.amax(-1) - vg.amin(-1)) / (2**DEFAULT.value_bits - 1) / 2  # per group
    err = (vd - v).abs().reshape_as(vg).amax(-1)
    assert bool((err <= half_step * 1.01 + 1e-3).all())
    kd = codec.decode_keys(f)
    rel = ((kd - k).norm(dim=-1) / k.norm(dim=-1)).mean()
    assert rel < 0.15, rel  # 4-bit Lloyd-Max keys: ~0.095 relative error expected (sqrt(0.009) per unit vector)


@pytest.mark.parametrize("d", ODD_DIMS)
def test_cache_and_reference_attention(d):
    fmt = DEFAULT.with_(recent_tokens=16)
    gen = torch.Generator().manual_seed(1000 + d)
    hkv, g, n = 2, 3, 70
    cache = CompressedKVCache(fmt, hkv, d, batch_size=2, dtype=torch.float32)
    k, v = torch.randn(2, hkv, n, d, generator=gen), torch.randn(2, hkv, n, d, generator=gen)
    cache.append(k, v)
    assert int(cache.compressed_lens[0]) > 0 and cache.lengths.tolist() == [n, n]
    kmat, vmat, _ = cache.materialize()  # dequantized history, buffer exact
    rep = lambda x: x.repeat_interleave(g, 1)  # noqa: E731
    q = torch.randn(2, hkv * g, d, generator=gen)
    out = attention_decode(q, cache)
    ref = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), rep(kmat), rep(vmat)).squeeze(2)
    assert ((out - ref).norm() / ref.norm()) < 1e-4  # scores in the rotated space == scores on decoded keys
    exact = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), rep(k), rep(v)).squeeze(2)
    assert ((out - exact).norm() / exact.norm()) < 0.3  # random data: a small averaged output, loose bound
    qc, kc, vc = (torch.randn(2, h, 4, d, generator=gen) for h in (hkv * g, hkv, hkv))
    twin = CompressedKVCache(fmt, hkv, d, batch_size=2, dtype=torch.float32)
    twin.append(k, v)
    pre = attention_prefill(qc, kc, vc, cache)  # the window rule: equal to one decode step per token
    steps = []
    for t in range(4):
        twin.append(kc[:, :, t : t + 1], vc[:, :, t : t + 1])
        steps.append(attention_decode(qc[:, :, t], twin))
    ref = torch.stack(steps, dim=2)
    assert ((pre - ref).norm() / ref.norm()) < 1e-5
    m = measure_cache(DEFAULT, hkv, d, 512)
    assert m["ok"] and m["formula_bytes"] == m["storage_bytes"]


@pytest.mark.parametrize("d", ODD_DIMS)
def test_capacity_report_at_odd_head_dims(d):
    base = load_model_spec("qwen2.5-7b-instruct").to_dict()
    model = model_spec_from_dict({**base, "name": f"d{d}", "head_dim": d})
    formats = layer_formats(load_config(), model)
    rep = capacity_report(model, load_config(), KVBudget(64 << 30, 0.9, model.weight_bytes, 0, "test"), 8192)
    assert rep["turboquant"]["bytes_per_token"] == _by_hand(d, FITTED[d]) * model.num_layers * model.num_kv_heads
    assert rep["fp16"]["bytes_per_token"] == fp16_bytes_per_token(d) * model.num_layers * model.num_kv_heads
    assert rep["layers"][0]["value_group"] == FITTED[d] and len(formats) == model.num_layers
    assert f"groups of {FITTED[d]}" in format_report(rep)


@pytest.mark.parametrize("d", ODD_DIMS)
def test_vllm_spec_at_odd_head_dims(d):
    from jetson_tq.integrations.vllm.spec import layer_format, layout_for

    cfg = load_config()
    fmt = layer_format(cfg, 3, 28, d)
    layout = layout_for(fmt, d, 16)
    assert layout.page_bytes >= 16 * _by_hand(d, FITTED[d]) and layout.page_bytes % 16 == 0
    assert layout.offsets()["val_zero"] - layout.offsets()["val_scale"] >= 16 * 2 * (d // FITTED[d])
    assert packed_bytes(d, 3) * 16 <= layout.offsets()["val_scale"] - layout.offsets()["val_codes"]
    pytest.importorskip("vllm")
    from jetson_tq.integrations.vllm.spec import make_spec

    spec = make_spec(16, 4, d, fmt, layout)
    assert spec.page_size_bytes == 4 * layout.page_bytes == 4 * PagedLayout(fmt, d, 16).page_bytes
