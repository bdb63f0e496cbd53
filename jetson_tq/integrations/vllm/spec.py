"""What vLLM is told about each layer: compressed or stock (decided from its features), its format, and a KV
cache spec whose page is our packed page.

Which layers are compressed is decided per layer from what vLLM's ``Attention`` layer says about it
(``LayerFacts``): decoder self-attention, causal, equal K/V head sizes, no ALiBi, no KV sharing, no backend of the
model's own choosing, not a speculative-decoding proposer's (EAGLE / MTP head, draft model) (attention sinks, a logit
soft cap and a sliding window are served: ``attention.extras``); and its format must compress something: a layer
whose format stores keys and values exactly (``KVFormat.is_passthrough``: the fp16 preset, ``keep_fp16_first`` /
``keep_fp16_last`` layers) saves no byte on our kernels and would only sum in another order than stock, so it stays
on stock attention, bit-identical to vLLM without the plugin. Every other layer keeps vLLM's stock attention
(``stock_reason`` says why); only what neither can serve is refused (``refusal``: a KV cache dtype set beside the
switch, a layer reading a compressed layer's cache).

vLLM divides its KV budget by the sum over layers of ``page_size_bytes`` to get ``num_blocks``, so
returning ``num_kv_heads * PagedLayout(fmt, head_dim, block_size).page_bytes`` here is exactly what
makes vLLM's own capacity (blocks, "KV cache size: N tokens") grow by the format's ratio. Layers of
different formats get different page sizes; vLLM then groups all full-attention layers (ours and stock)
into one ``UniformTypeKVCacheSpecs`` (one block table, per-layer tensor sizes), so nothing is padded.
Beside stock layers of another kind (sliding window, Mamba), vLLM's hybrid KV-cache manager puts each
kind in its own group and needs one page size for all groups: ``hybrid_page`` then gives a compressed
layer the block size whose packed page fills a whole multiple of the stock page (the rest is padding,
``PagedLayout.page_stride``), so the compressed groups hold several times more tokens per block.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from ...config import TurboQuantConfig
from ...errors import ConfigError, FormatError, UnsupportedModelError
from ...format import PREFILL_WORKSPACE_BYTES, KVFormat, PagedLayout, next_pow2


@dataclass(frozen=True)
class LayerFacts:
    """What vLLM's ``Attention`` layer says about one layer: the facts our choice of backend depends on."""

    name: str
    head_size: int
    num_heads: int = 1
    num_kv_heads: int = 1
    head_size_v: int | None = None
    attn_type: str = "decoder"
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    alibi: bool = False
    sinks: bool = False
    kv_sharing_target: str | None = None
    kv_cache_dtype: str = "auto"
    non_causal: bool = False  # a prefix-LM / bidirectional layer (multimodal prefix, use_non_causal)
    extra: tuple[str, ...] = ()  # other implementation arguments the model set
    own_backend: str | None = None  # the attention backend the model chose itself for this layer
    draft: bool = False  # a layer of a speculative-decoding proposer (EAGLE / MTP head, draft model)


#: why a layer whose format stores keys and values exactly runs stock (the startup log's words)
EXACT_FORMAT_REASON = "format stores keys and values exactly (fp16)"
#: why a speculative-decoding proposer's layer runs stock (the startup log's words)
DRAFT_REASON = "speculative-decoding draft model (its few layers stay stock; the target model's are compressed)"


def stock_reason(facts: LayerFacts, max_model_len: int | None, fmt: KVFormat | None = None) -> str | None:
    """Why this layer stays on vLLM's stock attention (None: it is compressed): a feature the TurboQuant backend
    does not reproduce, else a format ``fmt`` (the layer's under the active config) with nothing to compress.
    Sinks, soft cap and sliding window (any length; ``max_model_len`` is not needed for them) are reproduced."""
    if facts.own_backend:
        return f"the model picks its own attention backend ({facts.own_backend})"
    if facts.draft:
        return DRAFT_REASON
    if facts.attn_type != "decoder":
        return f"attn_type {facts.attn_type!r} (only decoder self-attention is compressed)"
    if facts.non_causal:
        return "bidirectional attention (prefix-LM / non-causal)"
    if facts.head_size_v is not None and facts.head_size_v != facts.head_size:
        return f"value head size {facts.head_size_v} != key head size {facts.head_size}"
    if facts.alibi:
        return "alibi_slopes (ALiBi position bias)"
    if facts.extra:
        return f"attention arguments {list(facts.extra)}"
    if facts.kv_sharing_target:
        return f"reads the KV cache of layer {facts.kv_sharing_target}"
    if fmt is not None and fmt.is_passthrough:
        return EXACT_FORMAT_REASON
    return None


