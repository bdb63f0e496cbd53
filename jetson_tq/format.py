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
``val_codes``    uint8      ceil(D / 8) * value_bits  packed group codes  value_mode group
``val_scale``    float16    D / group                                     value_mode group
``val_zero``     float16    D / group                                     value_mode group
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

import math
from dataclasses import asdict, dataclass, replace
from typing import Literal

import torch

from .errors import FormatError

KeyMode = Literal["prod", "mse", "fp16"]
ValueMode = Literal["group", "mse", "fp16"]
RotationKind = Literal["auto", "hadamard", "dense"]
KeyCodebook = Literal["lloyd_max", "uniform"]

KEY_MODES: tuple[str, ...] = ("prod", "mse", "fp16")
VALUE_MODES: tuple[str, ...] = ("group", "mse", "fp16")
ROTATIONS: tuple[str, ...] = ("auto", "hadamard", "dense")
KEY_CODEBOOKS: tuple[str, ...] = ("lloyd_max", "uniform")
NORM_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "float32": torch.float32}
MAX_BITS = 8
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


def is_power_of_two(n: int) -> bool:
    """True for 1, 2, 4, 8, ..."""
    return n >= 1 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class KVFormat:
    """How one layer's keys and values are stored.

    ``key_bits`` is the total bits per key coordinate: in ``prod`` mode that is (key_bits - 1)-bit
    TurboQuant_mse plus the 1-bit QJL sketch of the residual (the paper's TurboQuant_prod), in
    ``mse`` mode all bits go to the codebook. ``key_codebook`` picks it: ``lloyd_max`` (the
    MSE-optimal centroids of a rotated coordinate) or ``uniform`` (evenly spaced with the MSE-optimal
    step, c[k] = (k - (2^b - 1)/2) * step: a kernel then scores <q, c[idx]> with the index bits read
    as one tensor-core operand plane, no per-coordinate lookup); the bytes are the same either way.
    ``buffer_tokens`` most recent tokens stay in fp16/bf16; when the buffer reaches
    ``buffer_tokens + flush_chunk`` tokens the oldest ``flush_chunk`` are compressed in one batched call.
    """

    key_mode: KeyMode = "prod"
    key_bits: int = 3
    key_codebook: KeyCodebook = "lloyd_max"
    value_mode: ValueMode = "group"
    value_bits: int = 2
    value_group: int = 32
    norm_dtype: str = "float16"
    rotation: RotationKind = "auto"
    buffer_tokens: int = 128
    flush_chunk: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.key_mode not in KEY_MODES:
            raise FormatError(f"key_mode: expected one of {KEY_MODES}, got {self.key_mode!r}")
        if self.value_mode not in VALUE_MODES:
            raise FormatError(f"value_mode: expected one of {VALUE_MODES}, got {self.value_mode!r}")
        if self.key_codebook not in KEY_CODEBOOKS:
            raise FormatError(f"key_codebook: expected one of {KEY_CODEBOOKS}, got {self.key_codebook!r}")
        if self.rotation not in ROTATIONS:
            raise FormatError(f"rotation: expected one of {ROTATIONS}, got {self.rotation!r}")
        if self.norm_dtype not in NORM_DTYPES:
            raise FormatError(f"norm_dtype: expected one of {tuple(NORM_DTYPES)}, got {self.norm_dtype!r}")
        _check_int("key_bits", self.key_bits, 1, MAX_BITS)
        _check_int("value_bits", self.value_bits, 1, MAX_BITS)
        _check_int("value_group", self.value_group, 1, 1 << 16)
        _check_int("buffer_tokens", self.buffer_tokens, 0, 1 << 24)
        _check_int("flush_chunk", self.flush_chunk, 1, 1 << 24)
        _check_int("seed", self.seed, 0, 2**63 - 1)

    # ----------------------------------------------------------------------------------------
    @property
    def key_mse_bits(self) -> int:
        """Bits of the Lloyd-Max codebook index of each key coordinate (0 for 1-bit prod)."""
        if self.key_mode == "prod":
            return self.key_bits - 1
        return self.key_bits if self.key_mode == "mse" else 0

    @property
    def norm_torch_dtype(self) -> torch.dtype:
        return NORM_DTYPES[self.norm_dtype]

    @property
    def is_passthrough(self) -> bool:
        """True when nothing is compressed (fp16 keys and values)."""
        return self.key_mode == "fp16" and self.value_mode == "fp16"

    def with_(self, **changes) -> "KVFormat":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    # ----------------------------------------------------------------------------------------
    def check_head_dim(self, head_dim: int) -> None:
        """Raise FormatError unless this format can store vectors of ``head_dim``."""
        if not isinstance(head_dim, int) or head_dim < 2:
            raise FormatError(f"head_dim: expected an integer >= 2, got {head_dim!r}")
        if self.value_mode == "group" and head_dim % self.value_group != 0:
            raise FormatError(
                f"value_group {self.value_group} must divide head_dim {head_dim} "
                f"(try a group of {math.gcd(head_dim, self.value_group)} or {head_dim})"
            )
        if self.rotation == "hadamard" and not is_power_of_two(head_dim):
            raise FormatError(
                f"rotation 'hadamard' needs a power-of-two head_dim, got {head_dim}; use 'dense' or 'auto'"
            )

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
        groups = head_dim // self.value_group
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
    def buffer_capacity(self) -> int:
        """fp16 tokens the recent buffer of one sequence must hold at most (during an append)."""
        return self.buffer_tokens + self.flush_chunk

    def sequence_bytes(self, tokens: int, head_dim: int, buffer_element_bytes: int = 2) -> int:
        """Bytes one sequence of ``tokens`` tokens takes per KV head: compressed part + its buffer."""
        if self.is_passthrough:
            return tokens * fp16_bytes_per_token(head_dim)
        compressed = max(tokens - self.buffer_tokens, 0)
        buffered = min(tokens, self.buffer_capacity)
        return compressed * self.bytes_per_token(head_dim) + buffered * 2 * head_dim * buffer_element_bytes


