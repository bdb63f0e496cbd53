"""Capacity report: how many tokens fit this memory budget in fp16 vs a TurboQuant config, and what it frees.

Every byte count comes from ``jetson_tq.format`` (``KVFormat.bytes_per_token``, ``breakdown``,
``sequence_bytes``) applied layer by layer through ``TurboQuantConfig.format_for_layer``, so layers kept
in fp16 count at fp16 size. Nothing here re-derives a size. Two views:

- pool: tokens = KV budget / bytes per token summed over layers (the fp16 recent buffers left out);
- context L: whole sequences of L tokens (compressed part + each sequence's fp16 buffer) that fit,
  times L — what a server holding many long requests gets.

"Measured, not only computed": ``measure_cache`` allocates a real ``CompressedKVCache``, fills it with
N random tokens and compares the bytes torch allocated (tensor storage; on CUDA also the allocator's
``memory_allocated`` delta) with the formula.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from ..cache.compressed import CompressedKVCache
from ..codec.klt import spread_transform
from ..config import TurboQuantConfig
from ..format import FP16_FORMAT, KVFormat
from ..models.specs import ModelSpec
from ..validate import check_allocatable

#: Field name -> report category (unknown future fields land in "other").
CATEGORIES = {
    "key_idx": "indices",
    "val_codes": "indices",
    "val_idx": "indices",
    "key_signs": "signs",
    "key_norm": "norms",
    "key_rnorm": "norms",
    "val_norm": "norms",
    "val_scale": "scales",
    "val_zero": "scales",
    "key_raw": "fp16",
    "val_raw": "fp16",
}
CATEGORY_ORDER = ("indices", "signs", "norms", "scales", "fp16", "other")
GB = 1e9
#: Measured vs formula must agree within 1 % of the formula, or 512 B per tensor (CUDA allocator rounding).
MEASURE_REL_MARGIN = 0.01
ALLOCATOR_ROUNDING = 512


@dataclass(frozen=True)
class KVBudget:
    """Bytes left for the KV cache: available x utilization - weights - overhead."""

    available_bytes: int
    utilization: float
    weight_bytes: int
    overhead_bytes: int = 0
    source: str = "given"

    @property
    def usable_bytes(self) -> int:
        return int(self.available_bytes * self.utilization)

    @property
    def kv_bytes(self) -> int:
        return self.usable_bytes - self.weight_bytes - self.overhead_bytes

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "available_bytes": self.available_bytes,
            "utilization": self.utilization,
            "usable_bytes": self.usable_bytes,
            "weight_bytes": self.weight_bytes,
            "overhead_bytes": self.overhead_bytes,
            "kv_bytes": self.kv_bytes,
        }


def layer_formats(config: TurboQuantConfig, model: ModelSpec) -> list[KVFormat]:
    """The format of each layer of ``model`` under ``config`` (ConfigError if one does not fit)."""
    config.check_model(model.num_layers, model.head_dim)
    return [config.format_for_layer(i, model.num_layers) for i in range(model.num_layers)]


def bytes_per_token(formats: list[KVFormat], model: ModelSpec) -> int:
    """Compressed bytes of one token across all layers and KV heads (recent buffers not counted)."""
    return sum(f.bytes_per_token(model.head_dim) for f in formats) * model.num_kv_heads


def sequence_bytes(formats: list[KVFormat], model: ModelSpec, tokens: int, element_bytes: int = 2) -> int:
    """Bytes one sequence of ``tokens`` tokens takes across all layers and KV heads, buffers included."""
    return sum(f.sequence_bytes(tokens, model.head_dim, element_bytes) for f in formats) * model.num_kv_heads


def buffer_bytes(formats: list[KVFormat], model: ModelSpec, tokens: int, element_bytes: int = 2) -> int:
    """The exact recent-ring share of ``sequence_bytes`` for one sequence of ``tokens`` tokens."""
    d = model.head_dim
    compressed = sum(tokens * f.bytes_per_token(d) for f in formats) * model.num_kv_heads
    return sequence_bytes(formats, model, tokens, element_bytes) - compressed


def breakdown(formats: list[KVFormat], model: ModelSpec) -> dict[str, int]:
    """Bytes per token (all layers, all KV heads) by category: indices, signs, norms, scales, fp16."""
    out: Counter[str] = Counter()
    for f in formats:
        for name, nbytes in f.breakdown(model.head_dim).items():
            out[CATEGORIES.get(name, "other")] += nbytes * model.num_kv_heads
    return {c: out[c] for c in CATEGORY_ORDER if out[c]}


def layer_groups(formats: list[KVFormat], model: ModelSpec) -> list[dict]:
    """Runs of consecutive layers sharing a format, with bytes per token per layer (all KV heads)."""
    groups: list[dict] = []
    for i, f in enumerate(formats):
        if groups and groups[-1]["format"] == f:
            groups[-1]["layers"][1] = i
            continue
        groups.append({"layers": [i, i], "format": f})
    return [
        {
            "layers": g["layers"],
            "format": g["format"].to_dict(),
            "value_group": g["format"].value_group_for(model.head_dim) if g["format"].value_mode == "group" else None,
            "bytes_per_token_per_layer": g["format"].bytes_per_token(model.head_dim) * model.num_kv_heads,
            "breakdown_per_layer": {
                k: v * model.num_kv_heads for k, v in g["format"].breakdown(model.head_dim).items()
            },
        }
        for g in groups
    ]


def _fit(kv_bytes: int, per_unit: int) -> int:
    return max(kv_bytes, 0) // per_unit if per_unit > 0 else 0


def capacity_report(
    model: ModelSpec, config: TurboQuantConfig, budget: KVBudget, context_tokens: int, element_bytes: int = 2
) -> dict:
    """fp16 vs ``config`` for ``model`` under ``budget``: bytes, tokens that fit, multiplier, memory freed."""
    tq = layer_formats(config, model)
    fp16 = [FP16_FORMAT] * model.num_layers
    kv = budget.kv_bytes
    rows: dict[str, dict[str, Any]] = {}
    for label, formats in (("fp16", fp16), ("turboquant", tq)):
        per_tok = bytes_per_token(formats, model)
        per_seq = sequence_bytes(formats, model, context_tokens, element_bytes)
        seqs = _fit(kv, per_seq)
        rows[label] = {
            "bytes_per_token": per_tok,
            "breakdown_per_token": breakdown(formats, model),
            "pool_tokens": _fit(kv, per_tok),
            "sequence_bytes": per_seq,
            "buffer_bytes_per_sequence": buffer_bytes(formats, model, context_tokens, element_bytes),
            "sequences_at_context": seqs,
            "tokens_at_context": seqs * context_tokens,
        }
    f, t = rows["fp16"], rows["turboquant"]
    freed_per_seq = f["sequence_bytes"] - t["sequence_bytes"]
    return {
        "model": model.to_dict(),
        "config": config.name,
        "context_tokens": context_tokens,
        "element_bytes": element_bytes,
        "budget": budget.to_dict(),
        "fits": kv > 0,
        "layers": layer_groups(tq, model),
        "fp16": f,
        "turboquant": t,
        "multiplier_pool": t["pool_tokens"] / f["pool_tokens"]
        if f["pool_tokens"]
        else f["bytes_per_token"] / t["bytes_per_token"],
        "multiplier_at_context": (
            t["tokens_at_context"] / f["tokens_at_context"]
            if f["tokens_at_context"]
            else f["sequence_bytes"] / t["sequence_bytes"]
        ),
        "freed_bytes_per_sequence": freed_per_seq,
        "freed_bytes_at_fp16_capacity": freed_per_seq * f["sequences_at_context"],
        "freed_fraction": freed_per_seq / f["sequence_bytes"],
    }


def memory_curve(
    formats: list[KVFormat], model: ModelSpec, token_counts: list[int], element_bytes: int = 2
) -> list[int]:
    """KV bytes of one sequence at each token count (for the tokens-vs-memory plot)."""
    return [sequence_bytes(formats, model, n, element_bytes) for n in token_counts]


# ------------------------------------------------------------------------------ measured
def measure_cache(
    fmt: KVFormat,
    num_kv_heads: int,
    head_dim: int,
    tokens: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
) -> dict:
    """Allocate a real CompressedKVCache for one sequence of ``tokens`` tokens and compare its bytes with the formula.

    ``tokens`` is raised to the format's ring size (the ring is allocated whole). The cache is
    pre-sized (``initial_capacity``) so geometric growth does not count; its pages hold whole blocks of
    ``block_size`` tokens, so up to block_size - 1 tokens of slack per sequence show up as a difference
    (none when tokens is a multiple of the block size). ``storage_bytes`` is what torch
    allocated for the cache's tensors, ``allocator_bytes`` the CUDA allocator's growth (None on CPU), which
    also holds the cache's own device constants (its rotation matrix: 64 KB at D=128).
    """
    device = torch.device(device)
    tokens = max(tokens, fmt.recent_tokens)
    element_bytes = torch.empty((), dtype=dtype).element_size()
    formula = fmt.sequence_bytes(tokens, head_dim, element_bytes) * num_kv_heads
    inputs = 2 * num_kv_heads * tokens * head_dim * (4 + element_bytes)  # float32 randn K/V and their device copies
    check_allocatable(
        f"measuring a cache of {tokens:,} tokens ({num_kv_heads} KV heads, head_dim {head_dim}): random "
        f"K/V {human_bytes(inputs)} + the cache {human_bytes(formula)}",
        inputs + formula,
        device,
    )
    g = torch.Generator(device="cpu").manual_seed(seed)
    k = torch.randn(num_kv_heads, tokens, head_dim, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(num_kv_heads, tokens, head_dim, generator=g).to(device=device, dtype=dtype)
    cuda = device.type == "cuda"
    # klt keys: sizes do not depend on the calibration, so an uncalibrated transform measures them
    transform = spread_transform(num_kv_heads, head_dim, fmt.key_code_bits(head_dim)) if fmt.key_mode == "klt" else None
    if cuda:
        # Warm-up: the first matmul on a stream makes cuBLAS take its workspace (32 MiB by default) from torch's
        # allocator, and the QJL matrix is cached per process; a throwaway cache keeps both out of the figure.
        warm = CompressedKVCache(
            fmt, num_kv_heads, head_dim, 1, device=device, dtype=dtype, seed=seed, key_transform=transform
        )
        warm.append(k[:, : fmt.recent_tokens], v[:, : fmt.recent_tokens], seq=0)
        del warm
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
    cache = CompressedKVCache(
        fmt,
        num_kv_heads,
        head_dim,
        1,
        device=device,
        dtype=dtype,
        seed=seed,
        initial_capacity=tokens,
        key_transform=transform,
    )
    cache.append(k, v, seq=0)
    allocator = None
    if cuda:
        torch.cuda.synchronize(device)
        allocator = torch.cuda.memory_allocated(device) - before
    tensors = 3  # the page storage and the two rings
    storage = cache.nbytes()
    margin = max(math.ceil(MEASURE_REL_MARGIN * formula), ALLOCATOR_ROUNDING * tensors)
    measured = [storage] + ([allocator] if allocator is not None else [])
    return {
        "tokens": tokens,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "compressed_tokens": int(cache.compressed_lens[0]),
        "buffered_tokens": int(cache.buffer_lens[0]),
        "formula_bytes": formula,
        "storage_bytes": storage,
        "allocator_bytes": allocator,
        "used_bytes": cache.used_bytes(),
        "margin_bytes": margin,
        "ok": all(abs(m - formula) <= margin for m in measured),
    }


def measure_model(
    config: TurboQuantConfig,
    model: ModelSpec,
    tokens: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float16,
) -> dict:
    """Measure one cache per distinct layer format and total them over the model's layers."""
    formats = layer_formats(config, model)
    counts = Counter(formats)
    per_format = []
    totals = {"formula_bytes": 0, "storage_bytes": 0, "allocator_bytes": 0}
    for fmt, n_layers in counts.items():
        m = measure_cache(fmt, model.num_kv_heads, model.head_dim, tokens, device, dtype)
        m["layers"] = n_layers
        m["format"] = fmt.to_dict()
        per_format.append(m)
        for key in totals:
            totals[key] += (m[key] or 0) * n_layers
    total_formula = totals["formula_bytes"]
    margin = sum(m["margin_bytes"] * m["layers"] for m in per_format)
    return {
        "tokens": per_format[0]["tokens"] if per_format else tokens,
        "device": str(device),
        "per_format": per_format,
        **totals,
        "allocator_bytes": totals["allocator_bytes"] if str(device).startswith("cuda") else None,
        "margin_bytes": margin,
        "rel_diff": (totals["storage_bytes"] - total_formula) / total_formula,
        "ok": all(m["ok"] for m in per_format),
    }


