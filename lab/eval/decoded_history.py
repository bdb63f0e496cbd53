"""A CPU evaluation fast path for TurboQuant attention: the same estimator as the reference, decoded once per token.

``reference.attention_prefill`` unpacks every compressed token's bits on every call, which makes
long teacher-forced evaluations on a 2-core CPU take hours. This path keeps, per layer, a float32
copy of each compressed token *in the transformed key space* (decoded once, when it is written):

    prod:  k' = [ ||k|| c[idx] ,  sqrt(pi/2)/D ||r|| sign(S r) ]   against   q' = [ Pi q , S q ]
    mse:   k' =   ||k|| c[idx]                                      against   q' =   Pi q
    fp16:  k' =   k                                                 against   q' =   q

so <q', k'> is exactly the reference's score ``KVCodec.key_scores`` (rotated query, no key rotated
back). Exact window and current chunk keys enter as [Pi k, 0] / Pi k / k, which leaves their
scores exact; a mask applies the window rule (older than ``format.exact_start(p)``: compressed). One SDPA call then
does softmax and the value sum.

It trades memory (fp32 per token) for speed, so it is opt-in (``backend="cpu-decoded"``), meant for
the fidelity harness; ``tests/lab/eval/test_decoded_history.py`` checks it against the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from jetson_tq.cache.compressed import CompressedKVCache
from jetson_tq.codec.mse import TurboQuantMSE
from jetson_tq.codec.packing import unpack_bits
from jetson_tq.codec.prod import TurboQuantProd
from jetson_tq.errors import ShapeError
from jetson_tq.format import exact_count, exact_start
from jetson_tq.integrations.transformers import TurboQuantLayer, register_history_backend


class DecodedHistory:
    """Float32 transformed-space keys and decoded values of the compressed tokens of one ``CompressedKVCache``."""

    def __init__(self, store: CompressedKVCache, sink_tokens: int = 0) -> None:
        self.store, self.codec = store, store.codec
        self.sink_tokens = sink_tokens  # the first positions, read exactly by every query (attention sinks)
        self.sink_k: torch.Tensor | None = None
        self.sink_v: torch.Tensor | None = None
        d = store.head_dim
        self.key_dim = 2 * d if isinstance(self.codec.keys, TurboQuantProd) else d
        shape = (store.batch_size, store.num_kv_heads, 0)
        self.keys = torch.zeros(*shape, self.key_dim, device=store.device)
        self.values = torch.zeros(*shape, d, device=store.device)
        self.count = 0
        # q' = q @ M.T with M = [Pi; S] (prod), Pi (mse) or I (fp16): one matmul, as the kernels do
        self.query_matrix = self.codec.query_matrix(store.device).float()
        rot = self.codec.key_rotation
        self.key_rotation = None if rot is None else rot.matrix(store.device).float()

    # ------------------------------------------------------------------ transforms
    def transform_query(self, q: torch.Tensor) -> torch.Tensor:
        """q' for queries [..., D] -> [..., key_dim] float32."""
        return q.float() @ self.query_matrix.T

    def transform_exact_keys(self, k: torch.Tensor) -> torch.Tensor:
        """Uncompressed keys [..., D] in the transformed space, so that <q', k'> = <q, k>."""
        if self.key_rotation is None:
            return k.float()
        k_rot = k.float() @ self.key_rotation.T
        if self.key_dim == k_rot.shape[-1]:
            return k_rot
        return torch.cat([k_rot, torch.zeros_like(k_rot)], dim=-1)

    def _decode_keys(self, fields: dict) -> torch.Tensor:
        keys, d = self.codec.keys, self.store.head_dim
        if self.codec.key_coder is not None:  # klt: post-RoPE keys at their positions (fields from ``count`` on)
            n = fields["key_code"].shape[2]
            return self.codec.decode_keys(fields, torch.arange(self.count, self.count + n, device=self.store.device), 1)
        if keys is None:
            return fields["key_raw"].float()
        norm = fields["key_norm"].float()
        mse = keys.mse if isinstance(keys, TurboQuantProd) else keys
        if isinstance(mse, TurboQuantMSE):
            part = mse.centroids(unpack_bits(fields["key_idx"], mse.bits, d)) * norm
        else:  # 1-bit prod: no MSE part
            part = torch.zeros(*norm.shape[:-1], d, device=norm.device)
        if not isinstance(keys, TurboQuantProd):
            return part
        signs = unpack_bits(fields["key_signs"], 1, d).float() * 2 - 1
        return torch.cat([part, signs * (keys.qjl_scale * fields["key_rnorm"].float())], dim=-1)

    def note_exact(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep exact copies of the sink positions among the next tokens k, v [B, H, T, D] (before they are stored)."""
        start = 0 if self.sink_k is None else self.sink_k.shape[2]
        if int(self.store.lengths[0]) != start or start >= self.sink_tokens:
            return
        n = min(k.shape[2], self.sink_tokens - start)
        kk, vv = k[:, :, :n].to(self.store.dtype), v[:, :, :n].to(self.store.dtype)
        self.sink_k = kk if self.sink_k is None else torch.cat([self.sink_k, kk], 2)
        self.sink_v = vv if self.sink_v is None else torch.cat([self.sink_v, vv], 2)

    # ------------------------------------------------------------------ sync
    def sync(self, upto: int) -> None:
        """Decode the compressed tokens at positions [count, upto) of the pages (equal lengths across the batch)."""
        if upto == self.count:
            return
        if upto < self.count:
            raise ShapeError(f"compressed length went back from {self.count} to {upto}")
        fields = {name: t[:, :, self.count : upto] for name, t in self.store.paged().gather_compressed(upto).items()}
        self.keys = torch.cat([self.keys, self._decode_keys(fields)], dim=2)
        positions = torch.arange(self.count, upto, device=self.store.device)
        self.values = torch.cat([self.values, self.codec.decode_values(fields, positions, 1)], dim=2)
        sink_k, sink_v = self.sink_k, self.sink_v
        n_sink = 0 if sink_k is None else sink_k.shape[2]
        if sink_k is not None and sink_v is not None and self.count < n_sink:
            # sink positions: their exact keys / values replace the decoded ones
            a, b = self.count, min(upto, n_sink)
            self.keys[:, :, a:b] = self.transform_exact_keys(sink_k[:, :, a:b])
            self.values[:, :, a:b] = sink_v[:, :, a:b].float()
        self.count = upto

    # ------------------------------------------------------------------ attention
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        scale: float,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of q [B, Hq, T, D] under the window rule of ``reference.paged_attention_prefill``.

        ``k, v`` None: a decode step whose token the store already holds (T = 1). Otherwise the chunk [B, Hkv, T, D]
        is staged in the store's pages (not committed). ``mask``: None (causal) or a bool/float [B|1, 1|Hq, T, s + T]
        mask over key positions.
        """
        store = self.store
        lens = store.lengths
        if bool((lens != lens[0]).any()):
            raise ShapeError(f"decoded history needs equal lengths across the batch, got {lens.tolist()}")
        s, ring = int(lens[0]), store.recent_tokens
        r = int(exact_count(s, ring, store.fmt.block_window))  # = store.buffer_lens
        rk, rv = store.recent_in_order()  # positions [s - r, s)
        if k is None:  # decode: compressed [0, s - r) + the exact window
            self.sync(s)
            kk = torch.cat([self.keys[:, :, : s - r], self.transform_exact_keys(rk.to(store.dtype))], dim=2)
            vv = torch.cat([self.values[:, :, : s - r], rv.float()], dim=2)
            return self._sdpa(q, kk, vv, None, scale)
        t = q.shape[2]
        assert v is not None  # k and v come together
        self.sync(s + t)
        kk = torch.cat(
            [self.keys, self.transform_exact_keys(rk.to(store.dtype)), self.transform_exact_keys(k.to(store.dtype))],
            dim=2,
        )
        vv = torch.cat([self.values, rv.float(), v.to(store.dtype).float()], dim=2)
        dev = q.device
        qpos = s + torch.arange(t, device=dev)
        kpos = torch.cat([torch.arange(s + t, device=dev), torch.arange(s - r, s + t, device=dev)])
        exact = torch.arange(kpos.numel(), device=dev) >= s + t
        oldest = exact_start(qpos.unsqueeze(1), ring, store.fmt.block_window)
        allowed = torch.where(exact, (kpos >= oldest) & (kpos <= qpos.unsqueeze(1)), kpos < oldest)  # [T, N]
        if mask is not None:
            if mask.shape[-1] != s + t or mask.shape[-2] != t:
                raise ShapeError(f"attention_mask: expected [..., {t}, {s + t}], got {tuple(mask.shape)}")
            picked = mask[..., kpos]
            if picked.dtype == torch.bool:
                allowed = allowed & picked
            else:
                allowed = torch.zeros(allowed.shape, device=dev).masked_fill(~allowed, float("-inf")) + picked.float()
        return self._sdpa(q, kk, vv, allowed, scale)

    def _sdpa(
        self, q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, mask: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        d = vv.shape[-1]
        if self.key_dim != d:  # SDPA's fast CPU kernels want one head dim for keys and values: pad values with zeros
            vv = F.pad(vv, (0, self.key_dim - d))
        out = F.scaled_dot_product_attention(
            self.transform_query(q), kk, vv, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != kk.shape[1]
        )
        return out[..., :d].nan_to_num(0.0).to(q.dtype)  # a fully masked (padding) query row -> zeros


#: The history backend name ``register`` adds to the transformers integration.
BACKEND = "cpu-decoded"


def register() -> str:
    """Make ``backend="cpu-decoded"`` build a ``DecodedHistory`` per layer in ``TurboQuantCache`` (idempotent);
    returns the name. Called by the lab's caches that use it; code that names the backend itself calls it first."""
    register_history_backend(BACKEND, DecodedHistory)
    return BACKEND


class CodedKeyLayer(TurboQuantLayer):
    """A ``cpu-decoded`` TurboQuant layer whose compressed keys another key coder reads: its history comes from
    ``history(store, sink_tokens, center)`` (the layer's key center or None) instead of ``DecodedHistory``."""

    def __init__(
        self, base: TurboQuantLayer, history: Callable[[CompressedKVCache, int, torch.Tensor | None], DecodedHistory]
    ) -> None:
        super().__init__(
            base.fmt, base.layer_idx, base.seed, base.backend, base.center, base.sink_tokens, base.key_transform
        )
        self.history = history

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        assert self.store is not None  # the base built it
        self.decoded = self.history(self.store, self.sink_tokens, None if self.center is None else self.center[0])
