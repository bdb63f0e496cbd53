"""Split keys: rotary pairs ranked by calibrated importance get more bits, each set its own rotation, norm and codebook.

The score error of a key, q . (k - k^), has variance sum_c E[q_c^2] E[e_c^2]. One rotation of all D coordinates
spreads every channel's error evenly, so uniform bits pay the mean channel importance. Here the D channels are split
*before* any rotation into a high set (``hi_bits``) and the rest (``lo_bits``); each set is coded by TurboQuant_mse
on its own (independent rotation, own norm, own Lloyd-Max codebook for its dimension), the paper's "outlier channel"
recipe. Channels are chosen by rotary pair (c, c + D/2: transformers' ``rotate_half`` convention, as SmolLM2 uses):
RoPE turns a pair's two channels into each other but keeps its energy, so the choice does not depend on position.

Per-head set sizes (``allocate``): each KV head's high-set size varies in steps (0 to all channels) at a fixed mean,
chosen to minimise the summed predicted error, each head's score error weighted by how much of it reaches the
attention output (``output_weights``: the squared attention its compressed positions receive).

An evaluation format: ``SplitKeyHistory`` replaces the keys the ``cpu-decoded`` history reads (the store's own key
code is ignored); the bytes it would take come from ``SplitKeys.key_bytes_per_token``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from jetson_tq.cache.compressed import CompressedKVCache
from jetson_tq.codec.codebook import lloyd_max_mse
from jetson_tq.codec.mse import TurboQuantMSE
from jetson_tq.codec.rotation import derive_seed
from jetson_tq.errors import FormatError, ShapeError
from jetson_tq.format import Field, KVFormat, packed_bytes
from jetson_tq.integrations.transformers import TurboQuantCache, model_dims

from .decoded_history import CodedKeyLayer, DecodedHistory
from .decoded_history import register as register_decoded
from .smartmix import LayerCapture

#: The head dim a ``SplitKeys.hi_channels`` count is stated at (other head dims scale it in proportion).
REFERENCE_DIM = 128
SCORES = ("qk", "k")  # pair importance: E[q_pair^2] x E[k_pair^2], or E[k_pair^2] alone (the control)


@dataclass(frozen=True)
class SplitKeys:
    """``hi_channels`` of every ``REFERENCE_DIM`` key channels at ``hi_bits``, the rest at ``lo_bits``."""

    hi_channels: int
    hi_bits: int
    lo_bits: int
    score: str = "qk"

    def __post_init__(self) -> None:
        if self.score not in SCORES:
            raise FormatError(f"score: expected one of {SCORES}, got {self.score!r}")
        if not 0 < self.hi_channels < REFERENCE_DIM or self.hi_channels % 2:
            raise FormatError(f"hi_channels: expected an even count in (0, {REFERENCE_DIM}), got {self.hi_channels}")

    def hi_count(self, head_dim: int) -> int:
        """High-set channels at ``head_dim`` (whole rotary pairs)."""
        n = self.hi_channels * head_dim // REFERENCE_DIM
        if n % 2 or not 0 < n < head_dim:
            raise FormatError(f"{self.hi_channels} of {REFERENCE_DIM} channels is no whole pair count at D={head_dim}")
        return n

    def key_bytes_per_token(self, head_dim: int, norm_dtype: torch.dtype = torch.float16) -> int:
        """Bytes of one key: each set's packed codes (``format.packed_bytes``) and its norm."""
        self.hi_count(head_dim)  # a whole pair count at this head dim
        return head_key_bytes(self, self.hi_channels, head_dim, norm_dtype)

    def format_bytes_per_token(self, fmt: KVFormat, head_dim: int) -> int:
        """Bytes of one token of ``fmt`` with its keys replaced by this split."""
        return _with_keys(fmt, head_dim, self.key_bytes_per_token(head_dim, fmt.norm_torch_dtype))


def _with_keys(fmt: KVFormat, head_dim: int, key_bytes: float):
    """Bytes of one token of ``fmt`` whose key takes ``key_bytes`` instead of the format's own."""
    return fmt.bytes_per_token(head_dim) - fmt.key_bytes_per_token(head_dim) + key_bytes


@dataclass
class PairEnergy:
    """One layer's calibrated second moments per KV head and rotary pair [H, D/2]."""

    query: torch.Tensor  # queries of the head's GQA group, pooled
    key: torch.Tensor  # raw keys
    key_centered: torch.Tensor  # keys minus the layer's calibrated center (what a centered cache quantizes)


def pair_energies(caps: list[LayerCapture], centers: list | None = None, skip: int = 1) -> list[PairEnergy]:
    """Per layer, E[x_c^2 + x_{c+D/2}^2] of queries and keys over positions >= ``skip`` of a calibration capture (the
    first position, an attention sink, left out as ``kv_centers`` does)."""
    out = []
    for i, cap in enumerate(caps):
        q, k = cap.q[:, :, skip:].float(), cap.k[:, :, skip:].float()
        h, d = k.shape[1], k.shape[-1]
        q_energy = (q**2).mean((0, 2)).reshape(h, -1, d).mean(1)  # [H, D]: a KV head's query heads are adjacent
        center = torch.zeros(h, d) if centers is None else centers[i][0].float()
        kc = k - center[None, :, None, :]
        out.append(PairEnergy(*(_pairs(x) for x in (q_energy, (k**2).mean((0, 2)), (kc**2).mean((0, 2))))))
    return out


def _pairs(energy: torch.Tensor) -> torch.Tensor:
    """[H, D] channel energies -> [H, D/2] rotary-pair energies."""
    half = energy.shape[-1] // 2
    return energy[..., :half] + energy[..., half:]


def _pair_order(spec: SplitKeys, energy: PairEnergy, centered: bool) -> torch.Tensor:
    """Each head's rotary pairs [H, D/2], most important first (``spec.score`` over the keys a cache quantizes)."""
    k = energy.key_centered if centered else energy.key
    return (energy.query * k if spec.score == "qk" else k).argsort(dim=-1, descending=True)


