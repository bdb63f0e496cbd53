"""How long ``auto`` calibration takes for a model shape: a random-weight model of a shipped shape (configs/models/,
e.g. llama-3.1-8b-instruct, qwen3-8b) built on the device, calibrated once through ``calibration.auto`` (capture,
sink, per-layer fit), with the time of each progress line. Random weights cost the same as real ones per token.

    python benchmarks/calibration_speed.py --shape llama-3.1-8b-instruct --device cuda --out $OUT/calib.json
    python benchmarks/calibration_speed.py --shape qwen2.5-0.5b-instruct --layers 2 --device cpu     # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jetson_tq.calibration.auto import calibrate_entry
from jetson_tq.models.specs import load_model_spec
from tests.calibration.families import word_tokenizer

ARCH = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def build(shape: str, layers: int | None, device: str):
    """A random model of the shipped shape (bf16 on CUDA, fp32 on the CPU), built on ``device``."""
    import transformers

    spec = load_model_spec(shape)
    cls = getattr(transformers, ARCH.get(spec.family, "LlamaConfig"))
    config = cls(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=layers or spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return model, spec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.1-8b-instruct")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (a CPU smoke run)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    t0 = time.monotonic()
    model, spec = build(args.shape, args.layers, args.device)
    built = time.monotonic() - t0
    lines: list[tuple[float, str]] = []
    start = time.monotonic()

    def progress(msg: str) -> None:
        lines.append((round(time.monotonic() - start, 2), msg))
        print(f"[{lines[-1][0]:7.2f} s] {msg}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.monotonic()
        calibrate_entry(model, word_tokenizer(), cache_dir=tmp, progress=progress)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        total = time.monotonic() - start
    result = {
        "shape": args.shape,
        "layers": model.config.num_hidden_layers,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "build_s": round(built, 2),
        "calibrate_s": round(total, 2),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if args.device.startswith("cuda") else None,
        "progress": lines,
        "torch": torch.__version__,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