def refusal(facts: LayerFacts, compressed: set[str] | frozenset[str] = frozenset()) -> str | None:
    """Why this layer can be served neither compressed nor stock (None: it can), given the layers compressed."""
    if facts.kv_cache_dtype != "auto":
        return (
            f"kv_cache_dtype {facts.kv_cache_dtype!r} and JETSON_TQ_CONFIG both set a KV cache format; "
            "unset one of them"
        )
    if facts.kv_sharing_target and facts.kv_sharing_target in compressed:
        return (
            f"it reads the KV cache of {facts.kv_sharing_target}, which is compressed; cross-layer KV sharing "
            "onto a compressed layer is not supported (unset JETSON_TQ_CONFIG for this model)"
        )
    return None


def describe_layers(decisions: dict[str, str | None]) -> str:
    """'compressed: 1-3, 5; stock: 0, 4 (why)' for the startup log (layer numbers when the names carry them)."""

    def label(names: list[str]) -> str:
        nums = []
        for n in names:
            try:
                nums.append(layer_index(n))
            except UnsupportedModelError:
                return ", ".join(names)
        return _ranges(sorted(nums))

    ours = [n for n, why in decisions.items() if why is None]
    by_reason: dict[str, list[str]] = {}
    for n, why in decisions.items():
        if why is not None:
            by_reason.setdefault(why, []).append(n)
    parts = [f"compressed {len(ours)} of {len(decisions)} attention layers" + (f" ({label(ours)})" if ours else "")]
    parts += [f"stock {label(names)}: {why}" for why, names in by_reason.items()]
    return "; ".join(parts)


def _ranges(nums: list[int]) -> str:
    out, i = [], 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ", ".join(out)


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


def layout_for(fmt: KVFormat, head_dim: int, block_size: int, page_stride: int = 0) -> PagedLayout:
    """The page layout vLLM's page size derives from (FormatError -> ConfigError naming the layer's values)."""
    try:
        return PagedLayout(fmt, head_dim, block_size, page_stride)
    except FormatError as e:
        raise ConfigError(f"head_dim {head_dim}, block_size {block_size}, page_stride {page_stride}: {e}") from e


def format_items(fmt: KVFormat) -> tuple:
    """The format as sorted (field, value) pairs: hashable, picklable, and enough to rebuild it (``format_of``)."""
    return tuple(sorted(fmt.to_dict().items()))


@functools.lru_cache(maxsize=64)
def format_of(items: tuple) -> KVFormat:
    """The KVFormat of ``format_items`` pairs."""
    return KVFormat(**dict(items))


@functools.lru_cache(maxsize=1024)
def packed_page_bytes(items: tuple, head_dim: int, block_size: int) -> int:
    """Packed bytes of one (block, KV head) page of this format (no padding)."""
    return PagedLayout(format_of(items), head_dim, block_size).packed_bytes


def hybrid_page(
    fmt: KVFormat,
    head_dim: int,
    num_kv_heads: int,
    stock_page: int,
    unit: int,
    max_multiple: int = 4,
    good_enough: float = 0.1,
) -> tuple[int, int]:
    """(block_size, page bytes per KV head) of a compressed layer whose whole page (all KV heads) must be a
    multiple m <= ``max_multiple`` of ``stock_page`` (the largest page of the stock layers vLLM groups it with).

    The block size is the largest multiple of ``unit`` whose packed page fits; the rest of the page is padding.
    The smallest m whose padding is at most ``good_enough`` of the page wins, else the m with the least padding.
    """
    items = format_items(fmt)
    per_unit = packed_page_bytes(items, head_dim, unit)
    best: tuple[float, int, int] | None = None
    for m in range(1, max_multiple + 1):
        whole = m * stock_page
        if whole % (16 * num_kv_heads):
            continue
        per_head = whole // num_kv_heads
        k = per_head // per_unit
        while k > 0 and packed_page_bytes(items, head_dim, k * unit) > per_head:
            k -= 1
        if k == 0:
            continue
        waste = 1 - packed_page_bytes(items, head_dim, k * unit) / per_head
        if best is None or waste < best[0]:
            best = (waste, k * unit, per_head)
        if waste <= good_enough:
            break
    if best is None:
        raise UnsupportedModelError(
            f"no block size fits a compressed page ({per_unit} B per {unit}-token block and KV head, {num_kv_heads} "
            f"KV heads) into up to {max_multiple} stock pages of {stock_page} B that vLLM's hybrid KV cache groups "
            "share; start vLLM with --disable-hybrid-kv-cache-manager or unset JETSON_TQ_CONFIG"
        )
    return best[1], best[2]


