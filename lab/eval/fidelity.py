"""Fidelity of compressed KV caches on a real model, measured against the same model with an exact cache.

Three probes, each comparing every variant with the uncompressed reference (fp32 ``DynamicCache``):

- ``teacher_forced``: text windows are fed in chunks (so history is really compressed when later
  chunks attend to it); per token: NLL (-> perplexity), KL(p_ref || p_variant), top-1 agreement.
- ``generation``: the reference generates N greedy tokens from each prompt after one exact prefill;
  each variant decodes one token at a time from the same prefill (compressed), both fed the
  reference's tokens (greedy agreement, per step) and free-running (exact match, first divergence).
- ``needle``: a pass key hidden in essay text at several depths and lengths; the answer is decoded
  from the compressed cache; retrieval counts are compared with the reference's.

A ``Variant`` is one row: a TurboQuant YAML config (our cache and attention) or a simulated
baseline (fp8 / KIVI-style int); its bytes per token come from its own layout.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from jetson_tq.config import TurboQuantConfig
from jetson_tq.format import fp16_bytes_per_token
from jetson_tq.integrations.transformers import TurboQuantCache, enable_turboquant, model_dims

from .decoded_history import BACKEND
from .decoded_history import register as register_decoded
from .klt_keys import KLTKeyCache, KLTPlan
from .simulated_caches import SimulatedFormat, SimulatedQuantCache
from .split_keys import SplitKeyCache, SplitKeyPlan

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


# ---------------------------------------------------------------------------------------------- variants
@dataclass
class Variant:
    """One row of the comparison: a name, a family (for tables/plots) and a TurboQuant config or baseline format."""

    name: str
    family: str
    spec: TurboQuantConfig | SimulatedFormat | None  # None: the uncompressed reference
    note: str = ""
    backend: str = "auto"  # TurboQuantCache backend ("cpu-decoded" for long CPU evaluations)
    centers: list | None = None  # per-layer (key, value) offsets [H, D] of a centered cache (TurboQuantCache)
    sink_tokens: int = 0  # first positions read exactly (cpu-decoded backend)
    split_keys: SplitKeyPlan | None = None  # keys coded in two channel sets (cpu-decoded backend, split_keys.py)
    klt_keys: KLTPlan | None = None  # keys transform-coded pre-RoPE (cpu-decoded backend, klt_keys.py)
    key_transforms: list | None = None  # klt formats: per-layer codec.klt.KeyTransform (else the config's file)

    def make_cache(self, model):
        """A fresh cache of this variant for ``model`` (a DynamicCache for the reference)."""
        if self.spec is None:
            return DynamicCache(config=model.config)
        if isinstance(self.spec, SimulatedFormat):
            return SimulatedQuantCache(self.spec, model.config.num_hidden_layers)
        if self.split_keys is not None:
            return SplitKeyCache(model, self.spec, self.split_keys, centers=self.centers, sink_tokens=self.sink_tokens)
        if self.klt_keys is not None:
            return KLTKeyCache(model, self.spec, self.klt_keys, centers=self.centers, sink_tokens=self.sink_tokens)
        if self.backend == BACKEND:
            register_decoded()
        return TurboQuantCache(
            model,
            self.spec,
            backend=self.backend,
            centers=self.centers,
            sink_tokens=self.sink_tokens,
            key_transforms=self.key_transforms,
        )

    def layer_bytes(self, num_layers: int, head_dim: int) -> list[float]:
        """Stored bytes per token per KV head (K+V) of each layer, excluding the fp recent buffer."""
        if self.spec is None:
            return [float(fp16_bytes_per_token(head_dim))] * num_layers
        if isinstance(self.spec, SimulatedFormat):
            return [self.spec.layer_bytes_per_token(i, num_layers, head_dim) for i in range(num_layers)]
        formats = [self.spec.format_for_layer(i, num_layers) for i in range(num_layers)]
        split = self.split_keys or self.klt_keys
        if split is not None:
            return [
                float(f.bytes_per_token(head_dim) if f.is_passthrough else split.format_bytes_per_token(i, f, head_dim))
                for i, f in enumerate(formats)
            ]
        return [float(f.bytes_per_token(head_dim)) for f in formats]

    def bytes_per_token(self, num_layers: int, head_dim: int) -> float:
        """Mean over layers of the stored bytes per token per KV head (KVFormat.bytes_per_token for ours)."""
        per_layer = self.layer_bytes(num_layers, head_dim)
        return sum(per_layer) / len(per_layer)

    def effective_bytes_per_token(self, num_layers: int, head_dim: int, context: int) -> float:
        """Bytes per token per KV head of a whole ``context``-token sequence, fp16 recent buffer included."""
        if self.spec is None:
            return float(fp16_bytes_per_token(head_dim))
        total = 0.0
        stored = self.layer_bytes(num_layers, head_dim)
        for i in range(num_layers):
            if isinstance(self.spec, SimulatedFormat):
                s = self.spec
                if s.fp16_layer(i, num_layers):
                    total += context * fp16_bytes_per_token(head_dim)
                    continue
                compressed = max(context - s.recent_tokens, 0)
                buffered = min(context, s.recent_tokens + s.flush_chunk) if s.recent_tokens else 0
                total += compressed * s.bytes_per_token(head_dim) + buffered * fp16_bytes_per_token(head_dim)
            else:
                f = self.spec.format_for_layer(i, num_layers)
                # the format's own sequence bytes, its compressed tokens at this row's size (split keys differ)
                total += f.sequence_bytes(context, head_dim) + context * (stored[i] - f.bytes_per_token(head_dim))
        return total / num_layers / context


# ---------------------------------------------------------------------------------------------- teacher forced
@dataclass
class TokenStats:
    """Running sums of per-token metrics against the reference."""

    tokens: int = 0
    nll: float = 0.0
    kl: float = 0.0
    top1: int = 0
    kl_max: float = 0.0

    def as_dict(self) -> dict:
        n = max(self.tokens, 1)
        return {
            "tokens": self.tokens,
            "nll": self.nll / n,
            "ppl": math.exp(self.nll / n),
            "kl": self.kl / n,
            "kl_max": self.kl_max,
            "top1": self.top1 / n,
        }


@torch.no_grad()
def teacher_forced(
    model, windows: torch.Tensor, variants: list[Variant], chunk: int = 64, batch: int = 8, progress: Progress = _quiet
) -> dict[str, dict]:
    """PPL / KL / top-1 of each variant vs the exact reference over token windows [N, L] fed ``chunk`` tokens at a time.

    Every variant sees exactly the same chunks as the reference, in lockstep, so no reference logits
    need to be stored. Position t predicts token t+1: N * (L-1) tokens are scored.
    """
    enable_turboquant(model)
    stats = {"reference": TokenStats(), **{v.name: TokenStats() for v in variants}}
    n_chunks = math.ceil((windows.shape[1] - 1) / chunk)
    t0 = time.time()
    for b0 in range(0, windows.shape[0], batch):
        w = windows[b0 : b0 + batch]
        inputs, targets = w[:, :-1], w[:, 1:]
        ref_cache = DynamicCache(config=model.config)
        caches = {v.name: v.make_cache(model) for v in variants}
        for c, s in enumerate(range(0, inputs.shape[1], chunk)):
            x, y = inputs[:, s : s + chunk], targets[:, s : s + chunk]
            ref_logp = torch.log_softmax(model(x, past_key_values=ref_cache).logits.float(), dim=-1)
            ref_p = ref_logp.exp()
            ref_top = ref_logp.argmax(-1)
            _accumulate(stats["reference"], ref_logp, y, ref_p, ref_logp, ref_top)
            for v in variants:
                logp = torch.log_softmax(model(x, past_key_values=caches[v.name]).logits.float(), dim=-1)
                _accumulate(stats[v.name], logp, y, ref_p, ref_logp, ref_top)
            progress(
                f"[teacher-forced] windows {b0 + 1}-{b0 + w.shape[0]}/{windows.shape[0]} chunk {c + 1}/{n_chunks} "
                f"({time.time() - t0:.0f} s)"
            )
    return {name: s.as_dict() for name, s in stats.items()}


def _accumulate(st: TokenStats, logp, targets, ref_p, ref_logp, ref_top) -> None:
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    kl = (ref_p * (ref_logp - logp)).sum(-1).clamp_min(0)
    st.tokens += targets.numel()
    st.nll += float(nll.sum())
    st.kl += float(kl.sum())
    st.kl_max = max(st.kl_max, float(kl.max()))
    st.top1 += int((logp.argmax(-1) == ref_top).sum())


# ---------------------------------------------------------------------------------------------- decoding
@torch.no_grad()
def exact_prefill(model, prompts: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """One exact forward of prompts [B, P]: per-layer (K, V) [B, H, P, D] and the last position's logits [B, V]."""
    cache = DynamicCache(config=model.config)
    logits = model(prompts, past_key_values=cache, logits_to_keep=1).logits[:, -1].float()
    layers = [cast(DynamicLayer, layer) for layer in cache.layers]  # a DynamicCache holds DynamicLayers
    # after the forward every layer is filled
    return [(cast(torch.Tensor, la.keys).clone(), cast(torch.Tensor, la.values).clone()) for la in layers], logits


