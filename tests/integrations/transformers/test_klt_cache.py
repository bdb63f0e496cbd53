"""Transform-coded keys (keys.mode klt) through TurboQuantCache: the product's stored codes read back by the reference
and the cpu-decoded paths, the eval coder reproduced, calibration from the command line, named errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from jetson_tq.cli.main import main
from jetson_tq.codec.klt import load_transforms, spread_transform
from jetson_tq.config import TurboQuantConfig, load_config
from jetson_tq.errors import ConfigError, UnsupportedModelError
from jetson_tq.format import KVFormat
from jetson_tq.integrations.transformers import TurboQuantCache
from lab.eval.calibrate_keys import calibrate_model, calibration_spec, model_rotary
from lab.eval.decoded_history import register as register_decoded
from lab.eval.klt_keys import KLTKeyCache, KLTPlan, calibrate
from lab.eval.smartmix import capture
from tests.integrations.transformers.test_transformers_cache import SMALL as BASE_SMALL

register_decoded()  # the lab's backend="cpu-decoded" (a CPU scoring path these tests compare), explicitly

SMALL = dict(BASE_SMALL, max_position_embeddings=2048)
KLT = KVFormat(key_mode="klt", key_code_bytes=52, value_mode="mse", value_bits=3, recent_tokens=16)
CFG = TurboQuantConfig(name="klt", default=KLT)


def _model(**extra):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMALL, **extra)).eval()


def _chunked(model, cache, ids, chunk):
    with torch.no_grad():
        return torch.cat(
            [model(ids[:, s : s + chunk], past_key_values=cache).logits for s in range(0, ids.shape[1], chunk)], 1
        )


def test_reference_and_decoded_paths_read_the_same_codes():
    """Plumbing without calibration: the reference attention (codes decoded per call) and the cpu-decoded history
    (decoded once) agree, at any chunking, and generate runs on it."""
    model = _model()
    spread = [spread_transform(2, 32, KLT.key_code_bits(32))] * 3
    ids = torch.randint(0, 256, (2, 70))
    ref = _chunked(model, TurboQuantCache(model, CFG, backend="reference", key_transforms=spread), ids, 70)
    for backend, chunk in (("reference", 16), ("cpu-decoded", 70), ("cpu-decoded", 23)):
        got = _chunked(model, TurboQuantCache(model, CFG, backend=backend, key_transforms=spread), ids, chunk)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    cache = TurboQuantCache(model, CFG, backend="reference", key_transforms=spread)
    out = model.generate(ids[:1, :40], max_new_tokens=8, do_sample=False, past_key_values=cache)
    assert out.shape == (1, 48) and cache.get_seq_length() == 47
    assert cache.used_bytes() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen2_and_bf16_models(dtype):
    """Another architecture (Qwen2: biased q/k/v projections, another RoPE theta) and a bf16 model: the klt codes are
    written and read at the keys' positions, finite, and the two read paths agree."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**dict(SMALL, rope_theta=1e6))).eval().to(dtype)
    # the model's own RoPE (a bf16 model's frequencies are bf16-rounded: a float32 calibration would be refused)
    spread = [dataclasses.replace(spread_transform(2, 32, KLT.key_code_bits(32)), rotary=model_rotary(model))] * 3
    ids = torch.randint(0, 256, (1, 50))
    got = {
        backend: _chunked(model, TurboQuantCache(model, CFG, backend=backend, key_transforms=spread), ids, 20)
        for backend in ("reference", "cpu-decoded")
    }
    assert all(bool(torch.isfinite(x.float()).all()) for x in got.values())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got["reference"].float(), got["cpu-decoded"].float(), rtol=tol, atol=tol)


