"""The engine-start warm-up compiles every Triton specialization a first request and its first decode steps launch.

No engine, no GPU: the backend impl of a realistic layer is driven as vLLM's model runner drives it (full-width
block tables of ``cdiv(max_model_len, block_size)`` columns, decode rows first, chunked prefill in vLLM's token
budgets, decode batches of every CUDA-graph capture size, mixed batches with odd decode counts), with the kernels
recorded but not run (``kernels.specializations.record(launch=False)``, under Triton's interpreter on CPU). Every
key the request shapes launch must be one the warm-up launched; the failure lists the missing ones and how each
differs from the warm-up's nearest key. The decode split count sees the H200's 132 SMs, as on the GPU.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from jetson_tq.attention.extras import AttentionExtras
from jetson_tq.config import load_config
from jetson_tq.integrations.vllm.impl import TurboQuantAttentionImpl
from jetson_tq.integrations.vllm.metadata import TurboQuantMetadata, decode_arrays
from jetson_tq.integrations.vllm.settings import preferred_block_size
from jetson_tq.integrations.vllm.warmup import block_table_width, warm_up
from jetson_tq.kernels import hybrid_decode_plan, specializations

pytestmark = pytest.mark.kernel

MAX_MODEL_LEN, MAX_NUM_SEQS, PROMPT = 16384, 32, 8192
CAPTURE_SIZES = [1, 2, 4] + list(range(8, MAX_NUM_SEQS + 1, 8))  # vLLM's default list, up to max_num_seqs
BUDGETS = (2048, 8192, 16384)  # max_num_batched_tokens


class Layer:
    """One layer's impl, its (never read) pages and the batch builder vLLM's metadata builder would produce."""

    def __init__(
        self,
        preset: str,
        hq: int,
        hkv: int,
        d: int,
        dtype: torch.dtype = torch.bfloat16,
        window: int | None = None,
        name: str = "model.layers.1.self_attn.attn",
    ) -> None:
        cfg = load_config(preset)
        self.fmt = cfg.format_for_layer(1, 4)
        self.bs = preferred_block_size(16, cfg)
        self.width = -(-MAX_MODEL_LEN // self.bs)
        self.impl = TurboQuantAttentionImpl(hq, d, 1.0 / math.sqrt(d), hkv, sliding_window=window)
        self.impl.layer_name = self.layer_name = name
        self.impl.set_format(self.fmt, 1, self.bs, dtype)
        self.impl.allocate_recent(MAX_NUM_SEQS, torch.device("cpu"), dtype)
        self.pages = torch.zeros(4, hkv, self.impl.layout.page_bytes, dtype=torch.uint8)
        self.hq, self.hkv, self.d, self.dtype = hq, hkv, d, dtype

    def metadata(self, q_lens: list[int], ctx_lens: list[int]) -> TurboQuantMetadata:
        """One engine step's metadata: rows with one new token first (decodes), then prefill chunks."""
        q_arr, ctx = np.asarray(q_lens, dtype=np.int64), np.asarray(ctx_lens, dtype=np.int64)
        nd = int(np.argmin(q_arr <= 1)) if not (q_arr <= 1).all() else len(q_arr)
        n = int(q_arr.sum())
        empty32, empty64 = torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int64)
        return TurboQuantMetadata(
            num_actual_tokens=n,
            num_reqs=len(q_arr),
            num_decodes=nd,
            recent_tokens=self.fmt.recent_tokens,
            block_window=self.fmt.block_window,
            query_start_loc=np.concatenate([[0], np.cumsum(q_arr)]),
            seq_lens=ctx + q_arr,
            context_lens=ctx,
            ring_rows=np.arange(len(q_arr), dtype=np.int64),
            block_table=torch.zeros(MAX_NUM_SEQS, self.width, dtype=torch.int32)[: len(q_arr)],
            slot_mapping=torch.arange(n, dtype=torch.int64) % self.bs,
            dec_ring_rows=empty64,
            dec_ring_cols=empty64,
            dec_compressed_lens=empty32,
            dec_recent_lens=empty32,
        )

    @property
    def kv_cache(self) -> torch.Tensor:
        """The pages, as vLLM binds them to the attention layer (``warmup.bound_cache`` reads them there)."""
        return self.pages

    def step(self, q_lens: list[int], ctx_lens: list[int]) -> None:
        """One engine step: write the step's tokens (zeros) and attend, as vLLM calls the layer."""
        self.run(self.metadata(q_lens, ctx_lens))

    def run(self, md: TurboQuantMetadata) -> None:
        n = md.num_actual_tokens
        q = torch.zeros(n, self.hq, self.d, dtype=self.dtype)
        kv = torch.zeros(n, self.hkv, self.d, dtype=self.dtype)
        self.impl.do_kv_cache_update(None, kv, kv, self.pages, md.slot_mapping)
        self.impl.forward(None, q, kv, kv, self.pages, md, torch.empty_like(q))

    def verify_step(self, t: int, ctx_lens: list[int]) -> None:
        """One step of uniform speculative verification rows (``t`` tokens each over ``ctx_lens`` history tokens) as
        the builder routes it: the decode path, its device buffers from ``decode_arrays``."""
        rows = len(ctx_lens)
        md = self.metadata([t] * rows, ctx_lens)
        dec = decode_arrays(
            np.diff(md.query_start_loc), md.seq_lens, md.ring_rows, md.recent_tokens, md.block_window, t
        )
        assert (dec.rows, dec.tokens) == (rows, t)
        self.run(
            replace(
                md,
                num_decodes=rows,
                dec_ring_rows=torch.as_tensor(dec.ring_rows, dtype=torch.int64),
                dec_ring_cols=torch.zeros(rows, dtype=torch.int64),
                dec_compressed_lens=torch.as_tensor(dec.compressed, dtype=torch.int32),
                dec_recent_lens=torch.as_tensor(dec.recent, dtype=torch.int32),
                dec_query_tokens=t,
                dec_token_cols=torch.as_tensor(dec.token_cols, dtype=torch.int64),
            )
        )