def _cache_from_prefill(variant: Variant, model, kv: list[tuple[torch.Tensor, torch.Tensor]]):
    """A fresh cache of ``variant`` holding the prefill's K/V (compressed past the buffer as it would be)."""
    cache = variant.make_cache(model)
    for i, (k, v) in enumerate(kv):
        if isinstance(cache, DynamicCache):
            cache.update(k.clone(), v.clone(), i)
        else:
            cache.append(i, k, v)
    return cache


@torch.no_grad()
def greedy_steps(model, cache, first: torch.Tensor, steps: int) -> torch.Tensor:
    """The real decode loop: ``steps`` greedy tokens one at a time from a filled cache -> [B, steps], token 0 =
    ``first``."""
    out = torch.empty(first.shape[0], steps, dtype=torch.long)
    out[:, 0] = nxt = first
    for i in range(1, steps):
        nxt = model(nxt.unsqueeze(1), past_key_values=cache).logits[:, -1].argmax(-1)
        out[:, i] = nxt
    return out


@torch.no_grad()
def generation(
    model,
    prompts: torch.Tensor,
    variants: list[Variant],
    new_tokens: int = 256,
    chunk: int = 16,
    free_running: tuple[str, ...] = (),
    progress: Progress = _quiet,
) -> dict[str, dict]:
    """Greedy agreement of each variant with the reference over ``new_tokens`` generated tokens per prompt [B, P].

    After one exact prefill (shared by all, as a single-chunk prefill is exact) the reference decodes
    ``new_tokens + 1`` greedy tokens; its first token comes from the prefill and is shared, the
    ``new_tokens`` after it are scored:
    - ``greedy_agreement``: each variant is fed the reference's tokens (``chunk`` at a time, each chunk
      stored into the compressed cache after it is attended) and we count how often its argmax is
      the reference's next token;
    - for variants named in ``free_running``, also the real decode loop (one token per step, own
      tokens): ``exact_match`` (position-wise) and ``first_divergence`` (mean index, ``new_tokens`` if none).
    """
    enable_turboquant(model)
    b = prompts.shape[0]
    t0 = time.time()
    kv, logits = exact_prefill(model, prompts)
    first = logits.argmax(-1)
    ref = greedy_steps(model, _cache_from_prefill(Variant("reference", "", None), model, kv), first, new_tokens + 1)
    progress(f"[generation] reference: {b} x {new_tokens} tokens ({time.time() - t0:.0f} s)")
    results = {
        "reference": {
            "greedy_agreement": 1.0,
            "tokens": b * new_tokens,
            "exact_match": 1.0,
            "first_divergence": float(new_tokens),
            "identical_sequences": b,
            "reference_tokens": ref.tolist(),
        }
    }
    for v in variants:
        cache = _cache_from_prefill(v, model, kv)
        match = 0
        for s in range(0, new_tokens, chunk):
            x = ref[:, s : min(s + chunk, new_tokens)]
            pred = model(x, past_key_values=cache).logits.argmax(-1)
            match += int((pred == ref[:, s + 1 : s + 1 + x.shape[1]]).sum())
        row: dict[str, object] = {"greedy_agreement": match / (b * new_tokens), "tokens": b * new_tokens}
        if v.name in free_running:
            got = greedy_steps(model, _cache_from_prefill(v, model, kv), first, new_tokens + 1)
            same = got[:, 1:] == ref[:, 1:]
            diverged = (~same).float().argmax(-1)
            first_div = torch.where(same.all(-1), torch.full_like(diverged, new_tokens), diverged)
            row.update(
                exact_match=float(same.float().mean()),
                first_divergence=float(first_div.float().mean()),
                identical_sequences=int(same.all(-1).sum()),
            )
        results[v.name] = row
        progress(f"[generation] {v.name}: agreement {row['greedy_agreement']:.3f} ({time.time() - t0:.0f} s)")
    return results


