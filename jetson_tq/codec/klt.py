"""Transform-coded keys: each key coded before RoPE by a calibrated per-(layer, KV head) transform.

A calibration (``lab.eval.klt_keys.calibrate``, run by ``python -m jetson_tq calibrate``) fixes, per layer and
KV head, a mean m, an encode matrix A and its inverse B (a KLT of the keys whitened by the query weight), integer bits
per coefficient and each coefficient's sorted levels. A post-RoPE key k at position p is coded as

    z = A (R_p^-1 k / s - m),   code_i = nearest level of z_i among its 2^bits_i,

and read back as k^ = s R_p (m + B z^) (R_p: RoPE in transformers' ``rotate_half`` layout over the first
``rotary_dim`` channels, s: the model's RoPE attention scaling). Codes are one LSB-first bit stream per token and head
of ``code_bytes`` bytes (the format's ``key_code`` field), widest codes first (``code_offsets``: codes of 1, 2, 4 or 8
bits then never straddle a byte: the kernels read each with one byte load). Why: with RoPE undone the keys' channel
structure is stable, so the transform concentrates them in few coefficients (docs/fidelity.md, "Quality at 5x").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError, ShapeError

MAX_CODE_BITS = 8
FILE_KIND = "jetson_tq.key_transform"
FILE_VERSION = 1


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """transformers' default RoPE frequencies [head_dim // 2]: theta^(-2i / head_dim)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim - head_dim % 2, 2, dtype=torch.float) / head_dim))


