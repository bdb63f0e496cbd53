"""Reference attention over a CompressedKVCache in plain PyTorch (fp32 accumulation, GQA, CPU or CUDA).

These signatures are the contract the Triton kernels implement:
- ``paged_attention_decode(q, kv)``: one new token per sequence over a ``PagedKV`` (compressed pages
  through a block table + an uncompressed recent buffer, which already holds the token's K/V); with q
  [B, Q, Hq, D] and the new tokens' k, v, Q tokens per sequence (speculative verification) over the history.
- ``paged_attention_prefill(q, k, v, kv)``: a chunk of T tokens per sequence, causal, under the same window
  rule as decode (``format.exact_start``: positions older than p + 1 - R, or than p's own R-token block, read
  compressed, the rest exactly), so a token's treatment does not depend on whether it arrived by decode, by a
  prefill chunk of any size, or by a recompute.
``ops`` (the one backend choice) calls these or the kernels; nothing here imports a cache.
Scores over compressed tokens use the transformed query (Pi q, S q); keys are never reconstructed.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F

from ..errors import ShapeError, expect_float, expect_same_device
from ..format import exact_start
from ..paged import PagedKV
from ..validate import check_softmax_scale
from .extras import NO_EXTRAS, AttentionExtras


def _group_query(q: torch.Tensor, cache: PagedKV) -> torch.Tensor:
    """[B, Hq, T, D] -> [B, Hkv, G, T, D] (float32)."""
    b, hq, t, d = q.shape
    if d != cache.head_dim:
        raise ShapeError(f"q: expected head dim {cache.head_dim}, got {d}")
    if b != cache.batch_size:
        raise ShapeError(f"q: expected batch {cache.batch_size}, got {b}")
    if hq % cache.num_kv_heads:
        raise ShapeError(f"q: {hq} query heads is not a multiple of {cache.num_kv_heads} KV heads")
    return q.float().reshape(b, cache.num_kv_heads, hq // cache.num_kv_heads, t, d)


def history_scores_and_values(
    qg: torch.Tensor, kv: PagedKV, scale: float = 1.0, extras: AttentionExtras = NO_EXTRAS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores [B, Hkv, G, T, N] of grouped queries against the history (times ``scale``, soft-capped by
    ``extras``), and its values [B, Hkv, N, D]; the queries sit at the history's last position L - 1.

    N = longest compressed part + longest recent buffer; positions past a sequence's own length, and before its
    sliding window (``extras``), get -inf (and, under a window, zero values: their blocks may be freed). Without a
    window the ring's rows may hold its tokens in any order; with one, token p sits in row p % R (vLLM, the cache).
    """
    codec = kv.codec
    comp_lens, rec_lens = kv.compressed_lens.long().to(qg.device), kv.recent_lens.long().to(qg.device)
    nc, nb = int(comp_lens.max()), int(rec_lens.max())
    lo = extras.window_start(comp_lens + rec_lens - 1)  # [B] first position the query may read
    fields = kv.gather_compressed(nc)
    q_rot, q_sketch = codec.transform_query(qg)
    expand = {name: t.unsqueeze(2) for name, t in fields.items()}  # broadcast over the G query heads
    cpos = torch.arange(nc, device=qg.device)  # the compressed part holds positions [0, nc) of each sequence
    s_comp = extras.cap(codec.key_scores(q_rot, q_sketch, expand, cpos, head_axis=1) * scale)  # [B, Hkv, G, T, nc]
    rec_k = kv.recent_k[kv.recent_index.long(), :, :nb].float()
    rec_v = kv.recent_v[kv.recent_index.long(), :, :nb].float()
    s_buf = extras.cap((qg @ rec_k.unsqueeze(2).transpose(-1, -2)) * scale)
    sinks = _sink_count(kv)
    mask_c = (cpos.unsqueeze(0) >= comp_lens.unsqueeze(1)) | (cpos.unsqueeze(0) < torch.clamp(lo, min=sinks)[:, None])
    mask_b = torch.arange(nb, device=qg.device).unsqueeze(0) >= rec_lens.unsqueeze(1)
    if extras.sliding_window is not None:  # the ring's rows by position (token p in row p % R) against the window
        mask_b |= _ring_positions(kv, qg.device)[:, :nb] < lo[:, None]
    s_comp = s_comp.masked_fill(mask_c[:, None, None, None, :], float("-inf"))
    s_buf = s_buf.masked_fill(mask_b[:, None, None, None, :], float("-inf"))
    v_comp = codec.decode_values(fields, cpos, head_axis=1)
    if extras.sliding_window is not None:  # never use a value from before the window (a freed block's bytes)
        v_comp = v_comp.masked_fill(mask_c[:, None, :, None], 0.0)
    scores, values = [s_comp, s_buf], [v_comp, rec_v]
    if sinks:
        s_sink, v_sink = _sink_candidates(qg, kv, comp_lens, lo)
        scores.append(extras.cap(s_sink * scale).masked_fill(s_sink == float("-inf"), float("-inf")))
        values.append(v_sink)
    return torch.cat(scores, dim=-1), torch.cat(values, dim=2)


