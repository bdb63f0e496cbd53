"""What vLLM is told about each layer: its format, and a KV cache spec whose page is our packed page.

vLLM divides its KV budget by the sum over layers of ``page_size_bytes`` to get ``num_blocks``, so
returning ``num_kv_heads * PagedLayout(fmt, head_dim, block_size).page_bytes`` here is exactly what
makes vLLM's own capacity (blocks, "KV cache size: N tokens") grow by the format's ratio. Layers of
different formats get different page sizes; vLLM then groups all layers into one
``UniformTypeKVCacheSpecs`` (one block table, per-layer tensor sizes), so nothing is padded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...config import TurboQuantConfig
from ...errors import ConfigError, FormatError, UnsupportedPlatformError
from ...format import KVFormat, PagedLayout

#: Architectures whose attention the backend reproduces exactly (causal GQA/MHA, no sliding window,
#: no ALiBi, no soft cap, no sinks). Anything else is refused at startup.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


class UnsupportedModelError(UnsupportedPlatformError):
    """The model (architecture or attention feature) is not one the TurboQuant backend reproduces."""


def check_architecture(architectures: list[str] | None) -> None:
    """Raise UnsupportedModelError unless the model is one of SUPPORTED_ARCHITECTURES."""
    archs = list(architectures or [])
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise UnsupportedModelError(
            f"model architecture {archs}: jetson-tq's vLLM backend supports {list(SUPPORTED_ARCHITECTURES)}; "
            "unset JETSON_TQ_CONFIG to run this model on stock vLLM"
        )


def layer_index(layer_name: str) -> int:
    """The decoder layer number inside a vLLM layer name such as ``model.layers.7.self_attn.attn``."""
    numbers = [int(p) for p in layer_name.split(".") if p.isdigit()]
    if len(numbers) != 1:
        raise UnsupportedModelError(f"layer name {layer_name!r}: expected exactly one layer number")
    return numbers[0]


def layer_format(cfg: TurboQuantConfig, index: int, num_layers: int, head_dim: int) -> KVFormat:
    """The format of layer ``index`` under ``cfg`` (ConfigError when it cannot store this head dim)."""
    cfg.check_model(num_layers, head_dim)
    return cfg.format_for_layer(index, num_layers)


def layout_for(fmt: KVFormat, head_dim: int, block_size: int) -> PagedLayout:
    """The page layout vLLM's page size derives from (FormatError -> ConfigError naming the layer's values)."""
    try:
        return PagedLayout(fmt, head_dim, block_size)
    except FormatError as e:
        raise ConfigError(f"head_dim {head_dim}, block_size {block_size}: {e}") from e


def format_key(fmt: KVFormat) -> str:
    """A short stable text identifying a format (layers of one key share one metadata builder)."""
    d = fmt.to_dict()
    return ",".join(f"{k}={d[k]}" for k in sorted(d))


def _full_attention_spec_cls():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec


def _make_spec_cls():
    FullAttentionSpec = _full_attention_spec_cls()

    @dataclass(frozen=True, kw_only=True)
    class TurboQuantPagedSpec(FullAttentionSpec):
        """Full attention whose page is ``num_kv_heads`` packed (block, head) pages of ``tq_page_bytes``."""

        tq_page_bytes: int = 0
        tq_recent_tokens: int = 0
        tq_block_window: bool = False
        tq_format: str = ""

        @property
        def real_page_size_bytes(self) -> int:
            return self.num_kv_heads * self.tq_page_bytes

        @classmethod
        def merge(cls, specs):
            merged = super().merge(specs)
            first = specs[0]
            for s in specs:
                # AssertionError is vLLM's signal "not one spec": it then builds UniformTypeKVCacheSpecs.
                assert (s.tq_page_bytes, s.tq_recent_tokens, s.tq_block_window, s.tq_format) == (
                    first.tq_page_bytes, first.tq_recent_tokens, first.tq_block_window, first.tq_format), \
                    "different jetson-tq formats"
            return replace(merged, tq_page_bytes=first.tq_page_bytes, tq_recent_tokens=first.tq_recent_tokens,
                           tq_block_window=first.tq_block_window, tq_format=first.tq_format)

    TurboQuantPagedSpec.__module__ = __name__
    TurboQuantPagedSpec.__qualname__ = "TurboQuantPagedSpec"
    return TurboQuantPagedSpec


_SPEC_CLS = None


def spec_cls():
    """The TurboQuantPagedSpec class (built on first use so importing this module does not import vLLM)."""
    global _SPEC_CLS
    if _SPEC_CLS is None:
        _SPEC_CLS = _make_spec_cls()
    return _SPEC_CLS


def __getattr__(name: str):
    # Lets pickle find ``jetson_tq.integrations.vllm.spec.TurboQuantPagedSpec`` in the engine-core process.
    if name == "TurboQuantPagedSpec":
        return spec_cls()
    raise AttributeError(name)


def make_spec(block_size: int, num_kv_heads: int, head_size: int, fmt: KVFormat, layout: PagedLayout):
    """The spec vLLM sizes this layer's cache from (dtype uint8: the cache is raw packed bytes)."""
    return spec_cls()(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, head_size_v=head_size,
                      dtype=torch.uint8, tq_page_bytes=layout.page_bytes, tq_recent_tokens=fmt.buffer_tokens,
                      tq_block_window=fmt.block_window, tq_format=format_key(fmt))
