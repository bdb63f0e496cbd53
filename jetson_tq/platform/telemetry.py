"""Optional Jetson telemetry (power, temperatures, RAM) from jtop, read in a child process.

jtop (jetson-stats, AGPL-3.0, optional) talks to the host's jtop service over ``/run/jtop.sock``.
Importing it (>= 7.0) forces the multiprocessing start method to "fork" for the whole process, which
must never happen inside a CUDA or vLLM process; so we only try when the socket exists, and then
in a short-lived ``python -c`` child whose JSON we read back. Every failure is a note, never fatal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .detect import sysroot

JTOP_SOCKET = "run/jtop.sock"
JTOP_TIMEOUT_S = 15.0

# The child: open jtop once, take one sample, print it as JSON (non-JSON values as strings).
_CHILD = r"""
import json, sys
try:
    from jtop import jtop, JtopException
except Exception as e:
    print(json.dumps({"ok": False, "reason": "jtop not importable: %s: %s" % (type(e).__name__, e)})); sys.exit(0)
try:
    with jtop() as j:
        stats = dict(j.stats) if j.ok() else {}
except Exception as e:
    print(json.dumps({"ok": False, "reason": "jtop failed: %s: %s" % (type(e).__name__, e)})); sys.exit(0)
print(json.dumps({"ok": bool(stats), "stats": stats}, default=str))
"""


def summarize(stats: dict) -> dict:
    """Pick total power (mW), temperatures (C) and RAM use from a jtop ``stats`` sample."""
    temps = {k[5:]: v for k, v in stats.items() if k.startswith("Temp ") and isinstance(v, (int, float))}
    power = stats.get("Power TOT")
    return {
        "power_total_mw": power if isinstance(power, (int, float)) else None,
        "temperatures_c": temps,
        "ram_used_fraction": stats.get("RAM") if isinstance(stats.get("RAM"), (int, float)) else None,
    }


def jtop_snapshot(
    root: str | os.PathLike | None = None, timeout_s: float = JTOP_TIMEOUT_S, python: str | None = None
) -> dict:
    """One telemetry sample: ``{"available": bool, "reason"|"summary"+"stats": ...}``; never raises."""
    sock = Path(root if root is not None else sysroot()) / JTOP_SOCKET
    if not sock.exists():
        return {"available": False, "reason": f"/{JTOP_SOCKET} absent (jtop service not running or not mounted)"}
    try:
        out = subprocess.run(
            [python or sys.executable, "-c", _CHILD],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=dict(os.environ),
        )
        reply = json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        return {"available": False, "reason": f"jtop child failed: {type(e).__name__}: {e}"}
    if not reply.get("ok"):
        reason = reply.get("reason") or f"jtop child exit {out.returncode}: {out.stderr.strip()[-300:]}"
        return {"available": False, "reason": reason}
    return {"available": True, "summary": summarize(reply["stats"]), "stats": reply["stats"]}
