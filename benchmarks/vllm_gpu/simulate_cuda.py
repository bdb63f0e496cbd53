"""Run vLLM 0.26's CUDA-only import and model-build paths on a CPU machine, to find failures before GPU time.

    PYTHONPATH=.:SITE python benchmarks/vllm_gpu/simulate_cuda.py MODEL CONFIG [CONFIG ...]

SITE holds the unpacked bundle (vllm-core.tar.gz plus cp-matching dependency wheels) and a CPU
torch is installed. vLLM's ``CudaPlatform`` is forced and the ``torch.cuda`` queries it makes are
answered as an H200 would (capability 9.0, 141 GiB), then for each CONFIG (``stock``, a jetson-tq
preset, or a vLLM ``turboquant_*`` KV dtype) the engine config is created with the run scripts'
settings and the model's layers are built on CPU (narrow hidden size, real layer count, KV heads
and head_dim 128). Prints one ``SPECROW`` JSON line per config: model runner (V1/V2), attention
implementations, and vLLM's own KV bytes per token over all layers (the denominator of its
capacity). This is how the V2-runner default, the ``SiluAndMul`` op lookup and the built-in
TurboQuant's FlashAttention boundary layers were found (docs/vllm.md). Nothing runs on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def fake_h200() -> None:
    """Answer torch.cuda's device queries as an H200 would and force vLLM's CUDA platform."""
    import torch

    class Props:
        total_memory, name, multi_processor_count, major, minor = 141 * 2**30, "NVIDIA H200", 132, 9, 0
        shared_memory_per_block_optin = 232448

    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
    torch.cuda.mem_get_info = lambda *a: (140 * 2**30, 141 * 2**30)
    torch.cuda.get_device_properties = lambda *a: Props()
    import vllm.config.vllm as vllm_config_module
    import vllm.platforms as platforms
    from vllm.platforms import cuda

    platforms._current_platform = cuda.NonNvmlCudaPlatform()
    vllm_config_module.HAS_TRITON = True  # as on the GPU (CPU torch disables Triton)


def spec_row(model: str, which: str, port: int) -> dict:
    """Build ``model`` (narrow) under ``which`` and return vLLM's KV facts for it."""
    os.environ.pop("JETSON_TQ_CONFIG", None)
    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)  # vLLM's own choice (the plugin pins V1 for itself)
    if which not in ("stock",) and not which.startswith("turboquant"):
        os.environ["JETSON_TQ_CONFIG"] = which
    fake_h200()
    import torch
    from models import CONFIGS
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import get_model_architecture

    base = CONFIGS[model]
    kv = base["num_key_value_heads"]
    narrow = dict(
        base, hidden_size=2 * kv * 128, num_attention_heads=2 * kv, head_dim=128, intermediate_size=256, vocab_size=1000
    )
    d = Path(os.environ.get("JTQ_MODELS", "/tmp/jtq_models")) / f"{model}-narrow"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(narrow))
    extra = (
        {"attention_config": {"backend": "TRITON_ATTN"}}
        if which == "stock"
        else ({"kv_cache_dtype": which} if which.startswith("turboquant") else {})
    )
    cfg = EngineArgs(
        model=str(d),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=4096,
        gpu_memory_utilization=0.25,
        max_num_seqs=8,
        enable_prefix_caching=False,
        compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "custom_ops": ["none"]},
        ir_op_priority={"rms_norm": ["native"], "fused_add_rms_norm": ["native"]},
        **extra,
    ).create_engine_config()
    cfg.kernel_config.ir_op_priority.set_default()
    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0, backend="gloo"
        )
        initialize_model_parallel(1, 1)
        torch.set_default_dtype(torch.bfloat16)
        cls, _ = get_model_architecture(cfg.model_config)
        net = cls(vllm_config=cfg, prefix="")
        attn = [m for m in net.modules() if type(m).__name__ == "Attention"]
        specs = [a.get_kv_cache_spec(cfg) for a in attn]
    return {
        "model": model,
        "config": which,
        "runner": "V2" if cfg.use_v2_model_runner else "V1",
        "backend": str(cfg.attention_config.backend),
        "layers": len(attn),
        "kv_heads": kv,
        "block_size": specs[0].block_size,
        "impls": sorted({type(a.impl).__name__ for a in attn}),
        "kv_bytes_per_token": sum(s.page_size_bytes for s in specs) / specs[0].block_size,
    }


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--one":  # child: one config per process (vLLM state is global)
        model, which = sys.argv[2], sys.argv[3]
        print("SPECROW " + json.dumps(spec_row(model, which, 29500 + os.getpid() % 400)), flush=True)
        return
    model, configs = sys.argv[1], sys.argv[2:]
    for which in configs:
        res = subprocess.run([sys.executable, __file__, "--one", model, which], capture_output=True, text=True)
        rows = [line for line in res.stdout.splitlines() if line.startswith("SPECROW ")]
        print(
            rows[0]
            if rows
            else "FAILED "
            + json.dumps({"model": model, "config": which, "error": res.stderr.strip().splitlines()[-1:]}),
            flush=True,
        )


if __name__ == "__main__":
    main()
