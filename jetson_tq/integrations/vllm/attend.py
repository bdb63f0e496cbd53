"""The read path of a compressed layer (``impl.TurboQuantAttentionImpl`` inherits it): attention of a step's rows over
their compressed pages plus the fp16 ring, one route per kind of row, and the ring updates each route owes.

- one-token decode rows of a decode-only step on a graph-safe device: device buffers only (CUDA-graph capturable);
- uniform verification rows (speculative decoding, T = 1 + k tokens each): one multi-token decode, the ring columns
  they overwrite saved to the undo pool first (``recent.Rewind`` puts back those of rejected drafts);
- everything else eagerly: decode rows in one launch (or, reproducible mode, as one-token prefill chunks), short
  verification rows among prefill chunks in one prefill launch per length, the prefill chunks that FlashAttention
  serves (``flash.flash_rows``) all in one call over a plan built once per step, every other chunk on its own.

A mixin rather than functions so the routes stay methods of the layer (the warm-up runs them through the layer, and
tests spy on them there); it holds no state of its own: the attributes below are the impl's.
"""

from __future__ import annotations

import numpy as np
import torch

from ... import ops
from ...attention.extras import AttentionExtras
from ...attention.reference import VarlenAttention
from ...codec.kv import KVCodec
from ...format import PagedLayout, exact_count
from ...paged import PagedKV
from .flash import flash_rows, prefill_varlen
from .flash_step import flash_step
from .metadata import TurboQuantMetadata, device_ints


