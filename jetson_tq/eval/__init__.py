"""Evaluation: baselines (simulated caches, vLLM's own TurboQuant in PyTorch), a fast CPU scoring path, the
fidelity harness and the SmartMix per-layer calibration. Above the integrations: it measures them, nothing
in the product imports it.

Importing this package registers the ``cpu-decoded`` history backend of the transformers integration.
"""

from . import decoded_history  # noqa: F401  (registers backend="cpu-decoded")