@dataclass(frozen=True)
class RotaryParams:
    """RoPE as the model applies it: frequencies [rotary_dim / 2] of pairs (c, c + rotary_dim / 2), the scale s of
    cos and sin (transformers' ``attention_scaling``)."""

    inv_freq: torch.Tensor
    attention_scaling: float = 1.0

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [..., D] rotated at ``positions`` (broadcast to x.shape[:-1]); ``inverse`` undoes it. float64 inside."""
        half = self.inv_freq.numel()
        angle = positions.to(torch.float64)[..., None] * self.inv_freq.to(x.device, torch.float64)
        cos, sin = angle.cos(), angle.sin()
        x64 = x.to(torch.float64)
        a, b, rest = x64[..., :half], x64[..., half : 2 * half], x64[..., 2 * half :]
        s = self.attention_scaling
        if inverse:
            a, b = (a * cos + b * sin) / s, (b * cos - a * sin) / s
        else:
            a, b = s * (a * cos - b * sin), s * (b * cos + a * sin)
        return torch.cat([a, b, rest], dim=-1).to(x.dtype)


def centered_codes(bits: int) -> torch.Tensor:
    """The centered codes u = 2c - (2^bits - 1) of a ``bits``-wide code c, float64 [2^bits]: odd integers, symmetric
    (the variable of cubic levels, ``KeyTransform.cubic_levels``)."""
    n = 1 << bits
    return 2 * torch.arange(n, dtype=torch.float64) - (n - 1)


@dataclass(frozen=True)
class KeyTransform:
    """One layer's calibrated key coder, per KV head: mean [H, D], encode / decode [H, D, D], bits [H, D] (0..8, the
    same total per head), levels [H, D, 256] (each coefficient's first 2^bits sorted; 0 bits: level 0 is used).
    ``sink_key`` / ``sink_value`` [H, D] (both or neither): the layer's calibrated attention sink, the key and value
    position 0 holds whatever the token (``eval.sink``); readers take position 0 from them once it is compressed."""

    mean: torch.Tensor
    encode: torch.Tensor
    decode: torch.Tensor
    bits: torch.Tensor
    levels: torch.Tensor
    rotary: RotaryParams
    sink_key: torch.Tensor | None = None
    sink_value: torch.Tensor | None = None

    def __post_init__(self) -> None:
        h, d = self.mean.shape if self.mean.dim() == 2 else (0, 0)
        shapes = {
            "mean": (self.mean, (h, d)),
            "encode": (self.encode, (h, d, d)),
            "decode": (self.decode, (h, d, d)),
            "bits": (self.bits, (h, d)),
            "levels": (self.levels, (h, d, 1 << MAX_CODE_BITS)),
        }
        for name, (t, shape) in shapes.items():
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or h == 0:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ConfigError(f"key transform {name}: expected shape {shape} (mean [H, D] first), got {got}")
        if self.rotary.rotary_dim > d or self.rotary.rotary_dim % 2:
            raise ConfigError(f"key transform: rotary dim {self.rotary.rotary_dim} does not fit head dim {d}")
        if bool((self.bits < 0).any()) or bool((self.bits > MAX_CODE_BITS).any()):
            raise ConfigError(f"key transform bits: expected 0..{MAX_CODE_BITS} per coefficient")
        totals = self.bits.sum(-1)
        if bool((totals != totals[0]).any()):
            raise ConfigError(f"key transform bits: every head must spend the same bits, got {totals.tolist()}")
        if (self.sink_key is None) != (self.sink_value is None):
            raise ConfigError("key transform sink: expected both sink_key and sink_value or neither")
        sinks = [
            (name, t) for name, t in (("sink_key", self.sink_key), ("sink_value", self.sink_value)) if t is not None
        ]
        for name, sink in sinks:
            if not isinstance(sink, torch.Tensor) or tuple(sink.shape) != (h, d):
                got = tuple(sink.shape) if isinstance(sink, torch.Tensor) else type(sink).__name__
                raise ConfigError(f"key transform {name}: expected shape {(h, d)}, got {got}")
        checked = [("mean", self.mean), ("encode", self.encode), ("decode", self.decode), ("levels", self.levels)]
        for name, t in checked + sinks:
            if not bool(torch.isfinite(t).all()):
                raise ConfigError(f"key transform {name}: non-finite entries")
        used = torch.arange(1 << MAX_CODE_BITS, device=self.bits.device) < (1 << self.bits.long())[..., None]
        steps = self.levels[..., 1:] - self.levels[..., :-1]
        if bool(((steps < 0) & used[..., 1:]).any()):
            raise ConfigError("key transform levels: each coefficient's used levels must be sorted ascending")

    @property
    def num_heads(self) -> int:
        return self.mean.shape[0]

    @property
    def head_dim(self) -> int:
        return self.mean.shape[1]

    @property
    def code_bits(self) -> int:
        """Bits of one key's code (every head the same)."""
        return int(self.bits[0].sum())

    def cubic_levels(self) -> torch.Tensor | None:
        """Coefficients (a, s, r, t) [H, D, 4] when every coefficient's used levels are a cubic of its centered code,
        a + s u + r u^2 + t u^3 with u = 2c - (2^bits - 1) (within fp32 rounding; 0-bit: a alone), else None. Such
        levels are computed from the code, with no table (``cubic_levels`` of ``eval.klt_keys`` fits them)."""
        lv = self.levels.double()
        out = torch.zeros(*lv.shape[:2], 4, dtype=torch.float64, device=lv.device)
        out[..., 0] = lv[..., 0]
        for b in range(1, MAX_CODE_BITS + 1):
            sel = self.bits == b
            if not bool(sel.any()):
                continue
            n = 1 << b
            u = centered_codes(b).to(lv.device)
            basis = torch.stack([u**p for p in range(min(4, n))], 1)  # [n, P]
            y = lv[sel][:, :n]  # [m, n]
            coef = torch.linalg.lstsq(basis.expand(len(y), -1, -1), y[..., None]).solution[..., 0]  # [m, P]
            off = (coef @ basis.T - y).abs().amax(-1)
            if bool((off > 1e-5 * y.abs().amax(-1) + 1e-30).any()):
                return None
            full = torch.zeros(len(y), 4, dtype=torch.float64, device=lv.device)
            full[:, : basis.shape[1]] = coef
            out[sel] = full
        return out

    @property
    def decode_is_diagonal(self) -> bool:
        """Whether every head's decode matrix is diagonal (no transform: each coefficient is its own pre-RoPE channel,
        scaled; ``calibrate --transform diagonal``): a reader decodes a key without the D x D product."""
        off = self.decode - torch.diag_embed(torch.diagonal(self.decode, dim1=-2, dim2=-1))
        return not bool(off.any())

    @property
    def has_sink(self) -> bool:
        """Whether position 0 is read from the calibrated sink (``sink_key``, ``sink_value``)."""
        return self.sink_key is not None

    def to(self, device: torch.device | str) -> KeyTransform:
        """The same transform with its tensors on ``device``."""
        return KeyTransform(
            self.mean.to(device),
            self.encode.to(device),
            self.decode.to(device),
            self.bits.to(device),
            self.levels.to(device),
            RotaryParams(self.rotary.inv_freq.to(device), self.rotary.attention_scaling),
            None if self.sink_key is None else self.sink_key.to(device),
            None if self.sink_value is None else self.sink_value.to(device),
        )


def code_offsets(bits: torch.Tensor) -> torch.Tensor:
    """First stream bit [..., D] of each coefficient's code of widths ``bits`` [..., D]: codes laid out widest first
    (in coefficient order within a width), so codes of 1, 2, 4 or 8 bits never straddle a byte."""
    b = bits.long()
    order = torch.sort(-b, dim=-1, stable=True).indices
    wide_first = b.gather(-1, order)
    return torch.empty_like(b).scatter_(-1, order, torch.cumsum(wide_first, -1) - wide_first)


def codes_in_one_byte(bits: torch.Tensor) -> bool:
    """Whether every code of widths ``bits`` lies inside one byte of the stream (``code_offsets``)."""
    off = code_offsets(bits)
    return bool(((off % 8 + bits.long() <= 8) | (bits == 0)).all())


class KeyTransformCoder:
    """Code post-RoPE keys into ``code_bytes`` per token and head through one layer's ``KeyTransform``, and back."""

    def __init__(self, transform: KeyTransform, code_bytes: int) -> None:
        if transform.code_bits > 8 * code_bytes:
            raise ConfigError(
                f"key transform spends {transform.code_bits} bits a key, the format stores {8 * code_bytes}"
            )
        self.t, self.code_bytes = transform, code_bytes
        bits = self.t.bits.long()
        offsets = code_offsets(bits)  # [H, D]: first stream bit of each coefficient
        j = torch.arange(MAX_CODE_BITS, device=bits.device)
        self._bit_valid = j < bits[..., None]  # [H, D, 8]
        self._bit_pos = torch.where(self._bit_valid, offsets[..., None] + j, 8 * code_bytes)  # spare slot: dropped
        # decision thresholds [H, D, 255]: midpoints between used levels, +inf past them
        mid = (self.t.levels[..., 1:] + self.t.levels[..., :-1]) / 2
        used = torch.arange((1 << MAX_CODE_BITS) - 1, device=bits.device) < ((1 << bits) - 1)[..., None]
        self._mid = torch.where(used, mid, torch.inf)

    @property
    def thresholds(self) -> torch.Tensor:
        """Decision thresholds [H, D, 255] between each coefficient's used levels (+inf past them)."""
        return self._mid

    def _on(self, device: torch.device) -> KeyTransformCoder:
        if self.t.mean.device != device:
            self.t = self.t.to(device)
            self._bit_valid, self._bit_pos = self._bit_valid.to(device), self._bit_pos.to(device)
            self._mid = self._mid.to(device)
        return self

    def _heads_last(
        self, x: torch.Tensor, head_axis: int, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(x with its head axis moved to -2, positions broadcast to x.shape[:-1] with the head axis last, the head
        axis as a non-negative index)."""
        h, ax = self.t.num_heads, head_axis % max(x.dim(), 1)
        if x.dim() < 2 or ax == x.dim() - 1 or x.shape[ax] != h:
            raise ShapeError(f"key transform: axis {head_axis} of {tuple(x.shape)} must be its {h} KV heads")
        try:
            pos = torch.broadcast_to(positions.to(x.device), x.shape[:-1])
        except RuntimeError:
            raise ShapeError(
                f"positions {tuple(positions.shape)} do not broadcast to the keys' {tuple(x.shape[:-1])}"
            ) from None
        return x.movedim(ax, -2), pos.movedim(ax, -1), ax

    def quantize(self, k: torch.Tensor, positions: torch.Tensor, head_axis: int) -> torch.Tensor:
        """uint8 codes [..., code_bytes] of post-RoPE keys k [..., D] (``head_axis`` names the KV-head axis; token
        ``positions`` broadcast to k.shape[:-1]), the head axis where it was."""
        self._on(k.device)
        t = self.t
        kk, pos, ax = self._heads_last(k, head_axis, positions)
        pre = t.rotary.apply(kk.float(), pos, inverse=True) - t.mean
        z = torch.einsum("hij,...hj->...hi", t.encode, pre)
        return self._pack(self._nearest_level(z)).movedim(-2, ax)

    def _nearest_level(self, z: torch.Tensor) -> torch.Tensor:
        """Per coefficient of z [..., H, D] the index of its nearest used level (the number of thresholds below it,
        as ``torch.searchsorted``), by an 8-step binary search over the padded thresholds: O(z) memory."""
        mid = self._mid.expand(*z.shape, -1)
        idx = torch.zeros(z.shape, dtype=torch.long, device=z.device)
        for step in (128, 64, 32, 16, 8, 4, 2, 1):
            cand = idx + step
            below = mid.gather(-1, (cand - 1).clamp_max(mid.shape[-1] - 1).unsqueeze(-1))[..., 0] < z
            idx = torch.where(below & (cand <= mid.shape[-1]), cand, idx)
        return idx

    def dequantize(self, codes: torch.Tensor, positions: torch.Tensor, head_axis: int) -> torch.Tensor:
        """Post-RoPE keys float32 [..., D] of uint8 codes [..., code_bytes] (axes as ``quantize``)."""
        if codes.dtype != torch.uint8 or codes.shape[-1] != self.code_bytes:
            raise ShapeError(
                f"key codes: expected uint8 [..., {self.code_bytes}], got {codes.dtype} {tuple(codes.shape)}"
            )
        self._on(codes.device)
        t = self.t
        cc, pos, ax = self._heads_last(codes, head_axis, positions)
        idx = self._unpack(cc)
        z = t.levels.expand(*idx.shape, -1).gather(-1, idx.unsqueeze(-1))[..., 0]
        back = torch.einsum("hij,...hj->...hi", t.decode, z) + t.mean
        keys = t.rotary.apply(back, pos)
        if t.sink_key is not None:  # position 0 reads the calibrated sink
            keys = torch.where((pos == 0)[..., None], t.sink_key.float(), keys)
        return keys.movedim(-2, ax)

    def sink_values(self, values: torch.Tensor, positions: torch.Tensor, head_axis: int) -> torch.Tensor:
        """Decoded values float32 [..., D] with position 0 replaced by the calibrated sink value (axes as
        ``quantize``); unchanged without a sink."""
        if self.t.sink_value is None:
            return values
        self._on(values.device)
        vv, pos, ax = self._heads_last(values, head_axis, positions)
        return torch.where((pos == 0)[..., None], self.t.sink_value.float(), vv.float()).movedim(-2, ax)

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        """[..., H, D] int codes -> [..., H, code_bytes] uint8 (LSB-first stream, ``code_offsets``)."""
        nbits = 8 * self.code_bytes
        planes = (codes[..., None] >> torch.arange(MAX_CODE_BITS, device=codes.device)) & 1  # [..., H, D, 8]
        planes = planes * self._bit_valid
        stream = torch.zeros(*codes.shape[:-1], nbits + 1, dtype=torch.long, device=codes.device)
        pos = self._bit_pos.reshape(self.t.num_heads, -1).expand(*codes.shape[:-1], -1)
        stream.scatter_(-1, pos, planes.reshape(*codes.shape[:-1], -1))
        by = stream[..., :nbits].reshape(*codes.shape[:-1], self.code_bytes, 8)
        return (by << torch.arange(8, device=codes.device)).sum(-1).to(torch.uint8)

    def _unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[..., H, code_bytes] uint8 -> [..., H, D] int64 codes."""
        bits = (packed.long()[..., None] >> torch.arange(8, device=packed.device)) & 1
        stream = torch.cat([bits.flatten(-2), torch.zeros_like(bits[..., 0, :1])], dim=-1)  # spare slot reads 0
        h, d = self.t.num_heads, self.t.head_dim
        pos = self._bit_pos.reshape(h, -1).expand(*packed.shape[:-1], -1)
        planes = stream.gather(-1, pos).reshape(*packed.shape[:-1], d, MAX_CODE_BITS)
        return (planes << torch.arange(MAX_CODE_BITS, device=packed.device)).sum(-1)


def spread_transform(num_heads: int, head_dim: int, code_bits: int, theta: float = 10000.0) -> KeyTransform:
    """An uncalibrated transform (identity, zero mean, the bits spread evenly, levels uniform on [-4, 4]) for what
    does not depend on the calibration: storage sizes, tests of the plumbing."""
    if not 1 <= code_bits <= MAX_CODE_BITS * head_dim:
        raise ConfigError(f"code_bits: expected 1..{MAX_CODE_BITS * head_dim} at head_dim {head_dim}, got {code_bits}")
    per, extra = divmod(code_bits, head_dim)
    bits = torch.full((num_heads, head_dim), per, dtype=torch.long)
    bits[:, :extra] += 1
    n = 1 << bits
    j = torch.arange(1 << MAX_CODE_BITS)
    levels = torch.where(
        n[..., None] > 1, -4 + 8 * j.clamp(max=n[..., None] - 1) / (n[..., None] - 1).clamp(min=1), 0.0
    )
    eye = torch.eye(head_dim).expand(num_heads, -1, -1).clone()
    rotary = RotaryParams(default_inv_freq(head_dim, theta))
    return KeyTransform(torch.zeros(num_heads, head_dim), eye, eye.clone(), bits, levels.float(), rotary)


# ---------------------------------------------------------------------------------------------- files
def save_transforms(path: str | Path, layers: list[KeyTransform | None], meta: dict) -> None:
    """Write a model's key transforms (None: a layer without one) and free-form ``meta`` (model, text, budget). The
    first layer's RoPE is the file's; a layer whose RoPE differs (Gemma 3's local and global layers) carries its
    own ``inv_freq`` and ``attention_scaling``."""
    rot = next(t.rotary for t in layers if t is not None)

    def fields(t: KeyTransform) -> dict:
        out: dict = {
            n: getattr(t, n).cpu().contiguous()
            for n in ("mean", "encode", "decode", "bits", "levels", "sink_key", "sink_value")
            if getattr(t, n) is not None
        }
        same = t.rotary.attention_scaling == rot.attention_scaling and torch.equal(
            t.rotary.inv_freq.cpu(), rot.inv_freq.cpu()
        )
        if not same:
            out.update(inv_freq=t.rotary.inv_freq.cpu(), attention_scaling=float(t.rotary.attention_scaling))
        return out

    data = {
        "kind": FILE_KIND,
        "version": FILE_VERSION,
        "meta": dict(meta),
        "inv_freq": rot.inv_freq.cpu(),
        "attention_scaling": float(rot.attention_scaling),
        "layers": [None if t is None else fields(t) for t in layers],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, str(path))


def load_transforms_cached(path: str | Path) -> list[KeyTransform | None]:
    """``load_transforms``'s layers, read once per file version (path, modification time, size): every cache and
    vLLM layer built from one config shares them."""
    p = Path(path).expanduser()
    stat = p.stat() if p.is_file() else None
    return _load_layers(str(p), stat.st_mtime_ns if stat else 0, stat.st_size if stat else 0)


@functools.lru_cache(maxsize=4)
def _load_layers(path: str, mtime_ns: int, size: int) -> list[KeyTransform | None]:
    return load_transforms(path)[0]


def load_transforms(path: str | Path) -> tuple[list[KeyTransform | None], dict]:
    """(per-layer transforms, meta) from ``save_transforms``'s file; ConfigError naming what is wrong."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(
            f"key transform file {str(p)!r} not found; make it with "
            f"`python -m jetson_tq calibrate --model DIR --out {p}`"
        )
    try:
        data = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as e:  # any unreadable file is the same user error
        raise ConfigError(f"key transform file {str(p)!r} is not readable: {type(e).__name__}: {e}") from None
    if not isinstance(data, dict) or data.get("kind") != FILE_KIND:
        raise ConfigError(f"{str(p)!r} is not a jetson_tq key transform file")
    if data.get("version") != FILE_VERSION:
        raise ConfigError(f"{str(p)!r}: version {data.get('version')!r}, this jetson_tq reads {FILE_VERSION}")
    rot = RotaryParams(data["inv_freq"], float(data["attention_scaling"]))
    try:
        layers = [None if x is None else _layer(x, rot) for x in data["layers"]]
    except (TypeError, KeyError, AttributeError) as e:
        raise ConfigError(f"{str(p)!r}: a layer of the file is malformed ({type(e).__name__}: {e})") from None
    return layers, dict(data.get("meta", {}))


def _layer(fields: dict, rot: RotaryParams) -> KeyTransform:
    """One layer of a transform file (its own RoPE where it has one, else the file's)."""
    fields = dict(fields)
    if "inv_freq" in fields:
        rot = RotaryParams(fields.pop("inv_freq"), float(fields.pop("attention_scaling")))
    return KeyTransform(**fields, rotary=rot)
