"""The one owner of the compressed KV format: modes, bit widths, packed fields and bytes per token.

Everything that needs a size asks this module: the codec (which tensors it produces), the cache
(what it allocates), the kernels (field widths and paged offsets), vLLM's page size and the
capacity report. Nothing else re-derives a byte count.

Per token and per KV head a format stores these fields (``fields(head_dim)``):

===============  =========  ==========================================  ======================
field            dtype      elements per token                          present when
===============  =========  ==========================================  ======================
``key_idx``      uint8      ceil(D / 8) * mse_bits  packed codebook ids   key_mode prod (bits>1)
                                                                          or mse
``key_signs``    uint8      ceil(D / 8)   packed QJL signs, bit 1 = +1    key_mode prod
``key_norm``     norm       1   ||k||                                     prod, mse
``key_rnorm``    norm       1   ||r|| = ||k|| * ||k/||k|| - k_mse||       prod
``key_raw``      float16    D                                             key_mode fp16
``key_code``     uint8      ceil(key_code_bits(D) / 8)  transform code    key_mode klt
``val_codes``    uint8      ceil(D / 8) * value_bits  packed group codes  value_mode group
``val_scale``    float16    D / G   (G = ``value_group_for(D)``)          value_mode group
``val_zero``     float16    D / G                                         value_mode group
``val_idx``      uint8      ceil(D / 8) * value_bits  packed codebook ids value_mode mse
``val_norm``     norm       1                                             value_mode mse
``val_raw``      float16    D                                             value_mode fp16
===============  =========  ==========================================  ======================

Packed fields use the **planar** layout (``PACKING``; implemented by ``jetson_tq.codec.packing``),
chosen so a GPU kernel unpacks a whole (tokens, packed bytes) tile with one shift and mask per
plane and no byte shuffles (measured against the older LSB-first stream in docs/benchmarks.md):

- a ``b``-bit code is split into sub-fields of widths ``subfield_widths(b)`` (the binary digits
  of ``b``: 3 -> (2, 1), 5 -> (4, 1), 8 -> (8,)), taken from the code's low bits upwards; each
  sub-field is stored as its own run of ``CH * w`` bytes, runs in that order (``CH = ceil(D/8)``);
- inside a ``w``-bit run, coordinate ``j`` (0 <= j < 8*CH; j >= D is zero padding) sits in byte
  ``j % (CH*w)`` at bits ``[(j // (CH*w)) * w, +w)``: byte ``u`` holds coordinates
  ``u, u + CH*w, u + 2*CH*w, ...`` — every plane is a contiguous range of coordinates.

A row of D codes of b bits therefore takes ``ceil(D/8) * b`` bytes (the same as a bit stream when
8 divides D, up to b - 1 bytes more otherwise).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from dataclasses import fields as dataclass_fields
from typing import Literal

import torch

from .errors import FormatError, UnsupportedPlatformError

KeyMode = Literal["prod", "mse", "fp16", "klt"]
ValueMode = Literal["group", "mse", "fp16"]
RotationKind = Literal["auto", "hadamard", "dense"]
KeyCodebook = Literal["lloyd_max", "uniform"]
Window = Literal["sliding", "block"]

KEY_MODES: tuple[str, ...] = ("prod", "mse", "fp16", "klt")
VALUE_MODES: tuple[str, ...] = ("group", "mse", "fp16")
ROTATIONS: tuple[str, ...] = ("auto", "hadamard", "dense")
KEY_CODEBOOKS: tuple[str, ...] = ("lloyd_max", "uniform")
WINDOWS: tuple[str, ...] = ("sliding", "block")
NORM_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "float32": torch.float32}
MAX_BITS = 8
#: Head dim at which ``KVFormat.key_code_bytes`` is stated; other head dims keep its bits per coordinate.
KEY_CODE_REFERENCE_DIM = 128
#: Key / value modes as kernels see them (``PageSpec.KEY_MODE`` / ``VAL_MODE``).
KEY_RAW, KEY_MSE, KEY_PROD, KEY_KLT = 0, 1, 2, 3
VAL_RAW, VAL_GROUP, VAL_MSE = 0, 1, 2
FP16_BYTES_PER_ELEMENT = 2


@dataclass(frozen=True)
class Field:
    """One stored tensor of a token: name, element dtype and element count per token and head."""

    name: str
    dtype: torch.dtype
    count: int

    @property
    def nbytes(self) -> int:
        """Bytes this field takes per token per KV head."""
        return self.count * torch.empty((), dtype=self.dtype).element_size()


PACKING = "planar"


def subfield_widths(bits: int) -> tuple[int, ...]:
    """Widths of the planar sub-fields a ``bits``-bit code is stored as, low code bits first."""
    if bits == MAX_BITS:
        return (MAX_BITS,)
    return tuple(w for w in (4, 2, 1) if bits & w)


def packed_bytes(head_dim: int, bits: int) -> int:
    """Bytes of one packed row of ``head_dim`` codes of ``bits`` bits each (planar layout)."""
    return (head_dim + 7) // 8 * bits


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def is_power_of_two(n: int) -> bool:
    """True for 1, 2, 4, 8, ..."""
    return n >= 1 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class KVFormat:
    """How one layer's keys and values are stored.

    ``key_bits`` is the total bits per key coordinate: in ``prod`` mode that is (key_bits - 1)-bit TurboQuant_mse plus
    the 1-bit QJL sketch of the residual (the paper's TurboQuant_prod), in ``mse`` mode all bits go to the codebook.
    ``key_codebook`` picks it: ``lloyd_max`` (the MSE-optimal centroids of a rotated coordinate) or ``uniform`` (evenly
    spaced with the MSE-optimal step, c[k] = (k - (2^b - 1)/2) * step: a kernel then scores <q, c[idx]> with the index
    bits read as one tensor-core operand plane, no per-coordinate lookup); the bytes are the same either way. The
    defaults are the recommended preset ``mse_k4v3``'s bits (configs/mse_k4v3.yaml, chosen from docs/fidelity.md),
    ``window: block`` included (one default everywhere: ``KVFormat()`` is that preset); the other presets name
    ``window: sliding``, the rule their figures were measured with. Every token is stored compressed; the
    ``recent_tokens`` (R) most recent are also kept exact (a ring, token p in row p % R), and ``window`` says which of
    them a query at position p reads exactly (``exact_start``): ``sliding``, the last R ([p + 1 - R, p]); ``block``, its
    own R-token block ([p - p % R, p]; 1..R tokens), so everything before a block boundary is read compressed and a
    prefix-cache hit at that boundary needs no exact copy of the cached tokens (docs/vllm.md, "Prefix caching").
    ``flush_chunk`` is the batch in which the simulated baselines of the fidelity harness quantize their buffer (the
    paged cache does not use it). ``key_mode: klt`` codes each key before RoPE by a calibrated per-head transform
    (``codec.klt``) into ``key_code_bytes`` bytes at head dim 128 (in proportion at other head dims); the transform
    comes from a calibration file, not from the format. ``sink_tokens`` (S): the first S positions of a sequence are
    also kept exact (an attention sink: its key is atypical) and every query reads them exactly.
    """

    key_mode: KeyMode = "mse"
    key_bits: int = 4
    key_codebook: KeyCodebook = "lloyd_max"
    value_mode: ValueMode = "group"
    value_bits: int = 3
    value_group: int = 64
    norm_dtype: str = "float16"
    rotation: RotationKind = "auto"
    recent_tokens: int = 128
    window: Window = "block"
    flush_chunk: int = 64
    seed: int = 0
    key_code_bytes: int = 0
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        for name, choices in (
            ("key_mode", KEY_MODES),
            ("value_mode", VALUE_MODES),
            ("key_codebook", KEY_CODEBOOKS),
            ("rotation", ROTATIONS),
            ("window", WINDOWS),
            ("norm_dtype", tuple(NORM_DTYPES)),
        ):
            _check_choice(name, getattr(self, name), choices)
        _check_int("key_bits", self.key_bits, 1, MAX_BITS)
        _check_int("value_bits", self.value_bits, 1, MAX_BITS)
        _check_int("value_group", self.value_group, 1, 1 << 16)
        _check_int("recent_tokens", self.recent_tokens, 0, 1 << 24)
        _check_int("flush_chunk", self.flush_chunk, 1, 1 << 24)
        _check_int("seed", self.seed, 0, 2**63 - 1)
        _check_int("sink_tokens", self.sink_tokens, 0, 1 << 16)
        if self.key_mode == "klt":
            _check_int("key_code_bytes", self.key_code_bytes, 1, KEY_CODE_REFERENCE_DIM * MAX_BITS // 8)
        elif self.key_code_bytes:
            raise FormatError(
                f"key_code_bytes: only key_mode 'klt' has a transform code, this format has {self.key_mode!r}"
            )

    # ----------------------------------------------------------------------------------------
    @property
    def key_mse_bits(self) -> int:
        """Bits of the Lloyd-Max codebook index of each key coordinate (0 for 1-bit prod)."""
        if self.key_mode == "prod":
            return self.key_bits - 1
        return self.key_bits if self.key_mode == "mse" else 0

    def key_code_bits(self, head_dim: int) -> int:
        """Bits of one key's transform code at ``head_dim`` (key_mode klt; 0 otherwise)."""
        return self.key_code_bytes * 8 * head_dim // KEY_CODE_REFERENCE_DIM

    @property
    def norm_torch_dtype(self) -> torch.dtype:
        return NORM_DTYPES[self.norm_dtype]

    @property
    def is_passthrough(self) -> bool:
        """True when nothing is compressed (fp16 keys and values)."""
        return self.key_mode == "fp16" and self.value_mode == "fp16"

    def with_(self, **changes) -> KVFormat:
        """A copy with some fields changed (validated again)."""
        names = [f.name for f in dataclass_fields(self)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise FormatError(f"with_: unknown field(s) {unknown}; expected some of {names}")
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    # ----------------------------------------------------------------------------------------
    def check_head_dim(self, head_dim: int) -> None:
        """Raise FormatError unless this format can store vectors of ``head_dim``."""
        if not isinstance(head_dim, int) or head_dim < 2:
            raise FormatError(f"head_dim: expected an integer >= 2, got {head_dim!r}")
        if self.value_mode == "group":
            group = self.value_group_for(head_dim)
            values = sum(f.nbytes for f in self._group_value_fields(head_dim))
            if group != self.value_group and values >= head_dim * FP16_BYTES_PER_ELEMENT:
                raise FormatError(
                    f"value_group {self.value_group} does not divide head_dim {head_dim} and the largest group that "
                    f"does and is not larger ({group}) stores {values} B of values per token, not less than fp16's "
                    f"{head_dim * FP16_BYTES_PER_ELEMENT} B; set values.group_size to a divisor of {head_dim}"
                )
        if self.key_mode == "klt" and self.key_code_bits(head_dim) < 1:
            raise FormatError(f"key_code_bytes {self.key_code_bytes} leaves no code bits at head_dim {head_dim}")
        if self.rotation == "hadamard" and not is_power_of_two(head_dim):
            raise FormatError(
                f"rotation 'hadamard' needs a power-of-two head_dim, got {head_dim}; use 'dense' or 'auto'"
            )

    def value_group_for(self, head_dim: int) -> int:
        """The value group size stored at ``head_dim``: ``value_group`` if it divides ``head_dim``, else the
        largest divisor of ``head_dim`` below it (64 -> 40 at D=80, 48 at D=96, 56 at D=112, 40 at D=160), so a
        preset serves every head dim with its bits; ``head_dim`` itself when it is smaller than the group."""
        if head_dim % self.value_group == 0:
            return self.value_group
        return max(g for g in range(1, min(self.value_group, head_dim) + 1) if head_dim % g == 0)

    def rotation_for(self, head_dim: int) -> str:
        """The concrete rotation kind used at ``head_dim`` ('auto' picks Hadamard when it can)."""
        if self.rotation == "auto":
            return "hadamard" if is_power_of_two(head_dim) else "dense"
        return self.rotation

    def key_fields(self, head_dim: int) -> list[Field]:
        self.check_head_dim(head_dim)
        nd = self.norm_torch_dtype
        if self.key_mode == "fp16":
            return [Field("key_raw", torch.float16, head_dim)]
        if self.key_mode == "klt":
            return [Field("key_code", torch.uint8, (self.key_code_bits(head_dim) + 7) // 8)]
        fields: list[Field] = []
        if self.key_mse_bits > 0:
            fields.append(Field("key_idx", torch.uint8, packed_bytes(head_dim, self.key_mse_bits)))
        if self.key_mode == "prod":
            fields.append(Field("key_signs", torch.uint8, packed_bytes(head_dim, 1)))
        fields.append(Field("key_norm", nd, 1))
        if self.key_mode == "prod":
            fields.append(Field("key_rnorm", nd, 1))
        return fields

    def value_fields(self, head_dim: int) -> list[Field]:
        self.check_head_dim(head_dim)
        if self.value_mode == "fp16":
            return [Field("val_raw", torch.float16, head_dim)]
        if self.value_mode == "mse":
            return [
                Field("val_idx", torch.uint8, packed_bytes(head_dim, self.value_bits)),
                Field("val_norm", self.norm_torch_dtype, 1),
            ]
        return self._group_value_fields(head_dim)

    def _group_value_fields(self, head_dim: int) -> list[Field]:
        groups = head_dim // self.value_group_for(head_dim)
        return [
            Field("val_codes", torch.uint8, packed_bytes(head_dim, self.value_bits)),
            Field("val_scale", torch.float16, groups),
            Field("val_zero", torch.float16, groups),
        ]

    def fields(self, head_dim: int) -> list[Field]:
        """All stored fields of one compressed token of one KV head, keys first."""
        return self.key_fields(head_dim) + self.value_fields(head_dim)

    def bytes_per_token(self, head_dim: int) -> int:
        """Bytes of one compressed token of one KV head (keys + values), from the packed layout."""
        return sum(f.nbytes for f in self.fields(head_dim))

    def key_bytes_per_token(self, head_dim: int) -> int:
        return sum(f.nbytes for f in self.key_fields(head_dim))

    def value_bytes_per_token(self, head_dim: int) -> int:
        return sum(f.nbytes for f in self.value_fields(head_dim))

    def breakdown(self, head_dim: int) -> dict[str, int]:
        """Bytes per token per KV head, field by field (for reports)."""
        return {f.name: f.nbytes for f in self.fields(head_dim)}

    def compression_ratio(self, head_dim: int) -> float:
        """fp16 K+V bytes over compressed bytes, per token (buffer not counted)."""
        return fp16_bytes_per_token(head_dim) / self.bytes_per_token(head_dim)

    @property
    def block_window(self) -> bool:
        """True when a query reads its own ``recent_tokens``-token block exactly (``window: block``; with no
        buffer both windows are empty and this is False)."""
        return self.window == "block" and self.recent_tokens > 0

    def exact_start(self, pos):
        """First position a query at ``pos`` reads exactly (may be < 0); int, NumPy array or tensor alike."""
        return exact_start(pos, self.recent_tokens, self.block_window)

    def sequence_bytes(self, tokens: int, head_dim: int, buffer_element_bytes: int = 2) -> int:
        """Bytes one sequence of ``tokens`` tokens takes per KV head: every token compressed + the exact ring."""
        if self.is_passthrough:
            return tokens * fp16_bytes_per_token(head_dim)
        exact = min(tokens, self.recent_tokens) + min(tokens, self.sink_tokens)  # the ring's last R, the sink's first S
        return tokens * self.bytes_per_token(head_dim) + exact * 2 * head_dim * buffer_element_bytes


def exact_start(pos, ring: int, block: bool):
    """The window rule, the one definition every path follows: a query at position ``pos`` reads positions
    [exact_start, pos] exactly (from the ring / its own chunk) and everything older compressed. Sliding: the last
    ``ring`` positions (pos + 1 - ring); block: its own ``ring``-token block (pos - pos % ring). Elementwise on
    ints, NumPy arrays and tensors; the Triton kernels (``kernels.prefill_dequant._window_lo``, ``kernels.append``)
    mirror it. A sequence of L tokens then reads ``L - max(exact_start(L - 1), 0)`` of them exactly."""
    if block:
        return pos - pos % ring
    return pos + 1 - ring


def exact_count(length, ring: int, block: bool):
    """Tokens of a sequence of ``length`` tokens that its last query (at length - 1) reads exactly: min(L, R)
    (sliding) or (L - 1) % R + 1 (block; 0 for L = 0). Elementwise on ints, NumPy arrays and tensors."""
    if block:
        return (length + ring - 1) % ring + 1 - (length == 0) * ring
    return length - (length - ring) * (length > ring)


def fp16_bytes_per_token(head_dim: int) -> int:
    """Bytes of an uncompressed fp16/bf16 token of one KV head (keys + values)."""
    _check_int("head_dim", head_dim, 1, 1 << 62)
    return 2 * head_dim * FP16_BYTES_PER_ELEMENT


@dataclass(frozen=True)
class PagedLayout:
    """Byte layout of one (block, KV head) page of a paged cache, structure-of-arrays.

    A page holds ``block_size`` tokens. Each field occupies a contiguous region of
    ``block_size * field.nbytes`` bytes, so a kernel loads a (tokens, field bytes) tile of one
    field in one coalesced sweep. Regions are placed in ``fields()`` order, each start rounded up
    to 16 bytes; ``page_bytes`` is the sum, also a multiple of 16. ``page_stride`` (0: none) pads every page to
    that many bytes, unused at its end: vLLM's hybrid KV-cache groups (compressed layers beside stock
    sliding-window ones) need every group's page to be the same size (``integrations/vllm/spec.py``).
    """

    fmt: KVFormat
    head_dim: int
    block_size: int
    page_stride: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.fmt, KVFormat):
            raise FormatError(f"fmt: expected a KVFormat, got {type(self.fmt).__name__} {self.fmt!r}")
        _check_int("block_size", self.block_size, 1, 1 << 16)
        _check_int("page_stride", self.page_stride, 0, 1 << 40)
        self.fmt.check_head_dim(self.head_dim)
        if self.page_stride and (self.page_stride % 16 or self.page_stride < self.packed_bytes):
            raise FormatError(
                f"page_stride: expected 0 or a multiple of 16 >= the packed page's {self.packed_bytes} "
                f"bytes, got {self.page_stride}"
            )

    def offsets(self) -> dict[str, int]:
        """Byte offset of each field's region inside a page (computed once per layout)."""
        return dict(self._offsets)

    @functools.cached_property
    def _offsets(self) -> dict[str, int]:
        out: dict[str, int] = {}
        pos = 0
        for f in self.fmt.fields(self.head_dim):
            out[f.name] = pos
            pos = _round_up(pos + f.nbytes * self.block_size, 16)
        return out

    @functools.cached_property
    def packed_bytes(self) -> int:
        """Bytes the fields of one page occupy (block_size tokens of one KV head)."""
        pos = 0
        for f in self.fmt.fields(self.head_dim):
            pos = _round_up(pos + f.nbytes * self.block_size, 16)
        return pos

    @functools.cached_property
    def page_bytes(self) -> int:
        """Bytes from one page to the next: the packed page, or ``page_stride`` when set."""
        return self.page_stride or self.packed_bytes


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """One of ``choices`` (a string: a list or other unhashable value is named, not a TypeError from ``in``)."""
    if not isinstance(value, str) or value not in choices:
        given = repr(value) if isinstance(value, str) else f"{type(value).__name__} {value!r}"
        raise FormatError(f"{name}: expected one of {choices}, got {given}")


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise FormatError(f"{name}: expected an integer in [{lo}, {hi}], got {value!r}")


#: Uncompressed fp16 keys and values (passthrough), e.g. for layers kept in full precision.
FP16_FORMAT = KVFormat(key_mode="fp16", value_mode="fp16", recent_tokens=0, flush_chunk=1)


# ------------------------------------------------------------------------------------------------
# The kernels' view of a page: every compile-time fact a paged kernel is specialized on, derived once
# from PagedLayout (offsets, sub-field widths, chunking), so no kernel re-derives a byte count.
def _widths(bits: int) -> tuple[int, int, int]:
    """Up to three planar sub-field widths of a ``bits``-bit code, zero-padded."""
    w = subfield_widths(bits) if bits else ()
    return tuple(w) + (0,) * (3 - len(w))  # type: ignore[return-value]


@dataclass(frozen=True)
class PageSpec:
    """Compile-time facts of one (block, KV head) page that kernels are specialized on. A kernel receives them as
    one ``tl.constexpr`` bundle with these field names (``kernels._common.constexpr_bundle``) and reads ``PAGE.D``."""

    D: int
    DP: int  # head dim padded to a power of two
    CH: int  # ceil(D / 8): coordinates per 1-bit plane
    BS: int  # tokens per page (vLLM block_size)
    PB: int  # page bytes
    KEY_MODE: int
    KB: int  # bits of a key codebook index (0 when none)
    KW0: int
    KW1: int
    KW2: int
    KCW: int  # coordinates per key chunk (CH * smallest sub-field width)
    KCH: int  # key chunks (D padded to 8*CH coordinates = KCH * KCW)
    OFF_KIDX: int
    OFF_KSGN: int
    OFF_KNORM: int
    OFF_KRNORM: int
    OFF_KRAW: int
    OFF_KCODE: int  # klt keys: the transform code's region
    KCB: int  # klt keys: bytes of one key's code (0 otherwise)
    NORM_F32: bool
    VAL_MODE: int
    VB: int
    VW0: int
    VW1: int
    VW2: int
    VCW: int  # coordinates per value chunk
    VCH: int
    GROUP: int
    NG: int
    OFF_VCODES: int
    OFF_VSCALE: int
    OFF_VZERO: int
    OFF_VRAW: int
    OFF_VIDX: int  # mse values: the packed codebook indices' region
    OFF_VNORM: int  # ... and the norms'
    RAW_BF16: bool

    @staticmethod
    def of(layout: PagedLayout, raw_dtype: torch.dtype = torch.float16) -> PageSpec:
        """The spec of ``layout`` with raw (fp16-mode) fields in ``raw_dtype`` (UnsupportedPlatformError if no kernel
        handles it)."""
        return _page_spec(layout, raw_dtype)


@functools.lru_cache(maxsize=256)
def _page_spec(layout: PagedLayout, raw_dtype: torch.dtype) -> PageSpec:
    fmt, d = layout.fmt, layout.head_dim
    reason = kernel_unsupported_reason(layout)
    if reason:
        raise UnsupportedPlatformError(f"no Triton kernel for this format: {reason}")
    off = layout.offsets()
    ch = (d + 7) // 8
    key_mode = {"fp16": KEY_RAW, "mse": KEY_MSE, "prod": KEY_PROD, "klt": KEY_KLT}[fmt.key_mode]
    kb = fmt.key_mse_bits if key_mode in (KEY_MSE, KEY_PROD) else 0
    val_mode = {"fp16": VAL_RAW, "group": VAL_GROUP, "mse": VAL_MSE}[fmt.value_mode]
    vb = fmt.value_bits if val_mode != VAL_RAW else 0
    group = fmt.value_group_for(d) if val_mode == VAL_GROUP else d
    return PageSpec(
        D=d,
        DP=max(16, next_pow2(d)),
        CH=ch,
        BS=layout.block_size,
        PB=layout.page_bytes,
        KEY_MODE=key_mode,
        **_planar_chunks("K", kb, ch),
        OFF_KIDX=off.get("key_idx", 0),
        OFF_KSGN=off.get("key_signs", 0),
        OFF_KNORM=off.get("key_norm", 0),
        OFF_KRNORM=off.get("key_rnorm", 0),
        OFF_KRAW=off.get("key_raw", 0),
        OFF_KCODE=off.get("key_code", 0),
        KCB=fmt.key_fields(d)[0].count if key_mode == KEY_KLT else 0,
        NORM_F32=fmt.norm_dtype == "float32",
        VAL_MODE=val_mode,
        **_planar_chunks("V", vb, ch),
        GROUP=group,
        NG=d // group,
        OFF_VCODES=off.get("val_codes", 0),
        OFF_VSCALE=off.get("val_scale", 0),
        OFF_VZERO=off.get("val_zero", 0),
        OFF_VRAW=off.get("val_raw", 0),
        OFF_VIDX=off.get("val_idx", 0),
        OFF_VNORM=off.get("val_norm", 0),
        RAW_BF16=raw_dtype == torch.bfloat16,
    )


def _planar_chunks(prefix: str, bits: int, ch: int) -> dict[str, int]:
    """``PageSpec``'s facts of one ``bits``-bit planar field, named ``prefix`` ("K" keys, "V" values) + B: the bits,
    W0..W2: the sub-field widths, CW: coordinates per chunk (``ch`` times the smallest width: one byte range and one
    shift inside every run), CH: chunks (D padded to 8 ``ch`` coordinates). No bits: one 8-wide chunk."""
    w = _widths(bits)
    wmin = min(x for x in w if x) if bits else 8
    facts = {"B": bits, "W0": w[0], "W1": w[1], "W2": w[2], "CW": ch * wmin, "CH": 8 // wmin}
    return {prefix + name: value for name, value in facts.items()}


def kernel_unsupported_reason(layout: PagedLayout) -> str | None:
    """Why no kernel handles ``layout`` (None when one does)."""
    if layout.fmt.sink_tokens:
        return "sink_tokens (the first positions read exactly by every query) are served by the reference path"
    return None


PREFILL_WORKSPACE_BYTES = 256 << 20
"""fp16 workspace bound of one Triton prefill call: 64k tokens x 8 KV heads at D=128 (mse keys); the vLLM worker
budget sets it aside."""