def _full_attention_spec_cls():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec


def _make_spec_cls():
    FullAttentionSpec = _full_attention_spec_cls()

    @dataclass(frozen=True, kw_only=True)
    class TurboQuantPagedSpec(FullAttentionSpec):  # type: ignore[valid-type,misc]  # a base class loaded lazily
        """Full attention whose page is ``num_kv_heads`` packed (block, head) pages of the format ``tq_format``.

        The page follows ``block_size`` (vLLM may scale it by a whole ratio to unify page sizes): packed, or padded
        to ``tq_page_stride`` bytes per KV head at ``tq_stride_block`` tokens (``hybrid_page``). The padding is part
        of the page rather than vLLM's ``page_size_padded``, so the tensor vLLM binds is [blocks, heads, stride].
        """

        tq_format: tuple = ()  # format_items(fmt)
        tq_recent_tokens: int = 0
        tq_block_window: bool = False
        tq_page_stride: int = 0
        tq_stride_block: int = 0

        @property
        def real_page_size_bytes(self) -> int:
            if self.tq_page_stride:
                return self.num_kv_heads * self.tq_page_stride * self.block_size // self.tq_stride_block
            return self.num_kv_heads * packed_page_bytes(self.tq_format, self.head_size, self.block_size)

        @classmethod
        def merge(cls, specs):
            merged = super().merge(specs)
            first = specs[0]
            keys = ("tq_format", "tq_recent_tokens", "tq_block_window", "tq_page_stride", "tq_stride_block")
            for s in specs:
                # AssertionError is vLLM's signal "not one spec": it then builds UniformTypeKVCacheSpecs.
                assert all(getattr(s, k) == getattr(first, k) for k in keys), "different jetson-tq formats"
            return replace(merged, **{k: getattr(first, k) for k in keys})

    TurboQuantPagedSpec.__module__ = __name__
    TurboQuantPagedSpec.__qualname__ = "TurboQuantPagedSpec"

    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    @dataclass(frozen=True, kw_only=True)
    class TurboQuantSlidingSpec(SlidingWindowSpec):
        """A sliding-window layer with ``TurboQuantPagedSpec``'s packed page: vLLM's sliding-window manager then
        frees the blocks that leave the window (a request holds window-sized state in this layer) and its hybrid
        KV-cache manager groups it apart from full-attention layers, at the same page size."""

        tq_format: tuple = ()
        tq_recent_tokens: int = 0
        tq_block_window: bool = False
        tq_page_stride: int = 0
        tq_stride_block: int = 0

        real_page_size_bytes = TurboQuantPagedSpec.real_page_size_bytes

    TurboQuantSlidingSpec.__module__ = __name__
    TurboQuantSlidingSpec.__qualname__ = "TurboQuantSlidingSpec"
    return TurboQuantPagedSpec, TurboQuantSlidingSpec


_SPEC_CLS: tuple | None = None


def spec_cls(sliding: bool = False):
    """The TurboQuantPagedSpec class, or TurboQuantSlidingSpec with ``sliding`` (built on first use so importing
    this module does not import vLLM)."""
    global _SPEC_CLS
    if _SPEC_CLS is None:
        _SPEC_CLS = _make_spec_cls()
    return _SPEC_CLS[1 if sliding else 0]