def _sink_count(kv: PagedKV) -> int:
    """S: positions < S are read exactly from the sink copy (``fmt.sink_tokens``; 0 without one)."""
    return 0 if kv.sink_k is None else kv.sink_k.shape[2]


def _sink_candidates(
    qg: torch.Tensor, kv: PagedKV, comp_lens: torch.Tensor, lo: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unscaled scores [B, Hkv, G, T, S] against the sink copy, -inf past each sequence's compressed part (younger
    positions are still in the ring) and before each query's window start ``lo`` ([B] or [B, T]), and its values
    [B, Hkv, S, D]."""
    assert kv.sink_k is not None and kv.sink_v is not None  # callers check _sink_count first
    sk, sv = kv.sink_k.float(), kv.sink_v.float()
    s = qg @ sk.unsqueeze(2).transpose(-1, -2)
    spos = torch.arange(sk.shape[2], device=qg.device)
    stale = (spos.unsqueeze(0) >= comp_lens.unsqueeze(1))[:, None, :]  # [B, 1, S]
    lo = lo if lo.dim() == 2 else lo[:, None]
    stale = stale | (spos[None, None, :] < lo[:, :, None])  # [B, T|1, S]
    return s.masked_fill(stale[:, None, None, :, :], float("-inf")), sv


def grouped_sinks(extras: AttentionExtras, qg: torch.Tensor) -> torch.Tensor | None:
    """The sink logits [1, Hkv, G, 1, 1] (fp32) of grouped queries [B, Hkv, G, T, D] (None without sinks)."""
    if extras.sinks is None:
        return None
    extras.check(qg.shape[1] * qg.shape[2], qg.device)
    return extras.sinks.float().reshape(1, qg.shape[1], qg.shape[2], 1, 1)


def _finish(scores: torch.Tensor, values: torch.Tensor, out_shape, dtype, sink: torch.Tensor | None = None):
    """Softmax over the last axis of ``scores`` (plus the ``sink`` logit in the denominator only) times values."""
    if sink is not None:
        full = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
        probs = torch.softmax(full, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs @ values.unsqueeze(2)).reshape(out_shape).to(dtype)


def paged_attention_decode(
    q: torch.Tensor,
    kv: PagedKV,
    softmax_scale: float | None = None,
    extras: AttentionExtras = NO_EXTRAS,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence, q [B, Hq, D], over everything ``kv`` holds -> [B, Hq, D]; the
    query sits at position L - 1 (L = compressed_lens + recent_lens) for the sliding window of ``extras``.

    Multi-token form (a speculative verification row: the last sampled token and its drafts): q [B, Q, Hq, D] with
    the Q tokens' exact k, v [B, Q, Hkv, D] -> [B, Q, Hq, D]. ``kv`` then describes the s-token history (the ring
    does not hold the new tokens yet: R columns cannot hold both them and the older exact tokens the earlier query
    tokens still read), the pages already hold the new tokens' compressed copies at [s, s + Q). Token i sits at
    position s + i and reads positions <= s + i under the window rule (``format.exact_start`` per query position)
    and ``extras`` per query position: exactly what ``paged_attention_prefill`` computes for a chunk of Q tokens."""
    expect_float("q", q)
    check_softmax_scale(softmax_scale)
    expect_same_device(q=q, pages=kv.pages)
    if q.dim() == 4:
        if k is None or v is None or k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.dim() != 4:
            got = None if k is None or v is None else (tuple(k.shape), tuple(v.shape))
            raise ShapeError(f"k, v: expected [{q.shape[0]}, {q.shape[1]}, Hkv, D] with a 4-d q, got {got}")
        out = paged_attention_prefill(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), kv, softmax_scale, extras=extras
        )
        return out.transpose(1, 2)
    if q.dim() != 3 or k is not None or v is not None:
        raise ShapeError(f"q: expected [B, Hq, D] (or [B, Q, Hq, D] with k, v), got {tuple(q.shape)}")
    if bool(((kv.compressed_lens + kv.recent_lens) == 0).any()):
        raise ShapeError("attention_decode: a sequence has an empty cache; append its K/V first")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qg = _group_query(q.unsqueeze(2), kv)
    scores, values = history_scores_and_values(qg, kv, scale, extras)
    return _finish(scores, values, q.shape, q.dtype, grouped_sinks(extras, qg))


