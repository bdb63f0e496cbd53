"""Decode time on Jetson AGX Thor / Orin, projected (not measured) from H100 timings, byte counts and SM clocks.

    python -m benchmarks jetson-projection [--read-bw GB/s] [--h100-read-bw GB/s] [--mem-util 0.8] [--json out.json]

For each decode shape of ``benchmarks/targets.py`` (``QUICK_DECODE``) and each KV format (fp16/bf16 flash, FP8 KV,
our ``mse_k4v3`` and ``kl52_smollm2``) the projected time is the larger of two bounds:

- **bandwidth floor**: bytes the step reads / the device's read bandwidth. Bytes per token come from
  ``jetson_tq.format`` (``KVFormat.sequence_bytes``: the compressed tokens plus the exact fp16 window;
  ``fp16_bytes_per_token`` for flash; FP8 = one byte per element, half of fp16);
- **issue bound**: a measured H100 time scaled by SM count x clock (H100 SXM: 132 SMs at 1.98 GHz boost), i.e.
  the same work per SM-clock. Only formats with an H100 measurement have one; the others print the floor alone.

Every table this prints says "projection, not a measurement". What would make it wrong: a Jetson SM issuing at
another rate per clock than an H100 SM (sm_110 / sm_87 vs sm_90), a clock other than the one assumed (a range is
printed), a read bandwidth other than the one given, and kernels tuned for 132 SMs splitting work badly on 16-20.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from targets import QUICK_DECODE

from jetson_tq.config import load_config
from jetson_tq.format import FP16_FORMAT, KVFormat, fp16_bytes_per_token
from jetson_tq.models.specs import ModelSpec, load_model_spec
from jetson_tq.reports.capacity import KVBudget, bytes_per_token, layer_formats

LABEL = "projection, not a measurement"
GIB = 1 << 30
HEAD_DIM = 128  # targets.py's decode rows are D=128
FP8_ELEMENT_BYTES, FP16_ELEMENT_BYTES = 1, 2  # e4m3 KV: one byte per element; vLLM's per-tensor scales not counted


@dataclass(frozen=True)
class Device:
    """What the projection needs of a GPU: SMs, clock (nominal and the low end of its uncertainty), read bandwidth."""

    name: str
    sms: int
    clock_ghz: float
    clock_low_ghz: float
    read_gbs: float  # read bandwidth the floor divides by
    spec_gbs: float
    fp8: bool
    memory_gib: int

    def sm_ghz(self, low: bool = False) -> float:
        """SM count x clock in GHz (SM-clocks per ns)."""
        return self.sms * (self.clock_low_ghz if low else self.clock_ghz)


#: H100 SXM: 132 SMs, 1.98 GHz boost. read_gbs: the copy benchmark's ~3.0 TB/s taken as the read rate (a copy
#: counts read + write bytes, so halving it would understate reads); no read-only measurement yet (``--h100-read-bw``).
H100 = Device("H100 SXM", 132, 1.98, 1.98, 3000.0, 3350.0, True, 80)
#: AGX Thor: 20 SMs (what the CUDA driver reports on the dev kit); ~257 GB/s read measured by others, 273 GB/s spec.
#: Clock 1.575 GHz assumed (not confirmed by a public source we could read); 1.0 GHz taken as the low end.
THOR = Device("AGX Thor (sm_110)", 20, 1.575, 1.0, 257.0, 273.0, True, 64)
#: AGX Orin 64GB: 16 SMs at 1.3 GHz, 204.8 GB/s spec, ~153 GB/s read measured by others, no FP8 tensor cores.
#: Low end 0.93 GHz (the 32 GB module's GPU clock as we recall it, unverified; it also has fewer SMs).
ORIN = Device("AGX Orin (sm_87)", 16, 1.3, 0.93, 153.0, 204.8, False, 32)
DEVICES = (THOR, ORIN)

#: Measured on one H100, 2026-12-06, ``python -m benchmarks targets --quick`` (CUDA graphs, fp16, D=128, 32/8 heads):
#: (engine, batch, context) -> µs. "flash" is SDPA flash over fp16 K/V.
H100_US = {
    ("mse_k4v3", 8, 65536): 317.0,
    ("flash", 8, 65536): 700.0,
    ("mse_k4v3", 1, 131072): 94.9,
    ("flash", 1, 131072): 194.0,
    ("mse_k4v3", 1, 1024): 10.8,
    ("flash", 1, 1024): 13.5,
}
OUR_FORMATS = ("mse_k4v3", "kl52_smollm2")
ENGINES = ("fp16/bf16 flash", "fp8 KV", *OUR_FORMATS)


@dataclass(frozen=True)
class Shape:
    batch: int
    q_heads: int
    kv_heads: int
    context: int
    head_dim: int = HEAD_DIM

    def label(self) -> str:
        return f"{self.batch} x {tokens(self.context)}, {self.q_heads}/{self.kv_heads}, D={self.head_dim}"


def tokens(n: int) -> str:
    """A context length as the tables write it: 65536 -> 64k, 1000 -> 1000."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def target_shapes() -> list[Shape]:
    """The decode shapes of ``benchmarks/targets.py`` that the H100 figures were measured at."""
    return [Shape(b, hq, hkv, ctx) for b, hq, hkv, ctx, _ in QUICK_DECODE]


