"""What a model name means to vLLM: 'smollm2' and 'tiny' (written offline into the cache), a shipped model name
(``configs/models/*.yaml``: its hub id), else the name itself (a directory or a hub id)."""

from __future__ import annotations

import yaml

from .smollm2 import cache_root
from .specs import MODELS_DIR

#: the tiny random Llama's directory under the cache root
TINY_DIR = "tiny_llama_6l"


def resolve_model(name: str) -> tuple[str, str]:
    """(path or hub id, dtype) for 'smollm2', 'tiny', a configs/models name, a directory or a hub id; the dtype is
    float32 for the two offline models (written in fp32) and 'auto' otherwise."""
    if name == "tiny":
        from .tiny import make_tiny_llama

        out = cache_root() / TINY_DIR
        if not (out / "model.safetensors").exists():
            make_tiny_llama(out)
        return str(out), "float32"
    if name in ("smollm2", "smollm2-135m-instruct"):
        from .smollm2 import ensure_smollm2_dir  # GGUF from PyPI -> cached fp32 safetensors dir

        return str(ensure_smollm2_dir()), "float32"
    described = MODELS_DIR / f"{name}.yaml"  # the launcher's model names (configs/models/*.yaml)
    if described.exists():
        return str(yaml.safe_load(described.read_text())["hf_id"]), "auto"
    return name, "auto"


__all__ = ["TINY_DIR", "resolve_model"]