def _ring_positions(kv: PagedKV, device: torch.device) -> torch.Tensor:
    """Position of each ring row [B, R] (token p sits in row p % R), -1 where the row holds no token yet."""
    ring = kv.recent_k.shape[2]
    comp, rec = kv.compressed_lens.long().to(device), kv.recent_lens.long().to(device)
    base = comp.unsqueeze(1)  # the oldest exact history token sits at position compressed_lens
    t = torch.arange(ring, device=device).unsqueeze(0)
    off = (t - base) % max(ring, 1)
    return torch.where(off < rec.unsqueeze(1), base + off, -1)


def paged_attention_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKV,
    softmax_scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    extras: AttentionExtras = NO_EXTRAS,
) -> torch.Tensor:
    """Attention of a chunk q [B, Hq, T, D] at positions [s, s + T) over history and chunk (causal), with the
    window rule of decode: a query at position p reads positions [e, p] exactly and older ones compressed, e =
    ``kv.layout.fmt.exact_start(p)`` with R = the ring size ``kv.recent_k.shape[2]`` (p + 1 - R sliding, p - p % R
    block), so results do not depend on how the tokens were chunked (chunks may straddle block boundaries).

    ``kv`` describes the history: s = compressed_lens + recent_lens tokens, the last recent_lens of them exact in the
    ring (row p % R). The pages must already hold the chunk's compressed tokens at positions [s, s + T) (vLLM writes
    them before attention; ``CompressedKVCache`` stages them), read only where the window rule asks for them.
    ``attn_mask`` (optional, bool or additive, [B|1, 1|Hq, T, s + T] over key positions; equal s across the batch)
    is applied on top (padding, custom patterns); a query row it masks fully gets zeros. ``extras``: sinks, soft cap
    and sliding window (``attention.extras``; a query reads nothing before its window start, compressed or exact).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        expect_float(name, x)
        if x.dim() != 4:
            raise ShapeError(f"{name}: expected a 4-d tensor [B, H, T, D], got {tuple(x.shape)}")
    check_softmax_scale(softmax_scale)
    expect_same_device(q=q, k=k, v=v, pages=kv.pages)
    if k.shape != v.shape or k.shape[1] != kv.num_kv_heads or k.shape[2] != q.shape[2] or k.shape[0] != q.shape[0]:
        raise ShapeError(
            f"k, v: expected [{q.shape[0]}, {kv.num_kv_heads}, {q.shape[2]}, D], "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qg = _group_query(q, kv)  # [B, Hkv, G, T, D]
    dev, t, ring = q.device, q.shape[2], kv.recent_k.shape[2]
    codec = kv.codec
    hist = (kv.compressed_lens + kv.recent_lens).long().to(dev)  # s per sequence
    qpos = hist.unsqueeze(1) + torch.arange(t, device=dev)  # [B, T] query positions
    oldest_exact = exact_start(qpos, ring, kv.layout.fmt.block_window)  # [B, T]: positions below it read compressed
    lo = extras.window_start(qpos)  # [B, T]: positions below it are not read at all
    # compressed candidates: every position [0, s + T) of the pages
    nc = int(hist.max()) + t
    fields = kv.gather_compressed(nc)
    q_rot, q_sketch = codec.transform_query(qg)
    cpos = torch.arange(nc, device=dev)
    s_comp = codec.key_scores(
        q_rot, q_sketch, {n: f.unsqueeze(2) for n, f in fields.items()}, cpos, 1
    )  # [B,Hkv,G,T,nc]
    sinks = _sink_count(kv)
    ok_comp = (cpos[None, None, :] < oldest_exact[:, :, None]) & (cpos[None, None, :] >= sinks)  # [B, T, nc]
    ok_comp &= cpos[None, None, :] >= lo[:, :, None]
    # exact candidates: the ring (history) and the chunk itself
    rpos = _ring_positions(kv, dev)  # [B, R]
    rk = kv.recent_k[kv.recent_index.long()].float()  # [B, Hkv, R, D]
    rv = kv.recent_v[kv.recent_index.long()].float()
    kc, vc = k.to(kv.recent_k.dtype).float(), v.to(kv.recent_v.dtype).float()  # through the ring dtype
    epos = torch.cat([rpos, qpos], dim=1)  # [B, R + T]
    ek, ev = torch.cat([rk, kc], dim=2), torch.cat([rv, vc], dim=2)
    s_exact = qg @ ek.unsqueeze(2).transpose(-1, -2)  # [B, Hkv, G, T, R + T]
    ok_exact = (
        (epos[:, None, :] >= 0)
        & ((epos[:, None, :] >= oldest_exact[:, :, None]) | (epos[:, None, :] < sinks))
        & (epos[:, None, :] <= qpos[:, :, None])
        & (epos[:, None, :] >= lo[:, :, None])
    )
    s_comp = extras.cap(s_comp * scale).masked_fill(~ok_comp[:, None, None], float("-inf"))
    s_exact = extras.cap(s_exact * scale).masked_fill(~ok_exact[:, None, None], float("-inf"))
    v_comp = codec.decode_values(fields, cpos, head_axis=1)
    if extras.sliding_window is not None:  # never use a value before every query's window (a freed block's bytes)
        v_comp = v_comp.masked_fill((cpos < lo.min(dim=1).values[:, None])[:, None, :, None], 0.0)
    scores, values = [s_comp, s_exact], [v_comp, ev]
    if sinks:
        s_sink, v_sink = _sink_candidates(qg, kv, kv.compressed_lens.long().to(dev), lo)
        scores.append(extras.cap(s_sink * scale).masked_fill(s_sink == float("-inf"), float("-inf")))
        values.append(v_sink)
    if attn_mask is not None:
        add_c, add_e = _positional_mask(attn_mask, hist, t, epos, qg.shape)
        scores[0], scores[1] = scores[0] + add_c, scores[1] + add_e
        if sinks:  # sink copy j carries the mask of position j (positions past the mask's reach are stale anyway)
            scores[2] = scores[2] + F.pad(add_c[..., :sinks], (0, max(0, sinks - add_c.shape[-1])))
    out = _finish(
        torch.cat(scores, dim=-1), torch.cat(values, dim=2), q.shape, torch.float32, grouped_sinks(extras, qg)
    )
    return (out.nan_to_num(0.0) if attn_mask is not None else out).to(q.dtype)


def _positional_mask(mask: torch.Tensor, hist: torch.Tensor, t: int, epos: torch.Tensor, qshape) -> tuple:
    """An additive [B, Hkv, G, T, ·] mask for the compressed (positions 0..N-1) and exact (``epos``) candidates."""
    b, hkv, g = qshape[0], qshape[1], qshape[2]
    n = int(hist.max()) + t
    if bool((hist != hist[0]).any()):
        raise ShapeError(f"attn_mask: needs equal history lengths across the batch, got {hist.tolist()}")
    if (
        mask.dim() != 4
        or mask.shape[-1] != n
        or mask.shape[-2] != t
        or mask.shape[0] not in (1, b)
        or mask.shape[1] not in (1, hkv * g)
    ):
        raise ShapeError(f"attention_mask: expected [{b}, 1 or {hkv * g}, {t}, {n}], got {tuple(mask.shape)}")
    add = (
        torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))
        if mask.dtype == torch.bool
        else mask.float()
    )
    add = add.reshape(add.shape[0], 1, 1, t, n) if add.shape[1] == 1 else add.reshape(add.shape[0], hkv, g, t, n)
    full = add.expand(b, *add.shape[1:])
    idx = epos.clamp_min(0)[:, None, None, None, :].expand(b, add.shape[1], add.shape[2], t, epos.shape[1])
    return add, full.gather(-1, idx)


class VarlenAttention(Protocol):
    """FlashAttention's varlen call, returning (out [total_q, Hq, D], lse [Hq, total_q] fp32, natural log);
    ``varlen_attention_reference`` states the contract."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        softmax_scale: float,
        causal: bool,
        *,
        cu_seqlens_k: torch.Tensor | None = None,
        seqused_k: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def varlen_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    *,
    cu_seqlens_k: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's varlen contract in PyTorch: (out [total_q, Hq, D] in q's dtype, lse [Hq, total_q] fp32).

    Sequence i has queries q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]] and keys either k[cu_seqlens_k[i]:...] (packed
    k, v [total_k, Hkv, D]) or, with ``block_table`` [n, pages], the first seqused_k[i] tokens of the pages
    block_table[i] of a paged k, v [blocks, page tokens, Hkv, D]. ``causal`` aligns the mask to the bottom right
    (query j sees keys <= j + seqlen_k - seqlen_q); lse is the natural log-sum-exp of the scaled scores. The
    ``max_seqlen_*`` bounds are the kernel's launch sizes and are only checked here."""
    cq = cu_seqlens_q.tolist()
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    g = q.shape[1] // k.shape[-2]
    for i in range(len(cq) - 1):
        if block_table is not None:
            assert seqused_k is not None  # paged keys always come with their counts
            n = int(seqused_k[i])
            ki = k[block_table[i].long()].flatten(0, 1)[:n]
            vi = v[block_table[i].long()].flatten(0, 1)[:n]
        else:
            assert cu_seqlens_k is not None  # packed keys always come with their offsets
            k0, k1 = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
            ki, vi = k[k0:k1], v[k0:k1]
        qi = q[cq[i] : cq[i + 1]].float()
        if qi.shape[0] > max_seqlen_q or ki.shape[0] > max_seqlen_k:
            raise ShapeError(f"sequence {i}: {qi.shape[0]} x {ki.shape[0]} exceeds {max_seqlen_q} x {max_seqlen_k}")
        if qi.shape[0] == 0 or ki.shape[0] == 0:
            continue
        kf = ki.float().repeat_interleave(g, dim=1)
        vf = vi.float().repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", qi, kf) * softmax_scale
        if causal:
            shift = ki.shape[0] - qi.shape[0]
            keep = (
                torch.arange(ki.shape[0], device=q.device)[None, :]
                <= torch.arange(qi.shape[0], device=q.device)[:, None] + shift
            )
            s = s.masked_fill(~keep, float("-inf"))
        li = torch.logsumexp(s, dim=-1)  # [H, q]
        p = torch.exp(s - li[..., None]).nan_to_num(0.0)
        out[cq[i] : cq[i + 1]] = torch.einsum("hqk,khd->qhd", p, vf)
        lse[:, cq[i] : cq[i + 1]] = li
    return out.to(q.dtype), lse


