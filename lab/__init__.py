"""The lab: evaluation harness, baselines, simulated caches, key-coding experiments, the side-by-side vLLM
comparison and the demo's reports. It imports ``jetson_tq`` and is never imported by it (tests/test_layering.py);
the wheel does not ship it."""