class ReadPath:
    """Attention routes over a layer's pages and ring (``forward`` picks one per step)."""

    scale: float
    extras: AttentionExtras
    reproducible: bool
    layout: PagedLayout | None
    codec: KVCodec | None
    recent_k: torch.Tensor | None
    recent_v: torch.Tensor | None
    undo_tokens: int
    undo_k: torch.Tensor | None
    undo_v: torch.Tensor | None

    def _paged(self, pages, block_table, comp, rec, rows) -> PagedKV:
        assert self.recent_k is not None and self.recent_v is not None  # _check ran (pool allocated)
        assert self.layout is not None and self.codec is not None
        return PagedKV(pages, block_table, comp, self.recent_k, self.recent_v, rec, rows, self.layout, self.codec)

    def _decode_graph_safe(self, query, key, value, kv_cache, md: TurboQuantMetadata, output) -> None:
        """A decode-only batch with device tensors only (capturable): token i belongs to row i (T tokens of
        verification rows: tokens [i T, (i + 1) T), ``_verify_rows``)."""
        nd = md.num_decodes
        if md.dec_query_tokens > 1:
            self._verify_rows(query, key, value, kv_cache, md, output)
            return
        if md.recent_tokens > 0:
            assert self.recent_k is not None and self.recent_v is not None  # _check ran
            self.recent_k[md.dec_ring_rows, :, md.dec_ring_cols] = key[:nd].to(self.recent_k.dtype)
            self.recent_v[md.dec_ring_rows, :, md.dec_ring_cols] = value[:nd].to(self.recent_v.dtype)
        kv = self._paged(kv_cache, md.block_table[:nd], md.dec_compressed_lens, md.dec_recent_lens, md.dec_ring_rows)
        output[:nd] = ops.decode(query[:nd], kv, self.scale, extras=self.extras)

    def _verify_rows(self, query, key, value, kv_cache, md: TurboQuantMetadata, output) -> None:
        """The leading ``num_decodes`` verification rows of T = ``dec_query_tokens`` tokens each in one multi-token
        decode over their histories (device buffers only: capturable), then the ring columns their tokens take go to
        the undo pool (rejected drafts: ``recent.Rewind``) and their tokens into the ring."""
        nd, t, R = md.num_decodes, md.dec_query_tokens, md.recent_tokens
        n = nd * t
        kv = self._paged(kv_cache, md.block_table[:nd], md.dec_compressed_lens, md.dec_recent_lens, md.dec_ring_rows)
        q = query[:n].view(nd, t, *query.shape[1:])
        k, v = key[:n].view(nd, t, *key.shape[1:]), value[:n].view(nd, t, *value.shape[1:])
        out = ops.decode(q, kv, self.scale, extras=self.extras, k=k, v=v)
        output[:n] = out.reshape(n, *out.shape[2:]).to(output.dtype)
        if R > 0:
            assert self.recent_k is not None and self.recent_v is not None  # _check ran
            assert md.dec_token_cols is not None  # the builder fills it with dec_query_tokens > 1
            ring_rows, cols = md.dec_ring_rows[:, None].expand(nd, t), md.dec_token_cols
            if self.undo_k is not None and self.undo_v is not None:
                undo_cols = torch.arange(t, device=query.device).expand(nd, t)
                self.undo_k[ring_rows, :, undo_cols] = self.recent_k[ring_rows, :, cols]
                self.undo_v[ring_rows, :, undo_cols] = self.recent_v[ring_rows, :, cols]
            self.recent_k[ring_rows, :, cols] = k.to(self.recent_k.dtype)
            self.recent_v[ring_rows, :, cols] = v.to(self.recent_v.dtype)

    def _forward_eager(self, query, key, value, kv_cache, md: TurboQuantMetadata, output) -> None:
        dev, R = query.device, md.recent_tokens
        qsl, seq, ctx, rows = md.query_start_loc, md.seq_lens, md.context_lens, md.ring_rows
        q_lens = np.diff(qsl)
        if md.dec_query_tokens > 1 and md.num_decodes:  # leading uniform verification rows: the decode path
            self._verify_rows(query, key, value, kv_cache, md, output)
        dec = np.nonzero((q_lens[: md.num_decodes] == 1) & (seq[: md.num_decodes] > 0))[0]
        if dec.size and self.reproducible:
            self._decode_as_prefill(query, key, value, kv_cache, md, output, dec)
        elif dec.size:
            L = seq[dec]
            rec = exact_count(L, R, md.block_window)
            tok, ring_rows, cols, idx, comp_d, rec_d = device_ints(
                md,
                "decode",
                dev,
                (qsl[dec], torch.int64),
                (rows[dec], torch.int64),
                ((L - 1) % max(R, 1), torch.int64),
                (dec, torch.int64),
                (L - rec, torch.int32),
                (rec, torch.int32),
            )
            if R > 0:
                assert self.recent_k is not None and self.recent_v is not None  # _check ran
                self.recent_k[ring_rows, :, cols] = key[tok].to(self.recent_k.dtype)
                self.recent_v[ring_rows, :, cols] = value[tok].to(self.recent_v.dtype)
            kv = self._paged(kv_cache, md.block_table[idx], comp_d, rec_d, ring_rows)
            output[tok] = ops.decode(query[tok], kv, self.scale, extras=self.extras).to(output.dtype)
        pre = np.arange(md.num_decodes, md.num_reqs)
        if self.undo_tokens:  # speculative verification rows: one launch per row length, not one per request
            short = (q_lens[pre] > 1) & (q_lens[pre] <= self.undo_tokens)
            for t in np.unique(q_lens[pre][short]).tolist():
                self._forward_rows(query, key, value, kv_cache, md, output, pre[short & (q_lens[pre] == t)], t)
            pre = pre[~short]
        flash, varlen = self._flash_selection(md, pre, q_lens[pre])
        if varlen is not None and flash.any():
            self._prefill_flash_rows(query, key, value, kv_cache, md, output, pre[flash], varlen)
            pre = pre[~flash]
        ctx_p = ctx[pre]
        ring_p = ctx_p % R if md.block_window else np.minimum(ctx_p, R)  # history tokens read from the ring
        comp_all, rec_all, row_all = device_ints(
            md,
            "prefill",
            dev,
            (ctx_p - ring_p, torch.int32),
            (ring_p, torch.int32),
            (rows[pre], torch.int64),
            per_row=True,
        )
        for j, i in enumerate(pre.tolist()):
            qs, qe, s = int(qsl[i]), int(qsl[i + 1]), int(ctx[i])
            if qe <= qs:
                continue
            row = int(rows[i])
            kv = self._paged(
                kv_cache,
                md.block_table[i : i + 1],
                comp_all[j, :1],
                rec_all[j, :1],
                row_all[j, :1],
            )
            q = query[qs:qe].transpose(0, 1).unsqueeze(0)
            k = key[qs:qe].transpose(0, 1).unsqueeze(0)
            v = value[qs:qe].transpose(0, 1).unsqueeze(0)
            out = ops.prefill(
                q,
                k,
                v,
                kv,
                self.scale,
                max_tokens=s + qe - qs,
                reproducible=self.reproducible,
                varlen=prefill_varlen(s, qe - qs),
                history=[s],
                extras=self.extras,
            )
            output[qs:qe] = out[0].transpose(0, 1).to(output.dtype)
            if R > 0:
                assert self.recent_k is not None and self.recent_v is not None  # _check ran
                j0 = max(0, (qe - qs) - R)
                cols = torch.arange(s + j0, s + qe - qs, device=dev) % R
                row_idx = torch.full_like(cols, row)  # two index tensors around ':' -> [n, H, D], as key rows are
                if self.undo_k is not None and self.undo_v is not None and qe - qs <= self.undo_tokens:
                    undo_cols = torch.arange(qe - qs, device=dev)  # a verification row: its drafts may be rejected
                    self.undo_k[row_idx, :, undo_cols] = self.recent_k[row_idx, :, cols]
                    self.undo_v[row_idx, :, undo_cols] = self.recent_v[row_idx, :, cols]
                self.recent_k[row_idx, :, cols] = key[qs + j0 : qe].to(self.recent_k.dtype)
                self.recent_v[row_idx, :, cols] = value[qs + j0 : qe].to(self.recent_v.dtype)

    def _flash_selection(
        self, md: TurboQuantMetadata, pre: np.ndarray, t: np.ndarray
    ) -> tuple[np.ndarray, VarlenAttention | None]:
        """Which prefill rows ``pre`` (``t`` tokens each) go to FlashAttention together (``flash.flash_rows``), and its
        call: not in reproducible mode (a row's result would depend on its batch), not with extras (the Triton loop
        serves them), not rows as short as a verification row (their drafts' ring columns go to the undo pool)."""
        none = np.zeros(pre.shape, dtype=bool)
        if self.reproducible or self.extras.any or pre.size == 0:
            return none, None
        varlen, on = flash_rows(md.context_lens[pre], t)
        return on & (t > self.undo_tokens), varlen

    def _prefill_flash_rows(
        self, query, key, value, kv_cache, md: TurboQuantMetadata, output, sel: np.ndarray, varlen: VarlenAttention
    ) -> None:
        """Prefill rows ``sel`` in one FlashAttention call over their histories (``ops.prefill_rows``) with the step's
        indices and plan, which the first layer builds and every layer reuses (``flash_step``,
        ``ops.plan_prefill_rows``); then each chunk's last min(T, R) tokens go to its ring row, in one indexed write."""
        st = flash_step(md, sel, query.device)
        q, k, v = (x[st.span[0] : st.span[1]] if st.span else x[st.tokens] for x in (query, key, value))
        kv = self._paged(kv_cache, md.block_table[st.requests], st.compressed, st.recent, st.ring_rows)
        plan_key = ("flash-plan", sel.tobytes(), kv.num_kv_heads, kv.head_dim, kv.recent_k.shape[2])  # its shapes
        plan = md.plans.get(plan_key)
        if plan is None:
            plan = md.plans[plan_key] = ops.plan_prefill_rows(kv, st.history, st.query_start_loc)
        out = ops.prefill_rows(q, k, v, kv, st.query_start_loc, st.history, self.scale, varlen=varlen, plan=plan)
        if st.span:
            output[st.span[0] : st.span[1]] = out.to(output.dtype)
        else:
            output[st.tokens] = out.to(output.dtype)
        if md.recent_tokens > 0:
            assert self.recent_k is not None and self.recent_v is not None  # _check ran
            self.recent_k[st.write_rows, :, st.write_cols] = key[st.write_tokens].to(self.recent_k.dtype)
            self.recent_v[st.write_rows, :, st.write_cols] = value[st.write_tokens].to(self.recent_v.dtype)

    def _forward_rows(self, query, key, value, kv_cache, md: TurboQuantMetadata, output, sel: np.ndarray, t: int):
        """Rows ``sel`` of ``t`` tokens each (speculative verification rows: the last sampled token and its drafts)
        in one prefill launch: each a chunk over its own history (compressed + ring), causal inside, as the
        per-request loop computes it; then the ring columns they overwrite go to the undo pool and their tokens to
        the ring."""
        dev, R, n = query.device, md.recent_tokens, len(sel)
        s = md.context_lens[sel]
        r = s % R if (md.block_window and R > 0) else np.minimum(s, R)  # history tokens the ring holds
        tok, idx, comp, rec, rows, cols = device_ints(
            md,
            f"rows{t}",
            dev,
            (md.query_start_loc[sel][:, None] + np.arange(t), torch.int64),
            (sel, torch.int64),
            (s - r, torch.int32),
            (r, torch.int32),
            (md.ring_rows[sel], torch.int64),
            ((s[:, None] + np.arange(t)) % max(R, 1), torch.int64),
        )
        tok, cols = tok.view(n, t), cols.view(n, t)
        kv = self._paged(kv_cache, md.block_table[idx], comp, rec, rows)
        q, k, v = (x[tok].permute(0, 2, 1, 3) for x in (query, key, value))  # [rows, H, t, D]
        out = ops.prefill(q, k, v, kv, self.scale, max_tokens=int(s.max()) + t, reproducible=self.reproducible)
        output[tok] = out.permute(0, 2, 1, 3).to(output.dtype)
        if R > 0:
            assert self.recent_k is not None and self.recent_v is not None  # _check ran
            ring_rows = rows[:, None].expand(n, t)
            if self.undo_k is not None and self.undo_v is not None:
                undo_cols = torch.arange(t, device=dev).expand(n, t)
                self.undo_k[ring_rows, :, undo_cols] = self.recent_k[ring_rows, :, cols]
                self.undo_v[ring_rows, :, undo_cols] = self.recent_v[ring_rows, :, cols]
            self.recent_k[ring_rows, :, cols] = key[tok].to(self.recent_k.dtype)
            self.recent_v[ring_rows, :, cols] = value[tok].to(self.recent_v.dtype)

    def _decode_as_prefill(self, query, key, value, kv_cache, md: TurboQuantMetadata, output, dec: np.ndarray) -> None:
        """Reproducible mode: decode rows ``dec`` as one-token prefill chunks in one launch, so a position's output
        is bitwise what a prompt chunk holding it computes (after a preemption vLLM recomputes generated tokens as
        a prompt) and does not depend on the other rows. The ring gets the new token after attention, as for a
        chunk."""
        dev, R = query.device, md.recent_tokens
        tok = torch.from_numpy(md.query_start_loc[dec]).to(dev)
        s = md.seq_lens[dec] - 1  # history before the new token
        r = s % R if (md.block_window and R > 0) else np.minimum(s, R)  # history tokens the ring holds
        ring_rows = torch.from_numpy(md.ring_rows[dec]).to(dev)
        kv = self._paged(
            kv_cache,
            md.block_table[torch.from_numpy(dec).to(dev)],
            torch.from_numpy(s - r).to(dev, torch.int32),
            torch.from_numpy(r).to(dev, torch.int32),
            ring_rows,
        )
        q, k, v = (x[tok].unsqueeze(2) for x in (query, key, value))  # [rows, H, 1, D]
        out = ops.prefill(q, k, v, kv, self.scale, max_tokens=int(s.max()) + 1, reproducible=True, extras=self.extras)
        output[tok] = out[:, :, 0].to(output.dtype)
        if R > 0:
            assert self.recent_k is not None and self.recent_v is not None  # _check ran
            cols = torch.from_numpy(s % R).to(dev)
            self.recent_k[ring_rows, :, cols] = key[tok].to(self.recent_k.dtype)
            self.recent_v[ring_rows, :, cols] = value[tok].to(self.recent_v.dtype)