def merge_states_reference(
    out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor, rows: torch.Tensor
) -> None:
    """Add a partial attention result over other keys into ``out`` in place: for i < len(rows), out[rows[i]]
    [H, D] and lse[:, rows[i]] (natural log-sum-exp, fp32) become the softmax-weighted merge with part[i] and
    part_lse[:, i]; a non-finite lse (FlashAttention's mark of a row with no keys) counts as no mass."""
    r = rows.long()
    la = _finite_or_ninf(lse[:, r])
    lb = _finite_or_ninf(part_lse)
    m = torch.maximum(la, lb)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(la - safe), torch.exp(lb - safe)
    tot = wa + wb
    keep = tot > 0
    denom = torch.where(keep, tot, torch.ones_like(tot))
    merged = (out[r].float() * (wa / denom).T[..., None] + part.float() * (wb / denom).T[..., None]).to(out.dtype)
    out[r] = torch.where(keep.T[..., None], merged, out[r])
    lse[:, r] = torch.where(keep, safe + torch.log(denom), la)


def _finite_or_ninf(x: torch.Tensor) -> torch.Tensor:
    """x with +inf / NaN (no keys) replaced by -inf."""
    return torch.where(torch.isnan(x) | (x == float("inf")), torch.full_like(x, float("-inf")), x)