def our_format(name: str) -> KVFormat:
    """The default layer format of a preset (its bytes come from ``jetson_tq.format``)."""
    return load_config(name).default


def kv_bytes(engine: str, shape: Shape) -> int:
    """Bytes of K/V one decode step reads at ``shape`` (queries and outputs, < 0.1 %, not counted)."""
    pairs = shape.batch * shape.kv_heads
    if engine == "fp16/bf16 flash":
        return pairs * shape.context * fp16_bytes_per_token(shape.head_dim)
    if engine == "fp8 KV":
        return pairs * shape.context * fp16_bytes_per_token(shape.head_dim) * FP8_ELEMENT_BYTES // FP16_ELEMENT_BYTES
    return pairs * our_format(engine).sequence_bytes(shape.context, shape.head_dim)


def floor_us(nbytes: int, read_gbs: float) -> float:
    """Bandwidth floor: bytes / read bandwidth, in µs (GB/s = 1e3 bytes per µs)."""
    return nbytes / (read_gbs * 1e3)


def scaled_us(h100_us: float, device: Device, low_clock: bool = False, h100: Device = H100) -> float:
    """An H100 time at the same work per SM-clock on ``device``: t x (132 x 1.98) / (SMs x clock)."""
    return h100_us * h100.sm_ghz() / device.sm_ghz(low_clock)


def projected_us(floor: float, issue: float | None) -> float:
    """The projection: the larger of the bandwidth floor and the scaled issue time (the floor alone without one)."""
    return floor if issue is None else max(floor, issue)


def measured_h100(engine: str, shape: Shape) -> float | None:
    """The H100 µs this engine was measured at on this shape (fp16 flash's for flash), or None."""
    key = "flash" if engine == "fp16/bf16 flash" else engine
    return H100_US.get((key, shape.batch, shape.context))


def kernel_rows(devices: tuple[Device, ...] = DEVICES) -> list[dict]:
    """One row per (device, shape, engine): bytes, floor, issue (nominal and low clock), projection."""
    rows = []
    for dev in devices:
        for shape in target_shapes():
            for engine in ENGINES:
                if engine == "fp8 KV" and not dev.fp8:
                    continue
                nbytes = kv_bytes(engine, shape)
                floor = floor_us(nbytes, dev.read_gbs)
                h = measured_h100(engine, shape)
                issue = None if h is None else scaled_us(h, dev)
                issue_low = None if h is None else scaled_us(h, dev, low_clock=True)
                rows.append(
                    {
                        "device": dev.name,
                        "shape": shape.label(),
                        "engine": engine,
                        "bytes": nbytes,
                        "floor_us": floor,
                        "issue_us": issue,
                        "projected_us": projected_us(floor, issue),
                        "projected_low_clock_us": projected_us(floor, issue_low),
                    }
                )
    return rows


def h100_check_rows(read_gbs: float = H100.read_gbs) -> list[dict]:
    """The H100 itself: measured time vs its own floor (says which engines are bound by bytes, which by issue)."""
    rows = []
    for shape in target_shapes():
        for engine in ("fp16/bf16 flash", "mse_k4v3"):
            h = measured_h100(engine, shape)
            floor = floor_us(kv_bytes(engine, shape), read_gbs)
            rows.append({"shape": shape.label(), "engine": engine, "measured_us": h, "floor_us": floor})
    return rows


