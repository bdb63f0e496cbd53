"""jetson-tq: TurboQuant-compressed KV caches for LLM serving on NVIDIA Jetson and other CUDA machines.

Layers, in the order data flows (nothing lower imports anything higher; tests/test_layering.py checks it):
format -> codec -> paged (storage) -> attention.reference + kernels -> ops (the one Triton-vs-reference
choice) -> cache -> api -> integrations (vllm, transformers) -> calibration (``auto``) -> eval (baselines, fidelity
harness) -> platform -> reports -> cli.
"""

from . import calibration as _calibration  # noqa: F401  (installs the ``auto`` resolvers the integrations call)
from .api import attention_decode, attention_prefill, turboquant_scores
from .cache.compressed import CompressedKVCache
from .codec.codebook import lloyd_max_codebook, lloyd_max_mse
from .codec.kv import KVCodec
from .codec.mse import MSECode, TurboQuantMSE
from .codec.packing import pack_bits, unpack_bits
from .codec.prod import ProdCode, TurboQuantProd
from .codec.rotation import Rotation, qjl_matrix
from .codec.values import GroupCode, GroupQuantizer
from .config import TurboQuantConfig, load_config, preset_names
from .errors import (
    ConfigError,
    DeviceError,
    DTypeError,
    FormatError,
    JetsonTQError,
    ShapeError,
    UnsupportedPlatformError,
)
from .format import FP16_FORMAT, KVFormat, PagedLayout, fp16_bytes_per_token
from .version import __version__

__all__ = [
    "KVFormat",
    "PagedLayout",
    "FP16_FORMAT",
    "fp16_bytes_per_token",
    "lloyd_max_codebook",
    "lloyd_max_mse",
    "Rotation",
    "qjl_matrix",
    "pack_bits",
    "unpack_bits",
    "TurboQuantMSE",
    "TurboQuantProd",
    "GroupQuantizer",
    "MSECode",
    "ProdCode",
    "GroupCode",
    "KVCodec",
    "turboquant_scores",
    "CompressedKVCache",
    "attention_decode",
    "attention_prefill",
    "TurboQuantConfig",
    "load_config",
    "preset_names",
    "JetsonTQError",
    "FormatError",
    "ConfigError",
    "ShapeError",
    "DTypeError",
    "DeviceError",
    "UnsupportedPlatformError",
    "__version__",
]
