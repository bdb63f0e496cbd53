"""How constant a model's attention sink is (the product's ``jetson_tq.calibration.sink``, named here for the lab's
scripts and tests)."""

from __future__ import annotations

from ..calibration.sink import SINK_TOLERANCE, SinkSpread, sink_first_tokens, sink_spread

__all__ = ["SINK_TOLERANCE", "SinkSpread", "sink_first_tokens", "sink_spread"]