def first_requests(layer: Layer, budget: int) -> None:
    """The shapes of a first request (an 8k prompt, and one of odd length) and of the first decode steps, under a
    token budget of ``budget`` (max_num_batched_tokens)."""
    for prompt in (PROMPT, PROMPT - 1, 100, 333):
        done = 0
        while done < prompt:  # chunked prefill: first chunk, chunks over compressed history, a partial last
            chunk = min(budget, prompt - done)
            layer.step([chunk], [done])
            done += chunk
    # mixed steps: decode rows of earlier requests first, then a chunk filling the rest of the token budget
    for nd in (1, 3, 7, 24, MAX_NUM_SEQS - 1):
        chunk = min(budget - nd, PROMPT)
        layer.step([1] * nd + [chunk], [PROMPT + nd] * nd + [PROMPT - chunk])
    for rows in CAPTURE_SIZES + [3, 5, 9, 13, 31]:  # decode-only batches (graph sizes), odd eager ones
        layer.step([1] * rows, [PROMPT + i for i in range(rows)])


@pytest.fixture(autouse=True)
def _h200_kernels(monkeypatch):
    """The Triton kernels on CPU tensors (interpreter), sized as on an H200 (132 SMs)."""
    monkeypatch.setenv("JETSON_TQ_BACKEND", "triton")
    monkeypatch.setattr(hybrid_decode_plan, "_num_sms", lambda device: 132)


def _klt_layer_transforms(monkeypatch, preset: str, hkv: int, d: int) -> None:
    """klt presets: every layer gets a calibrated-like transform, and steps run without vLLM's forward context (the
    write positions are then zeros: their values are no specialization)."""
    fmt = load_config(preset).default
    if fmt.key_mode != "klt":
        return
    import vllm.forward_context

    from jetson_tq.integrations.vllm import impl as impl_mod
    from tests.helpers.klt_cases import uneven_transform

    transform = uneven_transform(hkv, d, fmt.key_code_bits(d), d, 1.0, torch.Generator().manual_seed(0))
    monkeypatch.setattr(impl_mod, "layer_key_transform", lambda index: transform)
    context = type("Context", (), {"attn_metadata": None})()
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)


