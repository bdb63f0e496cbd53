"""Our kernels compile with Triton's JIT hooks off: vLLM's JIT monitor installs a post-compile hook, and with a hook
set Triton serializes every constexpr to JSON first, which the named-tuple page bundle cannot be (H200, vLLM 0.26:
every engine with the plugin failed at its first compile before ``compile_hooks_off``)."""

from __future__ import annotations

import pytest
from triton import knobs
from triton.runtime.jit import serialize_specialization_data

from jetson_tq.format import PagedLayout
from jetson_tq.kernels import _common
from jetson_tq.kernels._launch import compile_hooks_off
from tests.helpers.kernel_cases import fmt_for


def test_a_page_bundle_constant_is_what_triton_cannot_serialize():
    if _common.INTERPRET:
        pytest.skip("under the interpreter the bundle holds plain values")
    fmt = fmt_for("mse_k4v3", 128)
    from jetson_tq.codec.kv import KVCodec

    _, bundle = _common.page_spec(PagedLayout(fmt, 128, 16), KVCodec(fmt, 128))
    with pytest.raises(TypeError, match="constexpr"):
        serialize_specialization_data("k", {}, {(0,): bundle}, {}, type("O", (), {})(), "key")


def test_compile_hooks_off_clears_both_hooks_and_restores_them_even_on_error():
    def hook(*args, **kwargs):
        return None

    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = hook
    try:
        with compile_hooks_off():
            assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None
        assert knobs.runtime.jit_cache_hook is hook and knobs.runtime.jit_post_compile_hook is hook
        with pytest.raises(RuntimeError), compile_hooks_off():
            raise RuntimeError("compile failed")
        assert knobs.runtime.jit_post_compile_hook is hook
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved
