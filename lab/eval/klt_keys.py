"""Transform-coded keys: a calibrated, score-weighted KLT of the pre-RoPE key, bits by reverse water-filling.

Split keys (``split_keys.py``) is a two-level, pair-wise approximation of optimal transform coding; this is the real
thing, per layer and KV head:

1. **Pre-RoPE.** The cache sees post-RoPE keys k_p = R_p k (transformers' ``rotate_half`` convention); per-channel
   structure is stable before RoPE (KVQuant), smeared after. The coder undoes RoPE at the token's known position,
   codes, decodes and re-applies it (a kernel would score against the dequantized pre-RoPE key rotated at read).
2. **Score weight.** A query at p scores a key at s by q^T R_{s-p} k (pre-RoPE q, k), so a key error e costs
   e^T W e with W = E_delta[R_delta^T E[q q^T] R_delta]. Averaged over relative positions whose angles spread, W is
   diagonal by rotary pair: w_c = w_{c+D/2} = E[q_c^2 + q_{c+D/2}^2] / 2 (``pair_weight``). (The numerical average
   over distances 0..4,096, which keeps the slow pairs' full blocks, measured the same: removed.)
3. **KLT.** Whiten the centered pre-RoPE keys by W^(1/2), take their PCA (eigenvectors U, variances lambda): the
   coefficients z = U^T W^(1/2) (k - m) are decorrelated and their squared error is the score error.
4. **Bits.** Integer bits 0..``MAX_BITS`` per coefficient by greedy reverse water-filling on lambda (the marginal
   gain lambda_i (D(b) - D(b+1)) of the Gaussian Lloyd-Max distortion D, optimal for convex D), a fixed number of
   bits per head; each coefficient by the Gaussian Lloyd-Max codebook scaled by its calibrated sigma. With
   ``token_norm`` a per-token fp16 scale (the coefficients' norm over its expectation) divides them first and takes
   2 B of the budget.
5. **Attention-weighted statistics** (``attention``): the mean, covariance (hence U, lambda, bits) and sigmas weight
   each calibration key by ``ATTENTION_FLOOR`` + the attention it receives from queries that read it compressed, over
   its mean. Without it the bulk-optimal transform gives the rare directions of the attended keys few bits.
6. **Calibrated codebooks** (``lloyd``): each coefficient's levels by a weighted 1-D Lloyd-Max on its calibration
   values (started from the Gaussian codebook), for coefficients that are not Gaussian; or (``cubic``) levels that
   are a fitted cubic of the code, which the kernels compute instead of looking them up (``cubic_levels``).
7. **Block-diagonal KLT** (``block`` N < D): the whitened covariance restricted to blocks of N channels, N/2
   consecutive rotary pairs each, a pair's two channels (c, c + D/2) always in one block, so a block is closed under
   RoPE's pairing and a kernel decodes (and rotates) one block of a key from that block's coefficients alone: 2 D N
   FLOPs a key instead of 2 D^2 (``pair_blocks``). N = 1: no transform, each whitened channel its own coefficient
   (its mean and scale fold into its levels). Bits still by water-filling over all D coefficients of the head.
   (Pairs grouped by whitened energy or by greedy Gaussian coding gain measured the same as consecutive pairs on the
   dev split: removed, benchmarks/NOTES.md.)

Bytes: ``KLTKeys.key_bytes`` is stated at ``REFERENCE_DIM`` = 128 (norm included); other head dims keep its code bits
in proportion, as ``SplitKeys`` does. An evaluation format, read by the ``cpu-decoded`` history (``KLTKeyHistory``:
the store's own key code is ignored); the per-head mean, transform and codebooks are calibration constants, not
per-token bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from jetson_tq.cache.compressed import CompressedKVCache
from jetson_tq.calibration.fit import (  # noqa: F401  (re-exported: the lab's coder and its tests use these names)
    ATTENTION_FLOOR,
    MAX_BITS,
    MIN_DISTANCE,
    KLTLayer,
    allocate_bits,
    ascending_fit,
    block_klt,
    cubic_levels,
    distortion,
    fit_heads,
    gaussian_codebook,
    key_weights,
    lloyd_levels,
    pair_blocks,
    pair_weight,
)
from jetson_tq.calibration.fit import received_attention as _received
from jetson_tq.codec.klt import RotaryParams
from jetson_tq.codec.klt import default_inv_freq as inv_freq
from jetson_tq.errors import FormatError, ShapeError
from jetson_tq.format import Field, KVFormat
from jetson_tq.integrations.transformers import TurboQuantCache, model_dims

from .decoded_history import CodedKeyLayer, DecodedHistory
from .decoded_history import register as register_decoded
from .smartmix import LayerCapture
from .split_keys import REFERENCE_DIM


@dataclass(frozen=True)
class KLTKeys:
    """Keys of ``key_bytes`` per token at ``REFERENCE_DIM`` (a per-token fp16 scale included with ``token_norm``)."""

    key_bytes: int
    token_norm: bool = False
    attention: bool = False
    lloyd: bool = False
    cubic: bool = False  # levels a fitted cubic of the code per coefficient (``cubic_levels``) instead of Lloyd-Max
    block: int = 0  # channels per diagonal block (an even divisor of D; 1: no transform); 0: one block, the full KLT
    widths: tuple[int, ...] = ()  # the code widths bits may take (0 always); (): any of 0..MAX_BITS

    def __post_init__(self) -> None:
        if self.code_bits(REFERENCE_DIM) <= 0:
            raise FormatError(f"key_bytes {self.key_bytes} leaves no code bits")
        if self.lloyd and self.cubic:
            raise FormatError("lloyd and cubic levels exclude each other")
        if self.block < 0 or (self.block % 2 and self.block != 1):
            raise FormatError(f"block {self.block}: expected 0 (full KLT), 1 (no transform) or an even channel count")

    def decode_cost(self, head_dim: int) -> float:
        """Decode FLOPs of one key as a fraction of the full KLT's 2 D^2: N / D."""
        return 1.0 if self.block in (0, head_dim) else self.block / head_dim

    def norm_bytes(self, norm_dtype: torch.dtype = torch.float16) -> int:
        """Bytes of the per-token scale (0 without one)."""
        return Field("key_norm", norm_dtype, 1).nbytes if self.token_norm else 0

    def code_bits(self, head_dim: int) -> int:
        """Code bits of one key at ``head_dim`` (the budget at ``REFERENCE_DIM`` in proportion)."""
        return (self.key_bytes - self.norm_bytes()) * 8 * head_dim // REFERENCE_DIM

    def key_bytes_per_token(self, head_dim: int) -> float:
        """Bytes of one key: its code bits and the per-token scale."""
        return self.code_bits(head_dim) / 8 + self.norm_bytes()