@pytest.mark.parametrize("preset", ["mse_k4v3", "mse_k3v3w256", "kl52_smollm2"])
@pytest.mark.parametrize("hq, hkv, d", [(28, 4, 128), (9, 3, 64)], ids=["qwen7b-d128", "smollm2-d64"])
def test_warm_up_compiles_every_specialization_a_first_request_launches(preset, hq, hkv, d, monkeypatch):
    _klt_layer_transforms(monkeypatch, preset, hkv, d)
    layer = Layer(preset, hq, hkv, d)
    problems = []
    for budget in BUDGETS:  # one engine per max_num_batched_tokens: its own warm-up
        with specializations.record(launch=False) as warm:
            warm_up(
                layer.impl,
                layer.pages,
                max_rows=MAX_NUM_SEQS,
                table_width=layer.width,
                max_len=MAX_MODEL_LEN,
                budget=budget,
            )
        with specializations.record(launch=False) as request:
            first_requests(layer, budget)
        assert request.keys, "the request shapes launched no kernel (the kernel path is not the one running)"
        missing = request.missing_from(warm.keys)
        if missing:
            problems.append(
                f"budget {budget}: {len(missing)} of {len(request.keys)} specializations the first requests launch "
                f"are not compiled by the warm-up ({len(warm.keys)} keys):\n"
                + specializations.describe_missing(missing, warm.keys)
            )
    assert not problems, "\n".join(problems)


def test_block_table_width_reads_the_runner_table_of_the_layer_block_size():
    """The warm-up's block tables are as wide as the runner's (their row stride is a kernel argument)."""
    from types import SimpleNamespace as NS

    tables = [NS(block_size=16, max_num_blocks_per_req=1024), NS(block_size=256, max_num_blocks_per_req=64)]
    runner = NS(input_batch=NS(block_table=NS(block_tables=tables)), model_config=NS(max_model_len=16000))
    assert block_table_width(runner, 256) == 64 and block_table_width(runner, 16) == 1024
    assert block_table_width(NS(model_config=NS(max_model_len=16000)), 256) == 63  # no runner table: cdiv
    # one table per KV-cache group: a layer reads its own group's table, even where another group's has its block size
    tables.insert(0, NS(block_size=256, max_num_blocks_per_req=67))  # e.g. a state group sized without alignment
    groups = [NS(layer_names=["mamba.0"]), NS(layer_names=["attn.1"]), NS(layer_names=["attn.2"])]
    runner = NS(input_batch=NS(block_table=NS(block_tables=tables)), kv_cache_config=NS(kv_cache_groups=groups))
    assert block_table_width(runner, 256, "attn.2") == 64 and block_table_width(runner, 256, "mamba.0") == 67
    assert block_table_width(runner, 16, "attn.1") == 1024 and block_table_width(runner, 256) == 67


def test_layers_differing_in_what_the_kernels_see_are_distinct_variants():
    """The warm-up runs once per ``layer_variant``: the window flag and the window's int class (Triton keys an int
    on == 1 and % 16), the soft cap and sinks flags, the head counts and the block table make another variant; a
    window or soft cap of another value in the same class does not (its launches are keyed alike)."""
    from jetson_tq.integrations.vllm.warmup import layer_variant

    def variant(hq: int = 8, width: int = 65, **extras) -> tuple:
        layer = Layer("mse_k4v3", hq, 4, 256)
        layer.impl.extras = AttentionExtras(**extras)
        return layer_variant(layer.impl, width, torch.device("cpu"))

    plain = variant()
    assert variant() == plain and variant(sliding_window=512) == variant(sliding_window=1024) != plain
    assert variant(sliding_window=1000) != variant(sliding_window=1024)
    assert variant(soft_cap=30.0) == variant(soft_cap=50.0) != plain
    assert variant(sinks=torch.zeros(8)) != plain and variant(hq=16) != plain and variant(width=66) != plain