def test_named_errors(tmp_path):
    model = _model()
    with pytest.raises(ConfigError, match="names no key_transform"):
        TurboQuantCache(model, CFG)
    with pytest.raises(ConfigError, match="3 layers|2 layers for a model of 3"):
        TurboQuantCache(model, CFG, key_transforms=[spread_transform(2, 32, 104)] * 2)
    with pytest.raises(ConfigError, match="KV heads"):
        TurboQuantCache(model, CFG, key_transforms=[spread_transform(4, 32, 104)] * 3)
    with pytest.raises(ConfigError, match="RoPE"):
        TurboQuantCache(model, CFG, key_transforms=[spread_transform(2, 32, 104, theta=500.0)] * 3)
    with pytest.raises(ConfigError, match="layer 1 codes klt keys"):
        TurboQuantCache(model, CFG, key_transforms=[spread_transform(2, 32, 104), None, None])
    yaml = tmp_path / "k.yaml"
    yaml.write_text("keys: {mode: klt, code_bytes: 52}\nkey_transform: sub/none.pt\n")
    cfg = load_config(yaml)
    assert cfg.key_transform == str(tmp_path / "sub" / "none.pt") and cfg.needs_key_transform
    with pytest.raises(ConfigError, match="not found.*calibrate"):
        TurboQuantCache(model, cfg)
    dynamic = _model(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        model_rotary(dynamic)


def test_vllm_settings_for_klt_configs(tmp_path, monkeypatch):
    """vLLM takes klt keys (its transforms from the config's file, by layer) but refuses sink tokens by name."""
    from jetson_tq.codec.klt import save_transforms
    from jetson_tq.integrations.vllm import settings

    sink = tmp_path / "s.yaml"
    sink.write_text("keys: {mode: klt, code_bytes: 52}\nbuffer: {sink_tokens: 1}\nkey_transform: kt.pt\n")
    settings._load.cache_clear()
    with pytest.raises(ConfigError, match="sink tokens"):
        settings._load(str(sink))
    klt = tmp_path / "k.yaml"
    klt.write_text("keys: {mode: klt, code_bytes: 52}\nkey_transform: kt.pt\n")
    monkeypatch.setenv(settings.ENV_CONFIG, str(klt))
    settings._load.cache_clear()
    with pytest.raises(ConfigError, match="not found"):
        settings.layer_key_transform(0)
    save_transforms(tmp_path / "kt.pt", [spread_transform(2, 32, 104), None], {})
    assert settings.layer_key_transform(0).code_bits == 104
    with pytest.raises(ConfigError, match="no key transform for layer 1"):
        settings.layer_key_transform(1)
    settings._load.cache_clear()


@pytest.mark.slow
def test_calibrated_product_codes_reproduce_the_eval_coder():
    """The product format (codes in the pages, codec.klt) and the evaluation coder (klt_keys.KLTQuantizer) give the
    same logits, and the reference path agrees with the decoded one."""
    model = _model()
    ids = torch.randint(0, 256, (2, 320))
    transforms = calibrate_model(model, ids, 52)
    theta = model.config.rope_parameters["rope_theta"]
    spec = calibration_spec(52)  # the coder calibrate_model fits by default
    plan = KLTPlan(spec, calibrate(spec, capture(model, ids), 32, theta, skip=0), theta)
    test_ids = torch.randint(0, 256, (1, 96))
    tq_cfg = TurboQuantConfig(name="klt", default=KLT.with_(key_mode="mse", key_code_bytes=0, key_bits=3))
    want = _chunked(model, KLTKeyCache(model, tq_cfg, plan), test_ids, 32)
    got = _chunked(model, TurboQuantCache(model, CFG, backend="cpu-decoded", key_transforms=transforms), test_ids, 32)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    ref = _chunked(model, TurboQuantCache(model, CFG, backend="reference", key_transforms=transforms), test_ids, 32)
    torch.testing.assert_close(ref, got, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_calibrated_sink_is_fitted_where_position_0_is_constant_and_read_alike_at_any_chunking():
    """``calibrate_model(sink_firsts=...)``: one first token repeated makes every layer's sink constant, and each
    layer's sink is that token's position-0 key and value; the reference and cpu-decoded paths read it alike at any
    chunking, and differently from the same transforms without it. Different first tokens leave layer 0 (the token's
    own projection) without a sink."""
    model = _model()
    ids = torch.randint(0, 256, (2, 320))
    same = torch.full((4,), 7)
    transforms = calibrate_model(model, ids, 52, sink_firsts=same)
    assert all(t.has_sink for t in transforms)
    at0 = capture(model, torch.stack([same[:2], same[:2]]))  # position 0 of token 7, per layer
    for t, cap in zip(transforms, at0):
        torch.testing.assert_close(t.sink_key, cap.k[0, :, 0].float())
        torch.testing.assert_close(t.sink_value, cap.v[0, :, 0].float())
    test_ids = torch.randint(0, 256, (2, 90))
    ref = _chunked(model, TurboQuantCache(model, CFG, backend="reference", key_transforms=transforms), test_ids, 90)
    for backend, chunk in (("reference", 17), ("cpu-decoded", 90), ("cpu-decoded", 23)):
        cache = TurboQuantCache(model, CFG, backend=backend, key_transforms=transforms)
        torch.testing.assert_close(_chunked(model, cache, test_ids, chunk), ref, rtol=1e-4, atol=1e-4)
    plain = [dataclasses.replace(t, sink_key=None, sink_value=None) for t in transforms]
    other = _chunked(model, TurboQuantCache(model, CFG, backend="reference", key_transforms=plain), test_ids, 90)
    assert (other - ref).abs().max() > 1e-3  # the sink is read
    apart = calibrate_model(model, ids, 52, sink_firsts=torch.arange(3, 60))
    assert not apart[0].has_sink


@pytest.mark.slow
def test_calibrated_sink_on_qwen2_at_head_dim_48():
    """The sink on a shape its code was not written against: Qwen2 (biased projections, RoPE theta 1e6) at head dim
    48 (not a power of two). Every layer is fitted with it (one first token), and the reference and cpu-decoded paths
    read it alike at any chunking (partial rotary: the kernel cases at D=80, rotary 40)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**dict(SMALL, head_dim=48, rope_theta=1e6))
    model = Qwen2ForCausalLM(config).eval()
    transforms = calibrate_model(model, torch.randint(0, 256, (2, 300)), 52, sink_firsts=torch.full((3,), 11))
    assert all(t.has_sink and t.head_dim == 48 for t in transforms)
    ids = torch.randint(0, 256, (2, 70))
    ref = _chunked(model, TurboQuantCache(model, CFG, backend="reference", key_transforms=transforms), ids, 70)
    for backend, chunk in (("reference", 19), ("cpu-decoded", 70), ("cpu-decoded", 16)):
        cache = TurboQuantCache(model, CFG, backend=backend, key_transforms=transforms)
        torch.testing.assert_close(_chunked(model, cache, ids, chunk), ref, rtol=1e-4, atol=1e-4)
    assert bool(torch.isfinite(ref).all())


def _tiny_calibration_args(tmp_path, seed: int):
    """A two-layer tiny Llama and a 700-word text in ``tmp_path``: (model dir, the calibrate argv for them)."""
    from jetson_tq.models.tiny import WORDS, make_tiny_llama

    model_dir = make_tiny_llama(tmp_path / "tiny", layers=2)
    text = tmp_path / "text.txt"
    g = torch.Generator().manual_seed(seed)
    text.write_text(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (700,), generator=g)))
    return model_dir, [
        "calibrate",
        "--model",
        str(model_dir),
        "--text",
        str(text),
        "--windows",
        "2",
        "--window-len",
        "256",
    ]


@pytest.mark.slow
def test_calibrate_command_writes_a_usable_file(tmp_path, capsys):
    model_dir, argv = _tiny_calibration_args(tmp_path, seed=0)
    out = tmp_path / "kt.pt"
    assert main([*argv, "--out", str(out), "--key-bytes", "40"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and str(tmp_path / "kt.yaml") in printed
    written = load_config(tmp_path / "kt.yaml")
    assert written.default.key_code_bytes == 40 and written.default.sink_tokens == 0
    assert written.key_transform == str(out)
    layers, meta = load_transforms(out)
    assert len(layers) == 2 and meta["key_code_bytes"] == 40 and meta["tokens"] == 512 and meta["sink_tokens"] == 0
    assert meta["calibrated_sink_layers"] == [i for i, t in enumerate(layers) if t is not None and t.has_sink]
    assert all(t is not None and t.code_bits == 40 * 8 * 32 // 128 for t in layers)
    yaml = tmp_path / "tiny_klt.yaml"
    yaml.write_text("keys: {mode: klt, code_bytes: 40}\nvalues: {mode: mse, bits: 3}\nkey_transform: kt.pt\n")
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    cache = TurboQuantCache(model, load_config(yaml), backend="reference")
    ids = torch.randint(3, 100, (1, 150))
    with torch.no_grad():
        logits = model(ids, past_key_values=cache).logits
    assert torch.isfinite(logits).all()
    assert main([*argv[:5], "--windows", "9", "--out", str(out)]) == 2  # too few tokens: a usage error
    assert "needed" in capsys.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "plain.pt"), "--key-bytes", "40", "--sink", "none"]) == 0
    assert load_transforms(tmp_path / "plain.pt")[1]["calibrated_sink_layers"] == []
    assert main([*argv, "--sink", "calibrated", "--sink-tokens", "1"]) == 2  # both read position 0: a usage error
    assert "keep one" in capsys.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "named.yaml"), "--key-bytes", "40"]) == 0  # the config's name
    assert load_config(tmp_path / "named.yaml").key_transform == str(tmp_path / "named.pt")
    assert load_transforms(tmp_path / "named.pt")[1]["key_code_bytes"] == 40
    (tmp_path / "empty").mkdir()
    assert main([*argv[:1], "--model", str(tmp_path / "empty"), *argv[3:]]) == 2  # no config.json: a usage error
    assert "no config.json" in capsys.readouterr().err
    assert main([*argv[:3], "--text", str(tmp_path / "missing.txt")]) == 2
    assert "expected 'essays', 'opticks' or a text file" in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_command_fits_the_code_widths_asked_for(tmp_path, capsys):
    """By default (``--widths 2,4,8 --levels cubic``) every layer's codes lie in one byte at the full budget and its
    levels are a cubic the kernels compute without a table; ``--widths any --levels lloyd`` gives widths 0-8 and
    Lloyd-Max tables; widths or levels the coder cannot take are a usage error."""
    from jetson_tq.codec.klt import codes_in_one_byte

    _, argv = _tiny_calibration_args(tmp_path, seed=1)
    out = tmp_path / "kt.pt"
    assert main([*argv, "--out", str(out)]) == 0  # the defaults: widths 2, 4, 8 and cubic levels
    layers, meta = load_transforms(out)
    for t in layers:
        assert codes_in_one_byte(t.bits)
        assert set(t.bits.unique().tolist()) <= {0, 2, 4, 8} and t.code_bits == 52 * 8 * 32 // 128
        assert t.cubic_levels() is not None
    assert "cubic" in meta["coder"]
    assert main([*argv, "--out", str(out), "--widths", "any", "--levels", "lloyd"]) == 0
    layers, meta = load_transforms(out)
    assert any(not codes_in_one_byte(t.bits) for t in layers), "widths 0-8 include ones that straddle a byte"
    assert all(t.cubic_levels() is None for t in layers) and "lloyd" in meta["coder"]
    capsys.readouterr()
    for bad in (["--widths", "2,x"], ["--widths", "9"], ["--widths", ","], ["--levels", "uniform"]):
        assert main([*argv, "--out", str(out), *bad]) == 2, bad
        err = capsys.readouterr().err
        assert "expected" in err or "invalid choice" in err, bad


@pytest.mark.slow
def test_calibrate_command_fits_a_diagonal_transform(tmp_path, capsys):
    """``--transform diagonal``: no transform, each layer's decode matrices diagonal (the decode kernel's
    ``KltSpec.DIAGONAL`` read), codes still in one byte at the full budget with cubic levels; the file serves."""
    from jetson_tq.codec.klt import codes_in_one_byte

    model_dir, argv = _tiny_calibration_args(tmp_path, seed=2)
    out = tmp_path / "kt.pt"
    assert main([*argv, "--out", str(out), "--transform", "diagonal"]) == 0
    layers, meta = load_transforms(out)
    for t in layers:
        assert t.decode_is_diagonal and codes_in_one_byte(t.bits) and t.cubic_levels() is not None
        assert t.code_bits == 52 * 8 * 32 // 128
    assert "no transform" in meta["coder"]
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    cache = TurboQuantCache(model, load_config(tmp_path / "kt.yaml"), backend="reference")
    with torch.no_grad():
        logits = model(torch.randint(3, 100, (1, 150)), past_key_values=cache).logits
    assert torch.isfinite(logits).all()
    assert main([*argv, "--out", str(out), "--transform", "dct"]) == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [KLT.with_(sink_tokens=2), KVFormat(recent_tokens=16, sink_tokens=3)])
def test_format_sink_is_read_exactly_on_every_path(fmt):
    """``sink_tokens``: the reference path (codes decoded per call, the sink copy scored exactly) equals the
    cpu-decoded history's sink lever, for any chunking; without it the result differs."""
    model = _model()
    spread = [spread_transform(2, 32, KLT.key_code_bits(32))] * 3 if fmt.key_mode == "klt" else None
    cfg = TurboQuantConfig(name="sink", default=fmt)
    ids = torch.randint(0, 256, (2, 60))
    want = _chunked(model, TurboQuantCache(model, cfg, backend="cpu-decoded", key_transforms=spread), ids, 60)
    for chunk in (60, 7, 1):
        got = _chunked(model, TurboQuantCache(model, cfg, backend="reference", key_transforms=spread), ids, chunk)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    plain = TurboQuantConfig(name="plain", default=fmt.with_(sink_tokens=0))
    other = _chunked(model, TurboQuantCache(model, plain, backend="reference", key_transforms=spread), ids, 60)
    assert (other[:, 20:] - want[:, 20:]).abs().max() > 1e-3
    cache = TurboQuantCache(model, cfg, backend="reference", key_transforms=spread)
    _chunked(model, cache, ids, 60)
    store = cache.layers[0].store
    assert store.sink_k.shape == (2, 2, fmt.sink_tokens, 32) and bool(store.sink_k.abs().sum() > 0)
    exact_row = 2 * 32 * 4 * 2  # K and V, fp32 model, 2 KV heads
    assert store.used_bytes() == 2 * 60 * 2 * fmt.bytes_per_token(32) + 2 * (16 + fmt.sink_tokens) * exact_row


@pytest.mark.slow  # ~30 CPU-s in the interpreter; the quick lane keeps the klt kernels' own tests
@pytest.mark.kernel
def test_triton_kernels_serve_klt_keys_like_the_reference():
    """The 5x preset's format (klt keys, mse values) through the Triton kernels — compress-on-write at the keys'
    positions, chunked prefill, decode steps (the interpreter on CPU) — gives the reference path's logits."""
    from tests.helpers.klt_cases import uneven_transform

    model = _model()
    gen = torch.Generator().manual_seed(0)
    rot = model_rotary(model)
    transforms = [
        dataclasses.replace(uneven_transform(2, 32, KLT.key_code_bits(32), 32, 1.0, gen), rotary=rot) for _ in range(3)
    ]
    # 3 decode steps (each compresses the ring's oldest token): the interpreter's decode of mse values costs
    # ~8 CPU-s a step here, and every step after the first runs the same code
    ids = torch.randint(0, 256, (2, 53), generator=gen)
    logits = {}
    for backend in ("reference", "triton"):
        cache = TurboQuantCache(model, CFG, backend=backend, key_transforms=transforms)
        with torch.no_grad():
            prefill = _chunked(model, cache, ids[:, :50], 25)
            steps = [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(50, 53)]
        logits[backend] = torch.cat([prefill, *steps], 1)
    assert bool(torch.isfinite(logits["triton"]).all())
    torch.testing.assert_close(logits["triton"], logits["reference"], rtol=1e-2, atol=1e-2)