# ---------------------------------------------------------------------------------------------- needle
NEEDLE_HEAD = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n\n"
)
NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
NEEDLE_TAIL = "\n\nWhat is the pass key? The pass key is"


@dataclass
class NeedleCase:
    """One pass-key prompt: total length, needle depth (0..1), the key, and the token ids."""

    length: int
    depth: float
    key: str
    ids: torch.Tensor = field(repr=False)


def needle_cases(
    tok, filler_ids: torch.Tensor, lengths: list[int], depths: list[float], seed: int = 0
) -> list[NeedleCase]:
    """Prompts of exactly ``length`` tokens: head + essay filler with the needle at ``depth`` + question."""
    rng = random.Random(seed)
    head = tok(NEEDLE_HEAD).input_ids
    tail = tok(NEEDLE_TAIL).input_ids
    cases = []
    for length in lengths:
        for j, depth in enumerate(depths):
            key = str(rng.randint(10000, 99999))
            needle = tok(NEEDLE.format(key=key)).input_ids
            n_fill = length - len(head) - len(needle) - len(tail)
            start = (j * 7919) % max(filler_ids.numel() - n_fill, 1)
            fill = filler_ids[start : start + n_fill].tolist()
            at = int(depth * n_fill)
            ids = head + fill[:at] + needle + fill[at:] + tail
            cases.append(NeedleCase(length, depth, key, torch.tensor(ids)))
    return cases