@pytest.mark.parametrize("hq, hkv, d", [(28, 4, 128), (9, 3, 64)], ids=["qwen7b-d128", "smollm2-d64"])
def test_warm_up_compiles_the_verification_rows_of_speculative_decoding(hq, hkv, d):
    """With speculation (3 draft tokens: rows of up to 4 tokens), steps of uniform verification rows take the
    multi-token decode kernel; the warm-up compiles every specialization they launch at each batch size."""
    layer = Layer("mse_k4v3", hq, hkv, d)
    layer.impl.set_undo_tokens(4)
    layer.impl.allocate_recent(MAX_NUM_SEQS, torch.device("cpu"), layer.dtype)
    with specializations.record(launch=False) as warm:
        warm_up(layer.impl, layer.pages, max_rows=MAX_NUM_SEQS, table_width=layer.width, max_len=MAX_MODEL_LEN)
    with specializations.record(launch=False) as request:
        for t in (2, 3, 4):
            for rows in CAPTURE_SIZES + [3, 5, 13]:
                layer.verify_step(t, [PROMPT + 7 * i for i in range(rows)])
    kernels = {k.kernel for k in request.keys}
    assert any("decode" in k for k in kernels), f"verification steps launched no decode kernel: {kernels}"
    missing = request.missing_from(warm.keys)
    assert not missing, (
        f"{len(missing)} of {len(request.keys)} verification-step specializations are not compiled by the warm-up:\n"
        + specializations.describe_missing(missing, warm.keys)
    )


@pytest.mark.parametrize("drafts", [0, 3], ids=["plain", "speculative"])
def test_warm_up_compiles_a_first_step_of_several_prompts(drafts, monkeypatch):
    """Eight 2,048-token prompts in one step under a 16,384-token budget, then decode steps or, with speculation,
    verification steps and a step of one-token rows among draft rows (chunks of one token): an engine's first
    requests on an H100 compiled the dequantizer, the prefill and the query transform after the warm-up. The block
    table is 19 blocks wide (max_model_len 2,368), so the rows of requests past the first are not 16-byte aligned."""
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "MAX_MODEL_LEN", 2368)
    monkeypatch.setattr(module, "MAX_NUM_SEQS", 8)
    layer = Layer("mse_k4v3", 28, 4, 128)
    assert layer.width % 4, "the case needs a block table whose rows are not all 16-byte aligned"
    if drafts:
        layer.impl.set_undo_tokens(1 + drafts)
        layer.impl.allocate_recent(8, torch.device("cpu"), layer.dtype)
    with specializations.record(launch=False) as warm:
        warm_up(layer.impl, layer.pages, max_rows=8, table_width=layer.width, max_len=2368, budget=16384)
    with specializations.record(launch=False) as request:
        layer.step([2048] * 8, [0] * 8)
        for i in range(3):
            if drafts:
                layer.verify_step(1 + drafts, [2048 + 4 * i] * 8)
                layer.step([4, 4, 1, 4, 3, 4, 1, 2], [2100 + i] * 8)
            else:
                layer.step([1] * 8, [2048 + i] * 8)
    missing = request.missing_from(warm.keys)
    assert not missing, (
        f"{len(missing)} of {len(request.keys)} specializations of the first steps are not compiled by the warm-up:\n"
        + specializations.describe_missing(missing, warm.keys)
    )


