"""The product's calibration: fit a model's coded keys from its own weights and the text shipped with the package,
cache the result by model identity, and resolve the ``auto`` config with it.

Modules, in the order a calibration runs: ``text`` (the shipped text, token windows) -> ``capture`` (what each
attention layer of a transformers model sees) -> ``fit`` (the math per KV head) and ``sink`` (the calibrated
attention sink) -> ``keys`` (the driver, generic over the key mode) -> ``store`` (identity and cache entries) ->
``auto`` (``auto`` for a loaded model or a checkpoint, with the calibration-free fallback).

Layered above the integrations (which call it through ``config.resolve_auto``) and below the CLI. Importing this
package is cheap: ``install`` registers resolvers that import the rest on first use.
"""

from __future__ import annotations

from typing import Any

from ..config import register_auto_resolver


def _for_model(model: Any, **kwargs: Any) -> Any:
    from .auto import config_for_model

    return config_for_model(model, **kwargs)


def _for_checkpoint(model_dir: Any, **kwargs: Any) -> Any:
    from .auto import config_for_checkpoint

    return config_for_checkpoint(model_dir, **kwargs)


def install() -> None:
    """Make ``auto`` resolvable by the integrations (``config.resolve_auto``); idempotent."""
    register_auto_resolver("model", _for_model)
    register_auto_resolver("checkpoint", _for_checkpoint)


install()