# ------------------------------------------------------------------------------ whole models
@dataclass(frozen=True)
class ModelAttention:
    """A model's decode attention: layers reading the whole context, layers reading a sliding window."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    full_layers: int
    window_layers: int = 0
    window: int = 0
    weight_bytes: int | None = None
    served_by_us: bool = True  # whether the vLLM plugin compresses its full layers today (docs/models.md)


def qwen25_7b() -> ModelAttention:
    spec: ModelSpec = load_model_spec("qwen2.5-7b-instruct")
    return ModelAttention(
        spec.name,
        spec.num_attention_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.num_layers,
        weight_bytes=spec.weight_bytes,
    )


#: gpt-oss-20b from its public config.json: 24 layers alternating sliding (128 tokens) and full attention, 64 query
#: heads, 8 KV heads, head dim 64, a learned sink per head. Its layers have attention sinks, which the plugin leaves
#: stock (docs/models.md), so "ours" on it is a what-if.
GPT_OSS_20B = ModelAttention(
    "gpt-oss-20b",
    64,
    8,
    64,
    full_layers=12,
    window_layers=12,
    window=128,
    served_by_us=False,
)


def model_rows(model: ModelAttention, batch: int, context: int, devices: tuple[Device, ...] = DEVICES) -> list[dict]:
    """Attention of one decode step over every layer (plus the weight-read floor where the weights are known).

    Full layers read ``context`` tokens in the engine's format; window layers read ``window`` tokens in bf16 (the
    plugin leaves them stock). The issue bound scales the measured H100 time of the same batch and context by the
    (KV head) pairs, D=128 only: per (token, KV head) cost assumed independent of the query heads per KV head.
    """
    full = Shape(batch, model.q_heads, model.kv_heads, context, model.head_dim)
    window = Shape(batch, model.q_heads, model.kv_heads, min(context, model.window), model.head_dim)
    ref = next((s for s in target_shapes() if (s.batch, s.context) == (batch, context)), None)
    rows = []
    for dev in devices:
        for engine in ENGINES:
            if engine == "fp8 KV" and not dev.fp8:
                continue
            floor = model.full_layers * floor_us(kv_bytes(engine, full), dev.read_gbs)
            if model.window_layers:
                floor += model.window_layers * floor_us(kv_bytes("fp16/bf16 flash", window), dev.read_gbs)
            h = measured_h100(engine, ref) if ref is not None and model.head_dim == HEAD_DIM else None
            issue = None
            if h is not None and ref is not None:
                issue = model.full_layers * scaled_us(h * model.kv_heads / ref.kv_heads, dev)
            weights = None if model.weight_bytes is None else floor_us(model.weight_bytes, dev.read_gbs)
            rows.append(
                {
                    "device": dev.name,
                    "model": model.name,
                    "batch": batch,
                    "context": context,
                    "engine": engine + (" (what-if)" if engine in OUR_FORMATS and not model.served_by_us else ""),
                    "attention_floor_us": floor,
                    "attention_issue_us": issue,
                    "attention_projected_us": projected_us(floor, issue),
                    "weights_floor_us": weights,
                }
            )
    return rows


# ------------------------------------------------------------------------------ capacity
def capacity_rows(mem_util: float, devices: tuple[Device, ...] = DEVICES) -> list[dict]:
    """Qwen2.5-7B KV tokens that fit a device's memory x ``mem_util`` minus the bf16 weights (``reports.capacity``)."""
    spec = load_model_spec("qwen2.5-7b-instruct")
    bf16 = bytes_per_token([FP16_FORMAT] * spec.num_layers, spec)
    per_token = {
        "bf16": bf16,
        "fp8": bf16 * FP8_ELEMENT_BYTES // FP16_ELEMENT_BYTES,
        "mse_k4v3": bytes_per_token(layer_formats(load_config("mse_k4v3"), spec), spec),
    }
    rows = []
    for dev in devices:
        budget = KVBudget(
            dev.memory_gib * GIB, mem_util, spec.weight_bytes, source=f"{dev.memory_gib} GiB x {mem_util}"
        )
        for name, per in per_token.items():
            if name == "fp8" and not dev.fp8:
                continue
            tokens = max(budget.kv_bytes, 0) // per
            rows.append(
                {
                    "device": dev.name,
                    "memory_gib": dev.memory_gib,
                    "kv_gb": budget.kv_bytes / 1e9,
                    "format": name,
                    "bytes_per_token": per,
                    "tokens": tokens,
                    "vs_bf16": tokens / max(max(budget.kv_bytes, 0) // bf16, 1),
                }
            )
    return rows


# ------------------------------------------------------------------------------ printing
def _us(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x / 1e3:.2f} ms" if x >= 1e3 else f"{x:.1f} µs"


def markdown(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def render(kernel: list[dict], models: list[dict], capacity: list[dict], check: list[dict]) -> str:
    """All tables as Markdown, each headed by the projection label."""
    out = [f"## Decode kernels at targets.py's shapes ({LABEL})", ""]
    out.append(
        markdown(
            [
                "device",
                "shape",
                "KV",
                "bytes read",
                "bandwidth floor",
                "issue (scaled H100)",
                "projected",
                "at low clock",
            ],
            [
                [
                    r["device"],
                    r["shape"],
                    r["engine"],
                    f"{r['bytes'] / 1e6:,.1f} MB",
                    _us(r["floor_us"]),
                    _us(r["issue_us"]),
                    _us(r["projected_us"]) + ("" if r["issue_us"] is not None else " (floor only)"),
                    _us(r["projected_low_clock_us"]),
                ]
                for r in kernel
            ],
        )
    )
    out += ["", f"## Whole model, one decode step, attention of every layer ({LABEL})", ""]
    out.append(
        markdown(
            [
                "device",
                "model",
                "batch x context",
                "KV",
                "attention floor",
                "attention issue",
                "attention projected",
                "weights read floor",
            ],
            [
                [
                    r["device"],
                    r["model"],
                    f"{r['batch']} x {tokens(r['context'])}",
                    r["engine"],
                    _us(r["attention_floor_us"]),
                    _us(r["attention_issue_us"]),
                    _us(r["attention_projected_us"]),
                    _us(r["weights_floor_us"]),
                ]
                for r in models
            ],
        )
    )
    out += ["", f"## Qwen2.5-7B KV capacity (bf16 weights; computed from jetson_tq.format, {LABEL})", ""]
    out.append(
        markdown(
            ["device", "memory", "KV budget", "KV format", "bytes/token (28 layers)", "tokens that fit", "vs bf16"],
            [
                [
                    r["device"],
                    f"{r['memory_gib']} GiB",
                    f"{r['kv_gb']:.1f} GB",
                    r["format"],
                    f"{r['bytes_per_token']:,}",
                    f"{r['tokens']:,}",
                    f"{r['vs_bf16']:.2f}x",
                ]
                for r in capacity
            ],
        )
    )
    out += ["", "## The H100 these are scaled from (measured µs vs its own floor at the assumed read bandwidth)", ""]
    out.append(
        markdown(
            ["shape", "engine", "measured", "floor"],
            [[r["shape"], r["engine"], _us(r["measured_us"]), _us(r["floor_us"])] for r in check],
        )
    )
    return "\n".join(out) + "\n"


def _positive(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _count(text: str) -> int:
    value = int(text) if text.isdigit() else 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--read-bw",
        type=_positive,
        nargs=2,
        metavar=("THOR_GBS", "ORIN_GBS"),
        help=f"read bandwidth in GB/s (default {THOR.read_gbs:g} {ORIN.read_gbs:g})",
    )
    ap.add_argument(
        "--h100-read-bw",
        type=_positive,
        default=H100.read_gbs,
        help="the H100's read GB/s for the check table (default: the ~3.0 TB/s copy figure)",
    )
    ap.add_argument("--mem-util", type=_fraction, default=0.8, help="share of memory the weights + KV may use (0.8)")
    ap.add_argument(
        "--batch-context",
        type=_count,
        nargs=2,
        action="append",
        metavar=("B", "CTX"),
        help="whole-model rows at B x CTX (default 8 65536 and 1 131072; issue bound only at a targets.py shape)",
    )
    ap.add_argument("--json", type=Path, help="also write every row here")
    args = ap.parse_args(argv)
    devices = DEVICES
    if args.read_bw:
        devices = (
            Device(**{**asdict(THOR), "read_gbs": args.read_bw[0]}),
            Device(**{**asdict(ORIN), "read_gbs": args.read_bw[1]}),
        )
    points = args.batch_context or [[8, 65536], [1, 131072]]
    kernel = kernel_rows(devices)
    models = [r for b, ctx in points for m in (qwen25_7b(), GPT_OSS_20B) for r in model_rows(m, b, ctx, devices)]
    capacity = capacity_rows(args.mem_util, devices)
    print(f"# Jetson decode: {LABEL}\n")
    print(render(kernel, models, capacity, h100_check_rows(args.h100_read_bw)))
    if args.json:
        args.json.write_text(
            json.dumps({"label": LABEL, "kernels": kernel, "models": models, "capacity": capacity}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
