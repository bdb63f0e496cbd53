"""``python -m jetson_tq platform``: what this machine is, its memory budget, its image, and jtop telemetry."""

from __future__ import annotations

import argparse
import json

from ..platform import container_target, jtop_snapshot, memory_budget, probe


def platform_report() -> dict:
    """Probe + memory budget + container choice + jtop snapshot, as one JSON-able dict."""
    info = probe()
    return {
        "platform": info.to_dict(),
        "memory": memory_budget(info).to_dict(),
        "container": container_target(info).to_dict(),
        "jtop": jtop_snapshot(),
    }


def format_platform(rep: dict) -> str:
    """A few readable lines."""
    p, m, c, j = rep["platform"], rep["memory"], rep["container"], rep["jtop"]

    def gb(n: int | None) -> str:
        return "?" if n is None else f"{n / 1e9:.2f} GB"

    lines = [
        f"platform: {p['kind']} ({p['arch']})" + (f", board {p['board']}" if p["board"] else ""),
        f"  L4T {p['l4t'] or '-'}, JetPack {p['jetpack'] or '-'}, GPU {p['gpu_name'] or '-'}"
        f" (sm {p['compute_capability'] or '-'}, {'integrated' if p['integrated'] else 'discrete/none'}),"
        f" torch {p['torch_version'] or '-'} CUDA {'yes' if p['cuda_available'] else 'no'}"
        + (", in a container" if p["in_container"] else ""),
        f"  memory budget: {gb(m['available_bytes'])} available of {gb(m['total_bytes'])} ({m['source']}: {m['note']})",
        f"  container: {c['image'] or 'none (local .venv)'}"
        + (f" {' '.join(c['gpu_flags'])}" if c["gpu_flags"] else "")
        + f"; {c['reason']}",
        "  jtop: " + (json.dumps(j["summary"]) if j["available"] else j["reason"]),
    ]
    lines += [f"  probe note: {e}" for e in p["errors"]]
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    rep = platform_report()
    print(json.dumps(rep, indent=2, default=str) if args.json else format_platform(rep))
    return 0


def register(sub) -> None:
    p = sub.add_parser("platform", help="probe this machine (Jetson/GPU/CPU), memory budget, image, telemetry")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_run)
