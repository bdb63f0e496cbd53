"""Evaluation: baselines (simulated caches, vLLM's own TurboQuant in PyTorch), a fast CPU scoring path, the
fidelity harness and the SmartMix per-layer calibration. Above the integrations: it measures them, nothing
in the product imports it.

The ``cpu-decoded`` history backend of the transformers integration is registered explicitly
(``decoded_history.register()``), by the lab's caches that read it and by any caller naming it.
"""
