"""KVCodec: turns K/V tensors into the named fields of a ``KVFormat`` and scores queries against them.

This is the bridge between the math (``mse``, ``prod``, ``values``) and storage (``format``): the
fields it returns are exactly ``fmt.fields(head_dim)`` (each shaped [..., count]), so the cache can
store them, kernels can read them and the byte counts can never disagree.
"""

from __future__ import annotations

import torch

from ..errors import ArgTypeError, ConfigError, DTypeError, ShapeError, expect_float, expect_last_dim
from ..format import KVFormat
from ..validate import check_seed
from .klt import KeyTransform, KeyTransformCoder
from .mse import MSECode, TurboQuantMSE
from .packing import unpack_bits
from .prod import ProdCode, TurboQuantProd
from .rotation import value_seed
from .values import GroupCode, GroupQuantizer

Fields = dict[str, torch.Tensor]


class KVCodec:
    """Encode/decode one layer's keys and values in ``fmt`` for head dim ``head_dim``.

    Keys of ``key_mode: klt`` are coded at their positions through the layer's ``key_transform``: their encode,
    decode and score calls take ``positions`` (broadcast to the fields' leading shape) and ``head_axis`` (the
    KV-head axis of the tensor they pass); other modes ignore both."""

    def __init__(
        self,
        fmt: KVFormat,
        head_dim: int,
        seed: int | None = None,
        raw_dtype: torch.dtype = torch.float16,
        key_transform: KeyTransform | None = None,
    ) -> None:
        if not isinstance(fmt, KVFormat):
            raise ArgTypeError(f"fmt: expected a KVFormat, got {type(fmt).__name__} {fmt!r}")
        fmt.check_head_dim(head_dim)
        if raw_dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise DTypeError(
                f"raw_dtype: expected torch.float16, torch.bfloat16 or torch.float32 (the dtype fp16-mode "
                f"fields are cast to), got {raw_dtype}"
            )
        self.fmt, self.head_dim, self.raw_dtype = fmt, head_dim, raw_dtype
        self.seed = fmt.seed if seed is None else check_seed("seed", seed)
        rot, nd = fmt.rotation_for(head_dim), fmt.norm_torch_dtype
        self.keys: TurboQuantProd | TurboQuantMSE | None = None
        self.key_coder: KeyTransformCoder | None = None
        if fmt.key_mode == "klt":
            if key_transform is None:
                raise ConfigError("key_mode 'klt' needs the layer's calibrated key transform (config key_transform)")
            if key_transform.head_dim != head_dim:
                raise ConfigError(
                    f"key transform head dim {key_transform.head_dim} differs from the layer's {head_dim}"
                )
            if key_transform.has_sink and fmt.sink_tokens:
                raise ConfigError(
                    "a calibrated sink (key transform sink_key / sink_value) and exact sink_tokens both read "
                    "position 0: keep one"
                )
            self.key_coder = KeyTransformCoder(key_transform, fmt.key_fields(head_dim)[0].count)
        elif fmt.key_mode == "prod":
            self.keys = TurboQuantProd(head_dim, fmt.key_bits, self.seed, rot, nd, fmt.key_codebook)
        elif fmt.key_mode == "mse":
            self.keys = TurboQuantMSE(head_dim, fmt.key_bits, self.seed, rot, nd, fmt.key_codebook)
        self.values: GroupQuantizer | TurboQuantMSE | None = None
        if fmt.value_mode == "group":
            self.values = GroupQuantizer(head_dim, fmt.value_bits, fmt.value_group_for(head_dim))
        elif fmt.value_mode == "mse":
            self.values = TurboQuantMSE(head_dim, fmt.value_bits, value_seed(self.seed), rot, nd)
        self.field_names = [f.name for f in fmt.fields(head_dim)]

    # ---------------------------------------------------------------- static facts for kernels
    @property
    def key_rotation(self):
        """The rotation Pi applied to keys (None for fp16 keys)."""
        return None if self.keys is None else self.keys.rotation

    @property
    def key_codebook(self) -> torch.Tensor | None:
        """Centroids of the key MSE part (None when there is none)."""
        if isinstance(self.keys, TurboQuantProd):
            return None if self.keys.mse is None else self.keys.mse.codebook
        return None if self.keys is None else self.keys.codebook

    @property
    def qjl_scale(self) -> float:
        """sqrt(pi/2)/d for prod keys, 0 otherwise."""
        return self.keys.qjl_scale if isinstance(self.keys, TurboQuantProd) else 0.0

    def query_matrix(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[Pi; S] stacked (2D x D) for prod keys, Pi (D x D) for mse, I for fp16: ``q @ M.T`` transforms q once."""
        d = self.head_dim
        if self.keys is None:
            return torch.eye(d, device=device)
        pi = self.keys.rotation.matrix(device)
        if isinstance(self.keys, TurboQuantProd):
            return torch.cat([pi, self.keys.sketch_matrix(device)], dim=0)
        return pi

    # ---------------------------------------------------------------- write path
    def _where(self, positions: torch.Tensor | None, head_axis: int | None) -> tuple[torch.Tensor, int]:
        if positions is None or head_axis is None:
            raise ShapeError("klt keys are coded at their positions: pass positions and head_axis")
        return positions, head_axis

    def encode_keys(
        self, k: torch.Tensor, positions: torch.Tensor | None = None, head_axis: int | None = None
    ) -> Fields:
        expect_float("k", k)
        expect_last_dim("k", k, self.head_dim)
        if self.key_coder is not None:
            return {"key_code": self.key_coder.quantize(k, *self._where(positions, head_axis))}
        if self.keys is None:
            return {"key_raw": k.to(self.raw_dtype)}
        code = self.keys.quantize(k)
        out: Fields = {}
        if code.idx is not None:
            out["key_idx"] = code.idx
        if isinstance(code, ProdCode):
            out["key_signs"] = code.signs
        out["key_norm"] = code.norm.unsqueeze(-1)
        if isinstance(code, ProdCode):
            out["key_rnorm"] = code.rnorm.unsqueeze(-1)
        return out

    def encode_values(self, v: torch.Tensor) -> Fields:
        expect_float("v", v)
        expect_last_dim("v", v, self.head_dim)
        if self.values is None:
            return {"val_raw": v.to(self.raw_dtype)}
        code = self.values.quantize(v)
        if isinstance(code, GroupCode):
            return {"val_codes": code.codes, "val_scale": code.scale, "val_zero": code.zero}
        return {"val_idx": code.idx, "val_norm": code.norm.unsqueeze(-1)}

    def encode(
        self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None, head_axis: int | None = None
    ) -> Fields:
        """All fields of ``fmt`` for keys and values shaped [..., D] (same leading shape)."""
        if k.shape != v.shape:
            raise ShapeError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        return {**self.encode_keys(k, positions, head_axis), **self.encode_values(v)}

    # ---------------------------------------------------------------- read path
    def decode_keys(
        self, fields: Fields, positions: torch.Tensor | None = None, head_axis: int | None = None
    ) -> torch.Tensor:
        """Reconstructed keys in float32 [..., D] (tests and naive paths; the hot path never does this)."""
        if self.key_coder is not None:
            return self.key_coder.dequantize(fields["key_code"], *self._where(positions, head_axis))
        if self.keys is None:
            return fields["key_raw"].float()
        if isinstance(self.keys, TurboQuantProd):
            code = ProdCode(
                fields.get("key_idx"),
                fields["key_signs"],
                fields["key_norm"][..., 0],
                fields["key_rnorm"][..., 0],
                torch.float32,
            )
            return self.keys.dequantize(code)
        return self.keys.dequantize(MSECode(fields["key_idx"], fields["key_norm"][..., 0], torch.float32))

    @property
    def has_sink(self) -> bool:
        """Whether compressed position 0 reads the layer's calibrated sink (``KeyTransform.sink_key / sink_value``)."""
        return self.key_coder is not None and self.key_coder.t.has_sink

    def decode_values(
        self, fields: Fields, positions: torch.Tensor | None = None, head_axis: int | None = None
    ) -> torch.Tensor:
        """Reconstructed values in float32 [..., D]; with a calibrated sink (``has_sink``) position 0 reads it, so
        ``positions`` and ``head_axis`` are then needed, as for klt keys."""
        if self.values is None:
            out = fields["val_raw"].float()
        elif isinstance(self.values, GroupQuantizer):
            out = self.values.dequantize(
                GroupCode(fields["val_codes"], fields["val_scale"], fields["val_zero"], torch.float32)
            )
        else:
            out = self.values.dequantize(MSECode(fields["val_idx"], fields["val_norm"][..., 0], torch.float32))
        if self.has_sink:
            assert self.key_coder is not None  # has_sink
            return self.key_coder.sink_values(out, *self._where(positions, head_axis))
        return out

    def transform_query(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(Pi q, S q) in float32, computed once per query; (q, None) for fp16 keys."""
        qf = q.float()
        if self.keys is None:  # fp16 keys, and klt keys (scored after decoding)
            return qf, None
        q_rot = self.keys.rotation.apply(qf)
        q_sketch = qf @ self.keys.sketch_matrix(q.device).T if isinstance(self.keys, TurboQuantProd) else None
        return q_rot, q_sketch

    def key_scores(
        self,
        q_rot: torch.Tensor,
        q_sketch: torch.Tensor | None,
        fields: Fields,
        positions: torch.Tensor | None = None,
        head_axis: int | None = None,
    ) -> torch.Tensor:
        """<q, k~> for queries [..., G, D] against stored keys [..., N, *] -> [..., G, N], no key reconstructed.

        Uses the rotated query: ||k|| <Pi q, c[idx]> (+ sqrt(pi/2)/d ||r|| <S q, signs> for prod); klt keys are
        decoded at ``positions`` (of the N axis) first.
        """
        if self.key_coder is not None:
            return q_rot @ self.decode_keys(fields, positions, head_axis).transpose(-1, -2)
        if self.keys is None:
            return q_rot @ fields["key_raw"].float().transpose(-1, -2)
        norm = fields["key_norm"][..., 0].float().unsqueeze(-2)
        scores = torch.zeros(*q_rot.shape[:-1], norm.shape[-1], device=q_rot.device)
        mse = self.keys.mse if isinstance(self.keys, TurboQuantProd) else self.keys
        if mse is not None:
            centroids = mse.centroids(unpack_bits(fields["key_idx"], mse.bits, self.head_dim))
            scores = (q_rot @ centroids.transpose(-1, -2)) * norm
        if isinstance(self.keys, TurboQuantProd):
            assert q_sketch is not None  # transform_query gives the sketch for prod keys
            signs = unpack_bits(fields["key_signs"], 1, self.head_dim).float() * 2 - 1
            rnorm = fields["key_rnorm"][..., 0].float().unsqueeze(-2)
            scores = scores + self.keys.qjl_scale * rnorm * (q_sketch @ signs.transpose(-1, -2))
        return scores