# ---------------------------------------------------------------------------------------------- RoPE
def rope(x: torch.Tensor, positions: torch.Tensor, freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [..., T, D] rotated by RoPE at ``positions`` [T] (``rotate_half`` pairs c, c + D/2); ``inverse`` undoes it."""
    return RotaryParams(freq).apply(x, positions, inverse)


def received_attention(cap: LayerCapture, min_distance: int = MIN_DISTANCE) -> torch.Tensor:
    """Per key [B, H, T] the exact attention it receives from a capture's queries at least ``min_distance`` later
    (``calibration.fit.received_attention``)."""
    return _received(cap.q, cap.k, None, min_distance)


def calibrate(
    spec: KLTKeys,
    caps: list[LayerCapture],
    head_dim: int,
    theta: float,
    skip: int = 1,
    rotary: RotaryParams | None = None,
) -> list[KLTLayer]:
    """Per layer the KLT coder from a calibration capture (post-RoPE q, k at positions 0..T-1 of each row), the first
    ``skip`` positions (an attention sink) left out; with ``spec.attention`` each key's statistics weighted by
    ``ATTENTION_FLOOR`` + its received attention over the mean. RoPE is the default one at ``theta`` unless the
    model's own ``rotary`` is given."""
    rotary = rotary or RotaryParams(inv_freq(head_dim, theta))
    budget = spec.code_bits(head_dim)
    levels = "cubic" if spec.cubic else "lloyd" if spec.lloyd else None
    out = []
    for cap in caps:
        pos = torch.arange(cap.k.shape[2])
        k = rotary.apply(cap.k.double(), pos, inverse=True)[:, :, skip:]
        q = rotary.apply(cap.q.double(), pos, inverse=True)[:, :, skip:]  # [B, H, T', D], [B, Hq, T', D]
        a = torch.ones(k.shape[:3], dtype=torch.float64)
        if spec.attention:
            a = key_weights(received_attention(cap)[:, :, skip:])
        b, h, g = k.shape[0], k.shape[1], q.shape[1] // k.shape[1]
        fields = fit_heads(  # every head at once: [H, B * T', D] keys, each head's query group [H, G * B * T', D]
            k.transpose(0, 1).reshape(h, -1, head_dim),
            q.reshape(b, h, g, -1, head_dim).permute(1, 2, 0, 3, 4).reshape(h, -1, head_dim),
            a.transpose(0, 1).reshape(h, -1),
            budget,
            widths=spec.widths,
            levels=levels,
            block=spec.block,
            rotary_dim=rotary.rotary_dim,
            token_norm=spec.token_norm,
        )
        out.append(
            KLTLayer(
                mean=fields["mean"].float(),
                encode=fields["encode"].float(),
                decode=fields["decode"].float(),
                sigma=fields["sigma"].float(),
                bits=fields["bits"],
                levels=fields["levels"].float() if "levels" in fields else None,
            )
        )
    return out


# ---------------------------------------------------------------------------------------------- coding
def quantize_coefficients(z: torch.Tensor, sigma: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """z^ [..., H, T, D]: each coefficient by the Gaussian Lloyd-Max codebook of its bits scaled by its sigma (0 bits:
    zero). ``sigma``, ``bits``: [H, D]."""
    out = torch.zeros_like(z)
    for b in range(1, MAX_BITS + 1):
        mask = bits == b  # [H, D]
        if not bool(mask.any()):
            continue
        c = gaussian_codebook(b)[0].to(z.device)
        edges = (c[1:] + c[:-1]) / 2
        x = z / sigma.clamp_min(1e-30)[:, None, :]
        coded = c[torch.bucketize(x.contiguous(), edges)] * sigma[:, None, :]
        out = torch.where(mask[:, None, :], coded, out)
    return out


def quantize_to_levels(z: torch.Tensor, levels: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """z^ [B, H, T, D]: each coefficient by its own levels [H, D, 2^MAX_BITS] (the first 2^bits; 0 bits: zero)."""
    b_, h, t, d = z.shape
    x = z.permute(1, 3, 0, 2).reshape(h, d, b_ * t).contiguous()  # [H, D, N]
    out = torch.zeros_like(x)
    for b in range(1, MAX_BITS + 1):
        mask = bits == b
        if not bool(mask.any()):
            continue
        lv = levels[:, :, : 1 << b]
        coded = lv.gather(2, torch.searchsorted(((lv[..., 1:] + lv[..., :-1]) / 2).contiguous(), x))
        out = torch.where(mask[:, :, None], coded, out)
    return out.reshape(h, d, b_, t).permute(2, 0, 3, 1)


class KLTQuantizer:
    """Quantize-dequantize one layer's post-RoPE keys [B, H, T, D] at known positions through the KLT coder."""

    def __init__(self, spec: KLTKeys, layer: KLTLayer, theta: float, norm_dtype: torch.dtype = torch.float16) -> None:
        self.spec, self.layer, self.norm_dtype = spec, layer, norm_dtype
        self.head_dim = layer.mean.shape[-1]
        self.freq = inv_freq(self.head_dim, theta)
        self.expected_norm = layer.sigma.pow(2).sum(-1).sqrt()  # [H]: E||z||^2 ^ 1/2

    def __call__(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """k^ [B, H, T, D] float32 (post-RoPE, like k)."""
        lay = self.layer
        if k.shape[1] != lay.mean.shape[0] or k.shape[-1] != self.head_dim:
            raise ShapeError(f"keys: expected [B, {lay.mean.shape[0]}, T, {self.head_dim}], got {tuple(k.shape)}")
        pre = rope(k.float(), positions, self.freq, inverse=True) - lay.mean[None, :, None, :]
        z = torch.einsum("hij,bhtj->bhti", lay.encode, pre)
        scale = torch.ones(*z.shape[:-1], 1)
        if self.spec.token_norm:
            scale = (z.norm(dim=-1, keepdim=True) / self.expected_norm[None, :, None, None]).to(self.norm_dtype).float()
            scale = scale.clamp_min(1e-12)
        if lay.levels is None:
            zq = quantize_coefficients(z / scale, lay.sigma, lay.bits) * scale
        else:
            zq = quantize_to_levels(z / scale, lay.levels, lay.bits) * scale
        back = torch.einsum("hij,bhtj->bhti", lay.decode, zq) + lay.mean[None, :, None, :]
        return rope(back, positions, self.freq)


class KLTKeyHistory(DecodedHistory):
    """The ``cpu-decoded`` history with its compressed keys coded by a ``KLTQuantizer`` (values unchanged); keys
    arrive centered by the layer's post-RoPE ``center`` (or not), which the coder adds back and removes again."""

    def __init__(
        self, store: CompressedKVCache, sink_tokens: int, quantizer: KLTQuantizer, center: torch.Tensor | None
    ) -> None:
        super().__init__(store, sink_tokens)
        self.quantizer = quantizer
        self.center = None if center is None else center.float().to(store.device)[None, :, None, :]
        self.coded = torch.zeros(store.batch_size, store.num_kv_heads, 0, self.key_dim, device=store.device)

    def note_exact(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Code the next tokens' keys [B, H, T, D] (called once per chunk, before the store holds them)."""
        super().note_exact(k, v)
        start = self.coded.shape[2]
        if int(self.store.lengths[0]) != start:
            return
        raw = k.to(self.store.dtype).float()
        if self.center is not None:
            raw = raw + self.center
        coded = self.quantizer(raw, torch.arange(start, start + k.shape[2]))
        if self.center is not None:
            coded = coded - self.center
        self.coded = torch.cat([self.coded, self.transform_exact_keys(coded)], dim=2)

    def _decode_keys(self, fields: dict) -> torch.Tensor:
        n = fields["key_norm"].shape[2]
        if self.count + n > self.coded.shape[2]:
            raise ShapeError(f"KLT keys hold {self.coded.shape[2]} positions, asked up to {self.count + n}")
        return self.coded[:, :, self.count : self.count + n]


@dataclass
class KLTPlan:
    """A KLT-key row: the spec, each layer's calibrated coder and the model's RoPE theta."""

    spec: KLTKeys
    layers: list[KLTLayer]
    theta: float

    def format_bytes_per_token(self, layer: int, fmt: KVFormat, head_dim: int) -> float:
        """Bytes of one token of ``fmt`` with its keys replaced by this coder."""
        return (
            fmt.bytes_per_token(head_dim) - fmt.key_bytes_per_token(head_dim) + self.spec.key_bytes_per_token(head_dim)
        )


def _history(store: CompressedKVCache, sinks: int, center: torch.Tensor | None, quantizer) -> KLTKeyHistory:
    """A ``CodedKeyLayer`` history for KLT keys."""
    return KLTKeyHistory(store, sinks, quantizer, center)


class KLTKeyCache(TurboQuantCache):
    """A ``TurboQuantCache`` (backend ``cpu-decoded``) with KLT-coded keys in every compressed layer."""

    def __init__(self, model, config, plan: KLTPlan, **kwargs) -> None:
        super().__init__(model, config, backend=register_decoded(), **kwargs)
        if model_dims(model.config)[3] != plan.layers[0].mean.shape[-1]:
            raise ShapeError("KLT plan head dim differs from the model's")
        for i, layer in enumerate(self._tq_layers):
            if not layer.fmt.is_passthrough:
                q = KLTQuantizer(plan.spec, plan.layers[i], plan.theta, layer.fmt.norm_torch_dtype)
                self.layers[i] = CodedKeyLayer(layer, partial(_history, quantizer=q))


def rope_theta(config) -> float:
    """The model's RoPE theta (transformers 5 ``rope_parameters`` or the older ``rope_theta``)."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