# ------------------------------------------------------------------------------ text
def _gb(n: float) -> str:
    return f"{n / GB:,.2f} GB"


def human_bytes(n: float) -> str:
    """Bytes in kB / MB / GB (decimal), for small and large figures alike."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def _tok(n: float) -> str:
    return f"{n / 1e6:,.2f} M" if n >= 1e6 else f"{n:,.0f}"


def format_report(rep: dict) -> str:
    """The report as a readable table."""
    m, b = rep["model"], rep["budget"]
    lines = [
        f"model {m['name']}: {m['num_layers']} layers x {m['num_kv_heads']} KV heads x D={m['head_dim']}, "
        f"weights {_gb(m['weight_bytes'])}",
        f"budget ({b['source']}): {_gb(b['available_bytes'])} x {b['utilization']:.2f} = {_gb(b['usable_bytes'])}"
        f" - weights {_gb(b['weight_bytes'])} - overhead {_gb(b['overhead_bytes'])} = KV {_gb(b['kv_bytes'])}",
    ]
    if not rep["fits"]:
        lines.append("  the weights do not fit this budget: no KV cache at all")
    lines.append(f"config {rep['config']}, layer formats:")
    for g in rep["layers"]:
        f = g["format"]
        desc = (
            "fp16 passthrough"
            if f["key_mode"] == "fp16" and f["value_mode"] == "fp16"
            else f"keys {_key_desc(f)}, values {f['value_mode']} {f['value_bits']}b"
            f"{'' if g['value_group'] is None else ' groups of ' + str(g['value_group'])}, "
            f"buffer {f['recent_tokens']}+{f['flush_chunk']}"
        )
        parts = ", ".join(f"{k} {v}" for k, v in g["breakdown_per_layer"].items())
        lines.append(
            f"  layers {g['layers'][0]}-{g['layers'][1]}: {desc}: {g['bytes_per_token_per_layer']} B/token"
            f"/layer ({parts})"
        )
    lines.append(
        f"{'':<12}{'B/token':>10}  {'indices':>8}{'signs':>7}{'norms':>7}{'scales':>7}{'fp16':>8}"
        f"  {'buffer/seq':>11}  {'pool tokens':>12}  {'seqs@ctx':>9}  {'tokens@ctx':>11}"
    )
    for label in ("fp16", "turboquant"):
        r = rep[label]
        bd = r["breakdown_per_token"]
        lines.append(
            f"{label:<12}{r['bytes_per_token']:>10,}  {bd.get('indices', 0):>8,}{bd.get('signs', 0):>7,}"
            f"{bd.get('norms', 0):>7,}{bd.get('scales', 0):>7,}{bd.get('fp16', 0):>8,}"
            f"  {human_bytes(r['buffer_bytes_per_sequence']):>11}  {_tok(r['pool_tokens']):>12}"
            f"  {r['sequences_at_context']:>9,}  {_tok(r['tokens_at_context']):>11}"
        )
    lines.append(
        f"multiplier: x{rep['multiplier_pool']:.2f} tokens (pool), x{rep['multiplier_at_context']:.2f} at "
        f"context {rep['context_tokens']:,} (buffers included)"
    )
    lines.append(
        f"memory freed at equal context ({rep['context_tokens']:,} tokens): "
        f"{human_bytes(rep['freed_bytes_per_sequence'])} per sequence ({100 * rep['freed_fraction']:.1f} %), "
        f"{_gb(rep['freed_bytes_at_fp16_capacity'])} at the fp16 capacity "
        f"({rep['fp16']['sequences_at_context']:,} sequences)"
    )
    return "\n".join(lines)


def format_measurement(meas: dict) -> str:
    """Formula vs measured bytes, per distinct layer format and in total."""
    lines = [
        f"measured: a real CompressedKVCache per distinct layer format, {meas['tokens']:,} tokens on {meas['device']}"
    ]
    for m in meas["per_format"]:
        f = m["format"]
        name = (
            "fp16"
            if f["key_mode"] == "fp16" and f["value_mode"] == "fp16"
            else f"{_key_desc(f, short=True)}/{f['value_mode']}{f['value_bits']}"
        )
        alloc = "" if m["allocator_bytes"] is None else f", allocator {m['allocator_bytes']:,}"
        lines.append(
            f"  {name:<14} x{m['layers']:>3} layers: formula {m['formula_bytes']:,} B, storage "
            f"{m['storage_bytes']:,} B{alloc} (margin {m['margin_bytes']:,} B) "
            f"{'ok' if m['ok'] else 'MISMATCH'}"
        )
    lines.append(
        f"  total: formula {meas['formula_bytes']:,} B vs measured {meas['storage_bytes']:,} B "
        f"({100 * meas['rel_diff']:+.3f} %)"
    )
    return "\n".join(lines)


def _key_desc(f: dict, short: bool = False) -> str:
    """A format dict's keys in words: mode and bits, or a klt code's bytes at head dim 128."""
    if f["key_mode"] == "klt":
        return f"klt{f['key_code_bytes']}B" if short else f"klt {f['key_code_bytes']} B at D=128"
    return f"{f['key_mode']}{f['key_bits']}" if short else f"{f['key_mode']} {f['key_bits']}b"