def fp16_bytes_per_token(head_dim: int) -> int:
    """Bytes of an uncompressed fp16/bf16 token of one KV head (keys + values)."""
    return 2 * head_dim * FP16_BYTES_PER_ELEMENT




@dataclass(frozen=True)
class PagedLayout:
    """Byte layout of one (block, KV head) page of a paged cache, structure-of-arrays.

    A page holds ``block_size`` tokens. Each field occupies a contiguous region of
    ``block_size * field.nbytes`` bytes, so a kernel loads a (tokens, field bytes) tile of one
    field in one coalesced sweep. Regions are placed in ``fields()`` order, each start rounded up
    to 16 bytes; ``page_bytes`` is the sum, also a multiple of 16.
    """

    fmt: KVFormat
    head_dim: int
    block_size: int

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1, 1 << 16)
        self.fmt.check_head_dim(self.head_dim)

    def offsets(self) -> dict[str, int]:
        """Byte offset of each field's region inside a page."""
        out: dict[str, int] = {}
        pos = 0
        for f in self.fmt.fields(self.head_dim):
            out[f.name] = pos
            pos = _round_up(pos + f.nbytes * self.block_size, 16)
        return out

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (block_size tokens of one KV head)."""
        pos = 0
        for f in self.fmt.fields(self.head_dim):
            pos = _round_up(pos + f.nbytes * self.block_size, 16)
        return pos


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise FormatError(f"{name}: expected an integer in [{lo}, {hi}], got {value!r}")


#: Uncompressed fp16 keys and values (passthrough), e.g. for layers kept in full precision.
FP16_FORMAT = KVFormat(key_mode="fp16", value_mode="fp16", buffer_tokens=0, flush_chunk=1)