@pytest.mark.parametrize("hq", [28, 9, 32])
def test_warm_up_lengths_reach_the_long_chunks_the_triton_loop_keeps(hq):
    """Where FlashAttention serves rows from ``flash_from`` tokens on, the longest chunks left to the Triton loop are
    shorter than the budget: eight 8k prompts under a 16k budget on an H100 compiled the loop's long-chunk query
    transform while serving (0.67 s in the first request's TTFT), since the warm-up's long chunks had all gone to
    FlashAttention. Every chunk length the loop serves must share its int classes (T == 1, T % 16, T * heads % 16) and
    its tile size (T * heads from ``PREFILL_ROWS`` on) with a warm-up length the loop also serves."""
    from jetson_tq.integrations.vllm.warmup import warm_up_lengths
    from jetson_tq.kernels.query_transform import PREFILL_ROWS

    def kind(t: int) -> tuple:
        return t == 1, t % 16 == 0, (t * hq) % 16 == 0, t * hq >= PREFILL_ROWS

    for budget, flash_from in ((16384, 8192 - 256), (16384, None), (2048, 1024), (8192, 8192)):
        loop_max = budget if flash_from is None else min(budget, flash_from - 1)
        warm = {kind(t) for t in warm_up_lengths(hq, budget, flash_from) if t <= loop_max}
        missing = {kind(t) for t in range(2, loop_max + 1)} - warm
        assert not missing, f"budget {budget}, FlashAttention from {flash_from}: no warm-up chunk of kind {missing}"


def first_steps(prompts: int, prompt: int, budget: int) -> list[tuple[list[int], list[int]]]:
    """The engine steps (new tokens, history per row) of ``prompts`` requests of ``prompt`` tokens arriving together,
    until each has decoded once, as vLLM's scheduler lays them out under ``budget`` tokens per step (chunked
    prefill): decode rows first (the requests whose prompt is in), then prompt chunks in arrival order, each as
    long as the budget left allows (the one cut short goes on over its history in the next step)."""
    cached, steps = [0] * prompts, []
    while min(cached) <= prompt:
        rows = [(i, 1) for i in range(prompts) if cached[i] >= prompt]
        left = budget - len(rows)
        for i in range(prompts):
            if cached[i] < prompt and left > 0:
                rows.append((i, min(prompt - cached[i], left)))
                left -= rows[-1][1]
        steps.append(([n for _, n in rows], [cached[i] for i, _ in rows]))
        for i, n in rows:
            cached[i] += n
    return steps


#: matrix models (``benchmarks/vllm_gpu/model_matrix.yaml``) -> layers of a tiny copy: five 1,024-token
#: sliding-window layers, then a global one; head dim 256
WINDOWED_MODELS = {"gemma-3-4b": 6}  # (gemma-3-12b: the same pattern at twice the heads, 6 s more here)


def model_layers(name: str, layers: int) -> list[Layer]:
    """A ``Layer`` per attention layer of the first ``layers`` layers of the matrix model ``name``: its published
    query / KV heads, head dim and sliding window on the layers transformers' config makes sliding."""
    from transformers import AutoConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks" / "vllm_gpu"))
    import models

    config = dict(models.matrix_models()[name]["config"], num_hidden_layers=layers)
    cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * layers
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    windows = [cfg.sliding_window if kind == "sliding_attention" else None for kind in types]
    return [
        Layer("mse_k4v3", hq, hkv, d, window=w, name=f"model.layers.{i}.self_attn.attn") for i, w in enumerate(windows)
    ]


def hybrid_runner(layers: list[Layer], budget: int):
    """The runner as the hook sees it: vLLM's hybrid KV-cache groups (the sliding-window layers, the global ones),
    one block table each, and the scheduler's sizes."""
    groups = [[x.layer_name for x in layers if (x.impl.extras.sliding_window is None) == full] for full in (0, 1)]
    tables = [NS(block_size=layers[0].bs, max_num_blocks_per_req=layers[0].width) for _ in groups]
    return NS(
        device="cpu",
        vllm_config=NS(scheduler_config=NS(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=budget)),
        model_config=NS(max_model_len=MAX_MODEL_LEN),
        input_batch=NS(block_table=NS(block_tables=tables)),
        kv_cache_config=NS(kv_cache_groups=[NS(layer_names=names) for names in groups]),
    )


