"""Inputs for the kernel tests, laid out exactly as vLLM 0.26 lays them out (read by several test modules).

vLLM's paged KV cache: physical blocks are handed out in any order, so a sequence's block table
row holds shuffled block ids and the rest of the row is zero-filled padding; the token at position
``pos`` of request ``r`` lives at ``slot = block_table[r, pos // block_size] * block_size +
pos % block_size`` (``slot_mapping``), and padded tokens of a CUDA-graph batch carry slot -1.
"""

from __future__ import annotations

import math
import os

import torch

from jetson_tq.codec.klt import KeyTransform
from jetson_tq.codec.kv import KVCodec
from jetson_tq.config import load_config
from jetson_tq.format import FP16_FORMAT, KVFormat, PagedLayout
from jetson_tq.paged import PagedKV, slots_for_positions, write_slots
from tests.helpers.klt_cases import uneven_transform, with_sink

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU = DEVICE.type == "cuda"


def fresh_seed() -> int:
    """A new random seed per test (printed in failure messages so a failure can be replayed)."""
    return int.from_bytes(os.urandom(4), "little")


#: Kernel test formats that are no preset: klt keys of 52 B at D=128 with 3-bit group values.
TEST_FORMATS = {"klt52_g3": KVFormat(key_mode="klt", key_code_bytes=52, value_mode="group", value_bits=3)}


def fmt_for(name: str, head_dim: int) -> KVFormat:
    """A named preset (configs/*.yaml) or ``TEST_FORMATS`` entry, unchanged: the format fits its value group to
    ``head_dim`` itself (``KVFormat.value_group_for``: 32 -> 25 at D=50, 20 at D=80; 64 -> 40 at D=80, 48 at D=96).
    ``<name>+vmse<b>``: that format's keys with b-bit TurboQuant_mse values."""
    preset, _, value_bits = name.partition("+vmse")
    fmt = FP16_FORMAT if preset == "fp16" else TEST_FORMATS.get(preset) or load_config(preset).default
    if value_bits:
        fmt = fmt.with_(value_mode="mse", value_bits=int(value_bits))
    fmt.check_head_dim(head_dim)
    return fmt


def vllm_block_table(lens: list[int], block_size: int, pad_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [B, max_blocks]: shuffled physical block ids per sequence, zero-filled tail (as vLLM's BlockTable)."""
    need = [math.ceil(n / block_size) for n in lens]
    width = max(need + [1]) + pad_blocks
    ids = torch.randperm(sum(need) + 3, generator=gen)[: sum(need)] + 1  # block 0 stays unused padding
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    start = 0
    for b, k in enumerate(need):
        table[b, :k] = ids[start : start + k].to(torch.int32)
        start += k
    return table


def vllm_slot_mapping(
    table: torch.Tensor, lens: list[int], block_size: int, pad_every: int = 5
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [N], (seq, pos) [N, 2]) for every token of every sequence, with a -1 padding slot every few tokens."""
    slots, who = [], []
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        s = slots_for_positions(table[b : b + 1].long(), pos.unsqueeze(0), block_size)[0]
        for i in range(n):
            slots.append(int(s[i]))
            who.append((b, i))
            if pad_every and len(slots) % pad_every == 0:
                slots.append(-1)
                who.append((-1, -1))
    return torch.tensor(slots, dtype=torch.int64), torch.tensor(who, dtype=torch.int64).reshape(-1, 2)


def build_paged_kv(
    fmt: KVFormat,
    num_kv_heads: int,
    head_dim: int,
    comp_lens: list[int],
    rec_lens: list[int],
    dtype: torch.dtype,
    gen: torch.Generator,
    block_size: int = 16,
    recent_rows: int | None = None,
    recent_cap: int | None = None,
    pages_hold: list[int] | None = None,
    key_transform: KeyTransform | None = None,
    sink: bool = False,
) -> PagedKV:
    """A PagedKV as vLLM would hand it over: compressed tokens written through a shuffled block table and a
    padded slot mapping (reference encoder), pages' unwritten bytes random, recent rows picked by a
    permuted ``recent_index`` from a larger buffer. ``pages_hold``: positions written per sequence (default
    ``comp_lens``; prefill passes history + chunk, as vLLM writes the chunk before attention). ``key_transform``:
    klt keys' calibrated transform (each key coded at its position; default ``klt_cases.uneven_transform``);
    ``sink``: that transform with a random calibrated sink (``klt_cases.with_sink``)."""
    hold = list(comp_lens) if pages_hold is None else list(pages_hold)
    raw = dtype if dtype != torch.float32 else torch.float16
    if fmt.key_mode == "klt" and key_transform is None:
        key_transform = uneven_transform(num_kv_heads, head_dim, fmt.key_code_bits(head_dim), head_dim, 1.0, gen)
    if sink:
        if key_transform is None:
            raise ValueError("build_paged_kv: a calibrated sink goes with klt keys")
        key_transform = with_sink(key_transform, gen)
    codec = KVCodec(fmt, head_dim, raw_dtype=raw, key_transform=key_transform)
    layout = PagedLayout(fmt, head_dim, block_size)
    table = vllm_block_table(hold, block_size, pad_blocks=2, gen=gen)
    num_blocks = int(table.max()) + 4
    # unwritten bytes are random garbage a kernel must never use; kept below 0x7C so any fp16 read from
    # them is finite (the reference gathers past a sequence's end and relies on 0 * garbage = 0)
    pages = torch.randint(0, 0x7C, (num_blocks, num_kv_heads, layout.page_bytes), dtype=torch.uint8, generator=gen)
    slots, who = vllm_slot_mapping(table, hold, block_size)
    n = slots.shape[0]
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen) * 2
    v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    if n:
        write_slots(pages, layout, slots, codec.encode(k.to(dtype), v.to(dtype), who[:, 1:].clamp_min(0), 1))
    bsz = len(comp_lens)
    rows = recent_rows if recent_rows is not None else bsz + 2
    cap = recent_cap if recent_cap is not None else max(rec_lens + [1]) + 3
    rk = torch.randn(rows, num_kv_heads, cap, head_dim, generator=gen).to(dtype)
    rv = torch.randn(rows, num_kv_heads, cap, head_dim, generator=gen).to(dtype)
    ridx = torch.randperm(rows, generator=gen)[:bsz].to(torch.int32)
    return PagedKV(
        pages.to(DEVICE),
        table.to(DEVICE),
        torch.tensor(comp_lens, dtype=torch.int32, device=DEVICE),
        rk.to(DEVICE),
        rv.to(DEVICE),
        torch.tensor(rec_lens, dtype=torch.int32, device=DEVICE),
        ridx.to(DEVICE),
        layout,
        codec,
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN anywhere in ``out`` gives inf)."""
    if not bool(torch.isfinite(out).all()):
        return math.inf
    den = ref.double().norm().item()
    return (out.double() - ref.double()).norm().item() / max(den, 1e-30)


def poison_workspaces() -> None:
    """Fill every cached kernel workspace with NaN so a partial a kernel fails to write shows up. In inference mode:
    a workspace first made under it (vLLM's warm-up, in another test of the same process) refuses in-place writes
    outside it."""
    from jetson_tq.kernels import _common

    with torch.inference_mode():
        for buf in _common._WORKSPACES.values():
            if buf.is_floating_point():
                buf.fill_(float("nan"))