def __getattr__(name: str):
    # Lets pickle find ``jetson_tq.integrations.vllm.spec.TurboQuant*Spec`` in the engine-core process.
    if name in ("TurboQuantPagedSpec", "TurboQuantSlidingSpec"):
        return spec_cls(name == "TurboQuantSlidingSpec")
    raise AttributeError(name)


def make_spec(
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    fmt: KVFormat,
    layout: PagedLayout,
    sliding_window: int | None = None,
):
    """The spec vLLM sizes this layer's cache from (dtype uint8: the cache is raw packed bytes; a padded layout's
    ``page_stride``, planned by ``hybrid_page``, is the page); a layer with a ``sliding_window`` gets the
    sliding-window counterpart (vLLM's ``SlidingWindowSpec``), as vLLM's own ``Attention`` layer does."""
    window = {} if sliding_window is None else {"sliding_window": int(sliding_window)}
    return spec_cls(sliding_window is not None)(
        **window,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        head_size_v=head_size,
        dtype=torch.uint8,
        tq_format=format_items(fmt),
        tq_recent_tokens=fmt.recent_tokens,
        tq_block_window=fmt.block_window,
        tq_page_stride=layout.page_stride,
        tq_stride_block=block_size if layout.page_stride else 0,
    )


def layout_of_spec(spec, head_dim: int) -> PagedLayout:
    """The page layout a (possibly rescaled or padded by vLLM) TurboQuantPagedSpec describes (ShapeError-like
    UnsupportedModelError when vLLM's padded page is no whole number of 16-byte-aligned pages per KV head)."""
    if spec.page_size_padded is not None:
        raise UnsupportedModelError(
            f"vLLM padded a compressed page to {spec.page_size_padded} B (its own padding; "
            "jetson-tq plans its pages to need none)"
        )
    whole, fmt = spec.page_size_bytes, format_of(spec.tq_format)
    if whole == spec.num_kv_heads * packed_page_bytes(spec.tq_format, head_dim, spec.block_size):
        return layout_for(fmt, head_dim, spec.block_size)
    if whole % (16 * spec.num_kv_heads):
        raise UnsupportedModelError(
            f"a compressed page of {whole} B does not split into {spec.num_kv_heads} "
            "KV-head pages of a multiple of 16 B"
        )
    return layout_for(fmt, head_dim, spec.block_size, whole // spec.num_kv_heads)


def stock_page_at(spec, block_size: int) -> int:
    """A stock layer's page at ``block_size`` tokens when its page scales with its block size and divides evenly
    (attention specs), else its page as it is (e.g. Mamba state pages)."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    if isinstance(spec, AttentionSpec) and spec.page_size_padded is None and block_size % spec.block_size == 0:
        return spec.page_size_bytes * (block_size // spec.block_size)
    return spec.page_size_bytes


def window_unit(cache_block_size: int, window_block: int) -> int:
    """Granularity of a compressed layer's block size in hybrid groups: a multiple of vLLM's block size (prefix
    hits and the scheduler's alignment), of the block window (prefix hits restart rings) and of 16 (pages stay
    linear in the block size)."""
    return math.lcm(cache_block_size, window_block, 16)


def prefill_transient_bytes(
    fmt: KVFormat, num_heads: int, num_kv_heads: int, head_dim: int, tokens: int, max_len: int, elt: int
) -> int:
    """Peak bytes of one Triton prefill call's temporaries for a ``tokens``-token chunk of a request up to
    ``max_len`` tokens: the fp32 transformed query, the output, the dequantized fp16 workspace (capped by the
    ``format.PREFILL_WORKSPACE_BYTES``) and, when the history needs several workspace segments, the fp32 running
    state.
    vLLM's start-up profile runs attention without metadata, so it never sees these; the worker budget sets them
    aside."""
    dp = next_pow2(head_dim)
    prod = fmt.key_mode == "prod"
    kw, qw = (2 * dp, 2 * head_dim) if prod else (dp, head_dim)
    whole = num_kv_heads * max_len * (kw + dp) * 2
    workspace = min(whole, PREFILL_WORKSPACE_BYTES) + num_kv_heads * 64 * (kw + dp) * 2  # rounded to the tile sizes
    state = tokens * num_heads * (dp + 2) * 4 if whole > PREFILL_WORKSPACE_BYTES else 0
    return tokens * num_heads * (qw * 4 + head_dim * elt) + workspace + state