def hi_channels(spec: SplitKeys, energy: PairEnergy, head_dim: int, centered: bool) -> torch.Tensor:
    """The high-set channel indices [H, n] of one layer: its most important pairs, both channels of each."""
    top = _pair_order(spec, energy, centered)[:, : spec.hi_count(head_dim) // 2].sort(-1).values
    return torch.cat([top, top + head_dim // 2], dim=-1)


class SplitKeyQuantizer:
    """Quantize-dequantize keys [B, H, T, D] of one layer with per-head channel sets, each set's own TurboQuant_mse.

    ``hi``: each KV head's high-set channel indices (a [H, n] tensor, or one 1-D tensor per head when the heads' set
    sizes differ); heads of one size share the codecs (rotation seeds from ``seed``), an empty set has none.
    """

    def __init__(
        self,
        spec: SplitKeys,
        hi: torch.Tensor | Sequence[torch.Tensor],
        seed: int,
        norm_dtype: torch.dtype = torch.float16,
        head_dim: int | None = None,
    ) -> None:
        rows = [r.long() for r in hi]
        self.head_dim = d = head_dim or len(rows[0]) * REFERENCE_DIM // spec.hi_channels
        self.num_heads = len(rows)
        self.groups: list[tuple[torch.Tensor, list[tuple[torch.Tensor, TurboQuantMSE]]]] = []
        for n in sorted({len(r) for r in rows}):
            heads = [i for i, r in enumerate(rows) if len(r) == n]
            hi_idx = torch.stack([rows[i] for i in heads]).reshape(len(heads), n)
            is_hi = torch.zeros(len(heads), d, dtype=torch.bool)
            is_hi.scatter_(1, hi_idx, True)
            lo_idx = torch.stack([torch.nonzero(~row).squeeze(1) for row in is_hi])
            sets = [(hi_idx, n, spec.hi_bits, 1), (lo_idx, d - n, spec.lo_bits, 2)]
            parts = [
                (idx, TurboQuantMSE(m, bits, derive_seed(seed, salt=salt), norm_dtype=norm_dtype))
                for idx, m, bits, salt in sets
                if m
            ]
            self.groups.append((torch.tensor(heads), parts))

    def __call__(self, k: torch.Tensor) -> torch.Tensor:
        """k^ [B, H, T, D] float32: each channel set quantized and dequantized on its own."""
        b, h, t, d = k.shape
        if (h, d) != (self.num_heads, self.head_dim):
            raise ShapeError(f"keys: expected [B, {self.num_heads}, T, {self.head_dim}], got {tuple(k.shape)}")
        out = torch.empty(b, h, t, d, device=k.device)
        for heads, parts in self.groups:
            src = k[:, heads.to(k.device)].float()
            sub = torch.empty_like(src)
            for idx, codec in parts:
                index = idx.to(k.device)[None, :, None, :].expand(b, len(heads), t, -1)
                sub.scatter_(-1, index, codec.dequantize(codec.quantize(src.gather(-1, index))).float())
            out[:, heads.to(k.device)] = sub
        return out


class SplitKeyHistory(DecodedHistory):
    """The ``cpu-decoded`` history with its compressed keys coded by a ``SplitKeyQuantizer`` (values unchanged)."""

    def __init__(self, store: CompressedKVCache, sink_tokens: int, quantizer: SplitKeyQuantizer) -> None:
        super().__init__(store, sink_tokens)
        self.quantizer = quantizer
        self.split_keys = torch.zeros(store.batch_size, store.num_kv_heads, 0, self.key_dim, device=store.device)

    def note_exact(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Code the next tokens' keys [B, H, T, D] (called once per chunk, before the store holds them)."""
        super().note_exact(k, v)
        if int(self.store.lengths[0]) == self.split_keys.shape[2]:
            coded = self.transform_exact_keys(self.quantizer(k.to(self.store.dtype)))
            self.split_keys = torch.cat([self.split_keys, coded], dim=2)

    def _decode_keys(self, fields: dict) -> torch.Tensor:
        n = fields["key_norm"].shape[2]
        if self.count + n > self.split_keys.shape[2]:
            raise ShapeError(f"split keys hold {self.split_keys.shape[2]} positions, asked up to {self.count + n}")
        return self.split_keys[:, :, self.count : self.count + n]


@dataclass
class SplitKeyPlan:
    """A split-key row: the split, each layer's high-set channels (``SplitKeyQuantizer``'s ``hi``) and, when the
    heads' set sizes differ, each layer's per-head high-set sizes in channels of ``REFERENCE_DIM``."""

    spec: SplitKeys
    hi: list
    sizes: list[list[int]] | None = None

    def key_bytes_per_token(self, layer: int, head_dim: int, norm_dtype: torch.dtype = torch.float16) -> float:
        """Bytes of one key of ``layer``, the mean over its KV heads."""
        if self.sizes is None:
            return float(self.spec.key_bytes_per_token(head_dim, norm_dtype))
        row = self.sizes[layer]
        return sum(head_key_bytes(self.spec, n, head_dim, norm_dtype) for n in row) / len(row)

    def format_bytes_per_token(self, layer: int, fmt: KVFormat, head_dim: int) -> float:
        """Bytes of one token of ``fmt`` in ``layer`` with its keys replaced by this plan's split."""
        return _with_keys(fmt, head_dim, self.key_bytes_per_token(layer, head_dim, fmt.norm_torch_dtype))


def head_key_bytes(spec: SplitKeys, hi_channels: int, head_dim: int, norm_dtype: torch.dtype = torch.float16) -> int:
    """Bytes of one key of a head whose high set is ``hi_channels`` of ``REFERENCE_DIM`` (0 or all: one set, one
    norm)."""
    n = hi_channels * head_dim // REFERENCE_DIM
    norm = Field("key_norm", norm_dtype, 1).nbytes
    sets = [(m, bits) for m, bits in ((n, spec.hi_bits), (head_dim - n, spec.lo_bits)) if m]
    return sum(packed_bytes(m, bits) + norm for m, bits in sets)


def plan(spec: SplitKeys, energies: list[PairEnergy], head_dim: int, centered: bool) -> SplitKeyPlan:
    """Each layer's high set from calibrated pair energies."""
    return SplitKeyPlan(spec, [hi_channels(spec, e, head_dim, centered) for e in energies])


def predicted_errors(
    spec: SplitKeys, energy: PairEnergy, head_dim: int, centered: bool, sizes: Sequence[int]
) -> torch.Tensor:
    """Score-error variance [H, len(sizes)] of each head with a high set of each size (channels of
    ``REFERENCE_DIM``): a set S of n channels at b bits, rotated, spreads its error E||k_S||^2 mse(n, b) evenly, so
    it costs E[||q_S||^2] E[||k_S||^2] mse(n, b) / n; pairs ranked as ``hi_channels`` ranks them."""
    k = energy.key_centered if centered else energy.key
    q = energy.query
    order = _pair_order(spec, energy, centered)
    qc, kc = q.gather(-1, order).cumsum(-1), k.gather(-1, order).cumsum(-1)
    zero = torch.zeros(q.shape[0], 1)
    qc, kc = torch.cat([zero, qc], -1), torch.cat([zero, kc], -1)  # [H, D/2 + 1]: first m pairs' energy
    out = torch.zeros(q.shape[0], len(sizes))
    for j, size in enumerate(sizes):
        n = size * head_dim // REFERENCE_DIM
        for m, bits, qs, ks in (
            (n, spec.hi_bits, qc[:, n // 2], kc[:, n // 2]),
            (head_dim - n, spec.lo_bits, qc[:, -1] - qc[:, n // 2], kc[:, -1] - kc[:, n // 2]),
        ):
            if m:
                out[:, j] += qs * ks * lloyd_max_mse(m, bits) / m
    return out


def _knapsack(items: list[list[tuple[int, float]]], budget: int) -> list[int]:
    """Per item the index of one (cost, error) option, the costs summing to ``budget``, the summed error least."""
    best = torch.full((budget + 1,), float("inf"), dtype=torch.float64)
    best[0] = 0.0
    choice = torch.zeros(len(items), budget + 1, dtype=torch.long)
    for i, options in enumerate(items):  # best[u]: least error of items 0..i at cost u
        cand = torch.full((len(options), budget + 1), float("inf"), dtype=torch.float64)
        for j, (cost, err) in enumerate(options):
            if cost <= budget:
                cand[j, cost:] = best[: budget + 1 - cost] + err
        best, choice[i] = cand.min(0)
    if not torch.isfinite(best[budget]):
        raise FormatError(f"no choice of options costs exactly {budget}")
    picks, left = [], budget
    for i in reversed(range(len(items))):
        picks.append(int(choice[i, left]))
        left -= items[i][picks[-1]][0]
    return picks[::-1]


def allocate(
    spec: SplitKeys,
    energies: list[PairEnergy],
    head_dim: int,
    centered: bool,
    step: int = 16,
    key_weight: list[torch.Tensor] | None = None,
) -> list[list[int]]:
    """Per layer and KV head a high-set size (channels of ``REFERENCE_DIM``, a multiple of ``step`` in [0,
    REFERENCE_DIM]) whose mean is ``spec.hi_channels``, minimising the summed predicted score error (each head's
    times ``key_weight`` [H] per layer when given; an exact dynamic programme: the mean, hence the code bytes, is
    fixed)."""
    if spec.hi_channels % step:
        raise FormatError(f"hi_channels {spec.hi_channels} is no multiple of the step {step}")
    sizes = list(range(0, REFERENCE_DIM + 1, step))
    errors = [predicted_errors(spec, e, head_dim, centered, sizes) for e in energies]
    if key_weight is not None:
        errors = [err * w[:, None] for err, w in zip(errors, key_weight)]
    flat = torch.cat(errors).double()
    picks = _knapsack(
        [[(j, float(x)) for j, x in enumerate(row)] for row in flat], len(flat) * spec.hi_channels // step
    )
    per = energies[0].query.shape[0]
    return [[sizes[j] for j in picks[i : i + per]] for i in range(0, len(picks), per)]


def output_weights(caps: list[LayerCapture], exact_block: int, sinks: int = 1) -> list[torch.Tensor]:
    """Per layer and KV head [H], how much a compressed key's logit error reaches the attention output: logit noise
    of variance s^2 adds s^2 E_t sum_j p_tj^2 ||v_j - o_t||^2 / D, over the positions j a query t reads compressed
    (older than its own ``exact_block``, past the first ``sinks``)."""
    out = []
    for cap in caps:
        q, k, v = cap.q.float(), cap.k.float(), cap.v.float()
        h, t, d = k.shape[1], k.shape[2], k.shape[3]
        g = q.shape[1] // h
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        pos = torch.arange(t)
        s = (q @ k.transpose(-1, -2) / d**0.5).masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        p = s.softmax(-1)
        o = p @ v
        compressed = (pos[None, :] < pos[:, None] - pos[:, None] % exact_block) & (pos[None, :] >= sinks)
        dist = (v**2).sum(-1)[:, :, None, :] - 2 * o @ v.transpose(-1, -2) + (o**2).sum(-1)[:, :, :, None]
        out.append(((p**2 * compressed * dist).sum(-1).mean((0, 2)) / d).reshape(h, g).mean(1))
    return out


def plan_allocated(
    spec: SplitKeys, energies: list[PairEnergy], head_dim: int, centered: bool, sizes: list[list[int]]
) -> SplitKeyPlan:
    """High sets of per-head ``sizes`` (``allocate``): each head's most important pairs, as ``hi_channels`` ranks."""
    hi = []
    for e, row in zip(energies, sizes):
        order = _pair_order(spec, e, centered)
        top = [order[h, : n * head_dim // REFERENCE_DIM // 2].sort().values for h, n in enumerate(row)]
        hi.append([torch.cat([t, t + head_dim // 2]) for t in top])
    return SplitKeyPlan(spec, hi, sizes)


def _history(store: CompressedKVCache, sinks: int, center: torch.Tensor | None, quantizer) -> SplitKeyHistory:
    """A ``CodedKeyLayer`` history for split keys (centering is the quantizer's: the center is not needed here)."""
    return SplitKeyHistory(store, sinks, quantizer)


class SplitKeyCache(TurboQuantCache):
    """A ``TurboQuantCache`` (backend ``cpu-decoded``) with split keys in every compressed layer."""

    def __init__(self, model, config, split: SplitKeyPlan, **kwargs) -> None:
        super().__init__(model, config, backend=register_decoded(), **kwargs)
        head_dim = model_dims(model.config)[3]
        for i, layer in enumerate(self._tq_layers):
            if not layer.fmt.is_passthrough:
                q = SplitKeyQuantizer(split.spec, split.hi[i], layer.seed, layer.fmt.norm_torch_dtype, head_dim)
                self.layers[i] = CodedKeyLayer(layer, partial(_history, quantizer=q))
