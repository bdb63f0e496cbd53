"""YAML presets and validation: unknown keys, bad values and head-dim mismatches are named errors."""

import pytest

from jetson_tq import FP16_FORMAT, KVFormat, load_config, preset_names
from jetson_tq.config import config_from_dict
from jetson_tq.errors import ConfigError


def test_presets_load_with_expected_bytes():
    assert {"blog_k3v2", "k4v4", "mse_k3v2", "fp16"} <= set(preset_names())
    bytes_128 = {
        name: load_config(name).default.bytes_per_token(128) for name in ("blog_k3v2", "k4v4", "mse_k3v2", "fp16")
    }
    assert bytes_128 == {"blog_k3v2": 100, "k4v4": 148, "mse_k3v2": 98, "fp16": 512}
    blog = load_config("blog_k3v2").default
    assert (blog.key_mode, blog.key_bits, blog.key_mse_bits, blog.value_bits, blog.value_group, blog.recent_tokens) == (
        "prod",
        3,
        2,
        2,
        32,
        128,
    )


def test_uniform_key_preset_has_the_default_presets_bytes():
    uni, lm = load_config("mse_k4v3u").default, load_config("mse_k4v3").default
    assert (uni.key_codebook, lm.key_codebook) == ("uniform", "lloyd_max")
    assert uni.with_(key_codebook="lloyd_max") == lm
    assert [uni.bytes_per_token(d) for d in (64, 128)] == [lm.bytes_per_token(d) for d in (64, 128)] == [62, 122]
    with pytest.raises(ConfigError, match="key_codebook"):
        config_from_dict({"keys": {"mode": "mse", "bits": 4, "codebook": "nf4"}})


def test_window_key_and_preset_windows():
    assert config_from_dict({"buffer": {"recent_tokens": 64, "window": "block"}}).default.exact_start(100) == 64
    assert config_from_dict({}).default == KVFormat() == load_config("mse_k4v3").default  # one default everywhere
    assert KVFormat().window == "block"
    assert load_config("mse_k4v3").default.window == "block" and load_config("blog_k3v2").default.window == "sliding"


def test_layer_policy_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "keys: {mode: mse, bits: 4}\n"
        "layers: {keep_fp16_first: 1, keep_fp16_last: 2, overrides: {3: {keys: {bits: 2}}}}\n"
    )
    cfg = load_config(path)
    assert cfg.format_for_layer(0, 10) == FP16_FORMAT
    assert cfg.format_for_layer(8, 10) == FP16_FORMAT and cfg.format_for_layer(9, 10) == FP16_FORMAT
    assert cfg.format_for_layer(3, 10).key_bits == 2 and cfg.format_for_layer(3, 10).key_mode == "mse"
    assert cfg.format_for_layer(4, 10).key_bits == 4
    with pytest.raises(ConfigError):
        cfg.format_for_layer(10, 10)


@pytest.mark.parametrize(
    "raw,match",
    [
        ({"keyz": {}}, "unknown key"),
        ({"keys": {"mode": "prod", "bitz": 3}}, r"keys: unknown key"),
        ({"keys": {"bits": 12}}, "key_bits"),
        ({"values": {"mode": "int3"}}, "value_mode"),
        ({"buffer": {"recent_tokens": -5}}, "recent_tokens"),
        ({"buffer": {"window": "ring"}}, "window"),
        ({"layers": {"keep_fp16_first": "two"}}, "keep_fp16_first"),
        ({"layers": {"overrides": {"x": {}}}}, "integers"),
        ({"layers": {"overrides": {2: {"layers": {}}}}}, "unknown key"),
        ({"keys": [1, 2]}, "mapping"),
    ],
)
def test_bad_configs_name_the_problem(raw, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(raw)


def test_head_dim_mismatch_and_missing_files(tmp_path):
    cfg = config_from_dict({"values": {"group_size": 48}})
    assert cfg.format_for_layer(0, 4).value_group_for(128) == 32  # fitted to the head dim
    with pytest.raises(ConfigError, match="does not divide head_dim 131"):
        cfg.check_model(num_layers=4, head_dim=131)  # prime: only groups of 1, values larger than fp16
    cfg.check_model(num_layers=4, head_dim=96)
    with pytest.raises(ConfigError, match="no config"):
        load_config("does_not_exist")
    bad = tmp_path / "bad.yaml"
    bad.write_text("keys: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_reproducible_field():
    assert config_from_dict({}).reproducible is False
    assert config_from_dict({"reproducible": True}).reproducible is True
    with pytest.raises(ConfigError, match="reproducible: expected true or false, got str 'yes'"):
        config_from_dict({"reproducible": "yes"})