@pytest.mark.parametrize("budget", [2048, 16384])  # the matrix's, and one that splits every prompt into chunks
@pytest.mark.parametrize("model", list(WINDOWED_MODELS))
def test_warm_up_covers_every_layer_variant_of_a_windowed_model(model, budget, monkeypatch):
    """Eight 8,192-token prompts through every layer of a model whose sliding-window layers come first (the
    matrix's engine: max_model_len 8,320, 8 sequences): the hook warms up one layer per variant, the first
    sliding-window layer and the first global one, and the first steps (prompt chunks crossing the window, chunks
    over their history, decode rows) launch nothing it did not compile. On an H100 a warm-up once per format
    missed the global layers (another window flag): their first prefill compiled the dequantizer and the prefill
    while the first request waited."""
    from jetson_tq.integrations.vllm import warmup

    module = sys.modules[__name__]
    monkeypatch.setattr(module, "MAX_MODEL_LEN", PROMPT + 128)
    monkeypatch.setattr(module, "MAX_NUM_SEQS", 8)
    monkeypatch.setattr(warmup, "compiles_on", lambda device: True)
    runs: list[str] = []
    real = warmup.warm_up
    monkeypatch.setattr(warmup, "warm_up", lambda impl, *a, **kw: (runs.append(impl.layer_name), real(impl, *a, **kw)))
    layers = model_layers(model, WINDOWED_MODELS[model])
    runner, warmed = hybrid_runner(layers, budget), set()
    with specializations.record(launch=False) as warm:
        for layer in layers:
            warmup.warm_up_layer(runner, layer, warmed)
    first: dict = {}  # window -> the first layer with it
    for layer in layers:
        first.setdefault(layer.impl.extras.sliding_window, layer.layer_name)
    assert len(first) == 2 and runs == list(first.values()), f"warmed up {runs}, one per variant: {first}"
    with specializations.record(launch=False) as request:
        for q_lens, ctx_lens in first_steps(8, PROMPT, budget):
            for layer in layers:
                layer.step(q_lens, ctx_lens)
    missing = request.missing_from(warm.keys)
    assert not missing, (
        f"{len(missing)} of {len(request.keys)} specializations of the first steps are not compiled by the warm-up:\n"
        + specializations.describe_missing(missing, warm.keys)
    )


def test_an_engine_warm_up_is_not_reported_as_late_compiles(monkeypatch):
    """The late-compile report is off while an engine warms up, even when an earlier engine of the process set it
    (a second engine's warm-up compiles were logged as a request's wait), and on again after."""
    from jetson_tq.integrations.vllm import hooks, warmup

    events: list = []
    monkeypatch.setattr(hooks, "report_compiles", lambda hook: events.append(("report", hook)))
    monkeypatch.setattr(hooks, "warm_up_layer", lambda runner, layer, warmed: (events.append("warm"), warmed.add(1)))
    for name in ("remember_runner", "configure_all", "adopt_final_specs", "log_capacity", "log_encoder_attention"):
        monkeypatch.setattr(hooks, name, lambda *args: None)
    monkeypatch.setattr(hooks, "recent_rows", lambda config: 1)

    class Impl:
        def allocate_recent(self, rows, device, dtype) -> None:
            pass

    layer = type("Layer", (), {"impl": Impl()})()
    monkeypatch.setattr(hooks, "our_layers", lambda config: {"layers.0": layer})
    runner = type("Runner", (), {"vllm_config": None, "device": "cpu", "model_config": type("M", (), {"dtype": None})})
    hooks._runner_wrap(lambda self, config: "out")(runner(), None)
    assert events == [("report", None), "warm", ("report", warmup.late_compile)]


def test_a_late_compile_names_the_end_of_a_long_launch_key():
    """A launch key opens with the format's page spec: the log keeps its end, where two launches differ."""
    from jetson_tq.integrations.vllm.warmup import short_key

    key = ("x" * 1000, 17, 128)
    text = short_key(key)
    assert len(text) < 420 and text.endswith("17, 128)") and text.startswith("('xxx")
    assert short_key((1, 2)) == "(1, 2)"
