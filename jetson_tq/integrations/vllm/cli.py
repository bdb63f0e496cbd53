"""Entry of ``python -m jetson_tq vllm`` / ``./run_jetson.sh vllm`` (the launcher imports this module)."""

from __future__ import annotations

from .compare import main

__all__ = ["main"]