@torch.no_grad()
def needle(
    model, tok, cases: list[NeedleCase], variants: list[Variant], answer_tokens: int = 8, progress: Progress = _quiet
) -> dict[str, dict]:
    """Pass-key retrieval per length: the answer is decoded greedily from each variant's cache after an exact
    prefill."""
    enable_turboquant(model)
    by_len: dict[int, list[NeedleCase]] = {}
    for c in cases:
        by_len.setdefault(c.length, []).append(c)
    results: dict[str, dict] = {"reference": {}, **{v.name: {} for v in variants}}
    t0 = time.time()
    for length, group in sorted(by_len.items()):
        prompts = torch.stack([c.ids for c in group])
        kv, logits = exact_prefill(model, prompts)
        first = logits.argmax(-1)
        for v in [Variant("reference", "", None)] + variants:
            out = greedy_steps(model, _cache_from_prefill(v, model, kv), first, answer_tokens)
            hits = [c.key in tok.decode(o) for c, o in zip(group, out)]
            results[v.name][str(length)] = {"found": sum(hits), "of": len(hits), "hits": hits}
        progress(
            f"[needle] {length} tokens: reference {results['reference'][str(length)]['found']}/{len(group)} "
            f"({time.time() - t0:.0f} s)"
        )
    return results


# ---------------------------------------------------------------------------------------------- text helpers
def token_windows(ids: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """``count`` disjoint windows of ``length`` consecutive tokens from a 1-D id tensor -> [count, length]."""
    if ids.numel() < count * length:
        raise ValueError(f"need {count * length} tokens for {count} windows of {length}, have {ids.numel()}")
    return ids[: count * length].reshape(count, length).clone()


def model_shape(model) -> tuple[int, int]:
    """(num_layers, head_dim) of a Llama/Qwen2 model."""
    n_layers, _, _, head_dim = model_dims(model.config)
    return n_layers, head_dim
