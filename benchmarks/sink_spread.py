"""How constant SmolLM2's attention sink is: position 0's key and value per layer over many different first tokens.

    python benchmarks/sink_spread.py [--tokens 100] [--tolerance 0.02] [--json out.json]

First tokens: ``--tokens`` drawn from each held-out text (essays, Opticks) plus the tokenizer's special tokens; the
typical norm: positions 1-511 of the essays. CPU, ~1 min (benchmarks/NOTES.md, "the sink as a per-layer constant").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from jetson_tq.calibration.sink import sink_spread
from jetson_tq.models.smollm2 import load_smollm2
from jetson_tq.models.text import text_by_name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100, help="first tokens drawn from each text (default 100)")
    ap.add_argument("--tolerance", type=float, default=0.02, help="spread a constant layer stays within (0.02)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the per-layer spreads here")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.tolerance <= 0:
        ap.error("--tokens must be >= 1 and --tolerance > 0")
    model, tok = load_smollm2()
    g = torch.Generator().manual_seed(args.seed)
    firsts = []
    for name in ("essays", "opticks"):
        ids = tok(text_by_name(name), return_tensors="pt").input_ids[0][:20000]
        firsts.append(ids[torch.randint(0, ids.numel(), (args.tokens,), generator=g)])
    firsts.append(torch.tensor(sorted(set(tok.all_special_ids))))
    window = tok(text_by_name("essays"), return_tensors="pt").input_ids[0][:512]
    spread = sink_spread(model, torch.cat(firsts), window)
    print(
        f"position 0 over {sum(f.numel() for f in firsts)} first tokens; spread = worst distance from the mean / "
        "typical norm, per KV head\n"
    )
    print("| layer | key spread | value spread | constant |\n|---|---|---|---|")
    constant = set(spread.constant_layers(args.tolerance))
    for i in range(spread.key.shape[0]):
        ks = " / ".join(f"{x:.3f}" for x in spread.key_spread[i].tolist())
        vs = " / ".join(f"{x:.3f}" for x in spread.value_spread[i].tolist())
        print(f"| {i} | {ks} | {vs} | {'yes' if i in constant else ''} |")
    print(f"\nconstant within {args.tolerance:g}: layers {sorted(constant)}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "key_spread": spread.key_spread.tolist(),
                    "value_spread": spread.value_spread.tolist(),
                    "constant_layers": sorted(constant),
                    "tolerance": args.tolerance,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
