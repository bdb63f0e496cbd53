"""GPU benchmarks of the kernels next to their baselines, measured in the same process (docs/benchmarks.md).

Every function returns rows (dicts) that ``table`` prints. Inputs are real: K/V are random normal
fp16, compressed by the compress-on-write kernel into vLLM-style pages; several input sets rotate
so that repeated runs never read from L2 (60 MB on an H200); each output is checked against the
reference before it is timed. Lives outside the package (benchmark harness, not library code); the
``benchmarks/*.py`` scripts import it from this folder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from jetson_tq.codec.kv import KVCodec
from jetson_tq.errors import UnsupportedPlatformError
from jetson_tq.format import KVFormat, PagedLayout
from jetson_tq.paged import PagedKV, allocate_pages, slots_for_positions

L2_BYTES = 60 * 2**20


def _require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise UnsupportedPlatformError("benchmarks need a CUDA GPU")
    return torch.device("cuda")


def _bench(fns: list, warmup_ms: int = 25, rep_ms: int = 200) -> float:
    """Median µs of one call, cycling through ``fns`` (one per input set) so each call sees cold inputs."""
    import triton

    state = {"i": 0}

    def step():
        fns[state["i"] % len(fns)]()
        state["i"] += 1

    return triton.testing.do_bench(step, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3


def _graph_us(fns: list, iters: int = 20) -> float:
    """µs per call of ``fns`` replayed from one CUDA graph (launch overhead removed, as vLLM decodes)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            for f in fns:
                f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (iters * len(fns)))
    return sorted(times)[len(times) // 2]


def copy_bandwidth(nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + written (the roofline we quote)."""
    _require_cuda()
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = _bench([lambda: dst.copy_(src)])
    return 2 * nbytes / (us * 1e-6) / 1e9


def _n_sets(bytes_per_set: int, cap: int = 16) -> int:
    return max(2, min(cap, math.ceil(3 * L2_BYTES / max(bytes_per_set, 1))))


# ------------------------------------------------------------------------------------- decode
@dataclass
class DecodeCase:
    """One input set: compressed pages of ``lens`` tokens per sequence plus the same tokens in fp16."""

    kv: PagedKV
    q: torch.Tensor  # [B, Hq, D]
    k16: torch.Tensor  # [B, Hkv, max_len, D] all tokens (compressed + buffer), the SDPA baseline's cache
    v16: torch.Tensor
    compressed_bytes: int
    buffer_bytes: int


def make_decode_case(
    batch: int,
    hq: int,
    hkv: int,
    lens: list[int],
    head_dim: int = 128,
    fmt: KVFormat | None = None,
    recent_tokens: int = 128,
    block_size: int = 16,
    seed: int = 0,
) -> DecodeCase:
    """Random K/V for ``lens`` tokens per sequence: the last ``recent_tokens`` stay fp16 (recent
    buffer), the rest are compressed by ``compress_write`` into shuffled vLLM-style blocks."""
    from jetson_tq.kernels.compress_write_plan import compress_write

    dev = _require_cuda()
    fmt = fmt or KVFormat(recent_tokens=recent_tokens)
    gen = torch.Generator(device=dev).manual_seed(seed)
    codec = KVCodec(fmt, head_dim, key_transform=timing_transform(fmt, hkv, head_dim))
    layout = PagedLayout(fmt, head_dim, block_size)
    maxlen = max(lens)
    k16 = torch.randn(batch, hkv, maxlen, head_dim, device=dev, generator=gen, dtype=torch.float16)
    v16 = torch.randn(batch, hkv, maxlen, head_dim, device=dev, generator=gen, dtype=torch.float16)
    comp = [max(n - recent_tokens, 0) for n in lens]
    rec = [n - c for n, c in zip(lens, comp)]
    need = [-(-c // block_size) for c in comp]
    width = max(need + [1])
    perm = torch.randperm(sum(need) + 1, device=dev, generator=gen)[: sum(need)].to(torch.int32)
    table = torch.zeros(batch, width, dtype=torch.int32, device=dev)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[start : start + n]
        start += n
    pages = allocate_pages(layout, int(sum(need)) + 1, hkv, dev)
    for b, c in enumerate(comp):
        for t0 in range(0, c, 65536):  # bounded temporaries
            pos = torch.arange(t0, min(c, t0 + 65536), device=dev)
            slots = slots_for_positions(table[b : b + 1], pos.unsqueeze(0), block_size)[0]
            k_rows, v_rows = k16[b, :, pos].transpose(0, 1), v16[b, :, pos].transpose(0, 1)
            compress_write(k_rows, v_rows, slots, pages, layout, codec, positions=pos.to(torch.int32))
    cap = max(rec + [1])
    rk = torch.zeros(batch, hkv, cap, head_dim, dtype=torch.float16, device=dev)
    rv = torch.zeros_like(rk)
    for b, (c, r) in enumerate(zip(comp, rec)):
        rk[b, :, :r], rv[b, :, :r] = k16[b, :, c : c + r], v16[b, :, c : c + r]
    kv = PagedKV(
        pages,
        table,
        torch.tensor(comp, dtype=torch.int32, device=dev),
        rk,
        rv,
        torch.tensor(rec, dtype=torch.int32, device=dev),
        torch.arange(batch, dtype=torch.int32, device=dev),
        layout,
        codec,
    )
    q = torch.randn(batch, hq, head_dim, device=dev, generator=gen, dtype=torch.float16)
    return DecodeCase(kv, q, k16, v16, sum(comp) * hkv * fmt.bytes_per_token(head_dim), sum(rec) * hkv * 4 * head_dim)


def leading_sequences(kv: PagedKV, n: int) -> PagedKV:
    """The first ``n`` sequences of ``kv`` (same pages and buffers): what the reference checks, bounded."""
    return PagedKV(
        kv.pages,
        kv.block_table[:n],
        kv.compressed_lens[:n],
        kv.recent_k,
        kv.recent_v,
        kv.recent_lens[:n],
        kv.recent_index[:n],
        kv.layout,
        kv.codec,
    )


def _sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def decode_diagnostics(
    cases: list[tuple[int, int, int, int]], variants: list[dict], q_scale: float = 1.0
) -> list[dict]:
    """Relative error vs the reference of each kernel variant on each (B, Hq, Hkv, ctx) case (first 2 sequences)."""
    from jetson_tq.attention.reference import paged_attention_decode
    from jetson_tq.kernels.hybrid_decode_plan import DecodeTuning, hybrid_decode

    rows = []
    for b, hq, hkv, ctx in cases:
        case = make_decode_case(b, hq, hkv, [ctx] * b, seed=0)
        q = case.q * q_scale
        sub = min(b, 2)
        kv = case.kv
        part = leading_sequences(kv, sub)
        ref = paged_attention_decode(q[:sub], part).float()
        for var in variants:
            errs = []
            for _ in range(2):  # twice: a moving error is a race
                got = hybrid_decode(q, kv, tuning=DecodeTuning(**var))[:sub].float()
                errs.append(((got - ref).norm() / ref.norm()).item())
            rows.append(
                {
                    "B": b,
                    "ctx": ctx,
                    "q_scale": q_scale,
                    "variant": ",".join(f"{k}={v}" for k, v in var.items()) or "default",
                    "err_run1": errs[0],
                    "err_run2": errs[1],
                }
            )
        del case
        torch.cuda.empty_cache()
    return rows


def resolve_format(fmt: KVFormat | str | None) -> KVFormat:
    """A KVFormat from a preset name (``configs/<name>.yaml``) or a kernel-test format
    (``tests.helpers.kernel_cases.TEST_FORMATS``, e.g. ``klt52_g3``: klt keys with group values, no preset), a
    KVFormat, or None (blog_k3v2-like defaults)."""
    if fmt is None or isinstance(fmt, KVFormat):
        return fmt or KVFormat()
    from tests.helpers.kernel_cases import TEST_FORMATS

    if fmt in TEST_FORMATS:
        return TEST_FORMATS[fmt]
    from jetson_tq.config import load_config

    return load_config(fmt).default


#: The code widths klt formats are timed with (``tests/helpers/klt_cases.STRUCTURES``; ``--klt`` of targets.py
#: and sweep_decode.py): "any" is what ``python -m jetson_tq calibrate`` fits today.
TIMING_KLT = "any"


def timing_transform(fmt: KVFormat, num_kv_heads: int, head_dim: int):
    """klt keys: a random transform of the format's code size and ``TIMING_KLT``'s structure
    (``klt_cases.uneven_transform``: the kernels' paths depend on the structure, not on the calibration); None for
    other formats."""
    if fmt.key_mode != "klt":
        return None
    from tests.helpers.klt_cases import STRUCTURES, uneven_transform

    gen = torch.Generator().manual_seed(0)
    code_bits = fmt.key_code_bits(head_dim)
    return uneven_transform(num_kv_heads, head_dim, code_bits, head_dim, 1.0, gen, **STRUCTURES[TIMING_KLT])


def decode_vs_sdpa(
    shapes: list[tuple[int, int, int, int]] | None = None,
    *,
    head_dim: int = 128,
    ragged: list[int] | None = None,
    graphs: bool = True,
    check: bool = True,
    copy_gbps: float | None = None,
    fmt: KVFormat | str | None = None,
    **kernel_kwargs,
) -> list[dict]:
    """Fused hybrid decode vs torch SDPA flash on fp16 KV (same tokens), per shape (B, Hq, Hkv, ctx).

    Columns: ours_us / flash_us (medians, eager), speedup, bytes our kernel must read, floor at
    the measured copy bandwidth and % of it achieved; ``graphs`` adds CUDA-graph replay times.
    ``ragged``: one extra row with these per-sequence lengths (Hq/Hkv 32/8; flash runs padded).
    ``fmt``: the cache format (KVFormat or preset name; default KVFormat(), i.e. blog_k3v2's layout).
    """
    from jetson_tq.attention.reference import paged_attention_decode
    from jetson_tq.kernels.hybrid_decode_plan import DecodeTuning, hybrid_decode

    _require_cuda()
    tuning = DecodeTuning(**kernel_kwargs)
    bw = copy_gbps or copy_bandwidth()
    shapes = shapes if shapes is not None else [(1, 32, 8, 1024), (8, 32, 8, 65536), (1, 32, 8, 131072)]
    todo = [(b, hq, hkv, [ctx] * b) for b, hq, hkv, ctx in shapes]
    if ragged:
        todo.append((len(ragged), 32, 8, list(ragged)))
    rows = []
    for b, hq, hkv, lens in todo:
        probe = make_decode_case(b, hq, hkv, lens, head_dim, fmt=resolve_format(fmt), seed=0)
        our_bytes = probe.compressed_bytes + probe.buffer_bytes + 2 * probe.q.numel() * 2
        fp16_bytes = 2 * probe.k16.numel() * 2 + 2 * probe.q.numel() * 2
        sets = [probe] + [
            make_decode_case(b, hq, hkv, lens, head_dim, fmt=resolve_format(fmt), seed=i)
            for i in range(1, _n_sets(fp16_bytes + our_bytes, cap=8))
        ]
        outs = [torch.empty_like(c.q) for c in sets]
        if check:  # the reference on a bounded subset (first two sequences) of the first set
            sub = min(b, 2)
            kv = probe.kv
            part = leading_sequences(kv, sub)
            ref = paged_attention_decode(probe.q[:sub], part).float()
            got = hybrid_decode(probe.q, kv, tuning=tuning)[:sub].float()
            err = ((got - ref).norm() / ref.norm()).item()  # reported in the row; > 2e-3 is flagged, not hidden
        ours = [lambda c=c, o=o: hybrid_decode(c.q, c.kv, out=o, tuning=tuning) for c, o in zip(sets, outs)]
        flash = [lambda c=c: _sdpa_flash(c.q.unsqueeze(2), c.k16, c.v16) for c in sets]
        t_ours, t_flash = _bench(ours), _bench(flash)
        row = {
            "B": b,
            "Hq/Hkv": f"{hq}/{hkv}",
            "ctx": max(lens) if len(set(lens)) == 1 else "ragged:" + "/".join(str(n // 1024) + "k" for n in lens),
            "ours_us": t_ours,
            "flash_us": t_flash,
            "speedup": t_flash / t_ours,
            "MB_read": our_bytes / 1e6,
            "floor_us": our_bytes / (bw * 1e3),
            "pct_copy_bw": 100 * our_bytes / (t_ours * 1e-6) / (bw * 1e9),
            "flash_pct_bw": 100 * fp16_bytes / (t_flash * 1e-6) / (bw * 1e9),
        }
        if graphs:
            row["ours_graph_us"] = _graph_us(ours[:2])
            row["flash_graph_us"] = _graph_us(flash[:2])
        if check:
            row["check_err"] = err
            row["check"] = "ok" if err <= 2e-3 else "FAILED"
        rows.append(row)
        del sets, outs, probe
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------- compress
def _compress_reference(k, v, slots, pages, layout, codec) -> None:
    """The PyTorch write path compress-on-write replaces: ``KVCodec.encode`` then ``write_slots``."""
    from jetson_tq.paged import write_slots

    write_slots(pages, layout, slots, codec.encode(k, v))


def compress_bench(
    tokens: int = 16384,
    hkv: int = 8,
    head_dim: int = 128,
    variants: list[dict] | None = None,
    copy_gbps: float | None = None,
    fmt: KVFormat | str | None = None,
    slots: str = "random",
    reference: bool = True,
) -> list[dict]:
    """Compress-on-write of ``tokens`` new tokens x ``hkv`` heads in one launch, next to a device copy of the same
    bytes timed in the same process. ``slots``: ``random`` (every token in a random slot, the run 3-6 setting) or
    ``blocks`` (whole 16-token blocks in shuffled order, what a vLLM prefill chunk writes)."""
    from jetson_tq.kernels.compress_write_plan import WriteTuning, compress_write

    dev = _require_cuda()
    bw = copy_gbps or copy_bandwidth()
    fmt = resolve_format(fmt)
    codec, layout = KVCodec(fmt, head_dim), PagedLayout(fmt, head_dim, 16)
    nblocks = tokens // 16 + 1
    io_bytes = tokens * hkv * (4 * head_dim + fmt.bytes_per_token(head_dim)) + tokens * 8
    sets = []
    for _ in range(_n_sets(io_bytes, cap=8)):
        k = torch.randn(tokens, hkv, head_dim, device=dev, dtype=torch.float16)
        v = torch.randn(tokens, hkv, head_dim, device=dev, dtype=torch.float16)
        if slots == "random":
            sl = torch.randperm(nblocks * 16, device=dev)[:tokens]
        else:
            sl = (torch.randperm(nblocks, device=dev)[:, None] * 16 + torch.arange(16, device=dev)).flatten()[:tokens]
        sets.append((k, v, sl, allocate_pages(layout, nblocks, hkv, dev)))
    k, v, sl, pages = sets[0]
    ref_pages = pages.clone()
    _compress_reference(k, v, sl, ref_pages, layout, codec)

    def row(name: str, t: float, same: float | None) -> dict:
        return {
            "variant": name,
            "tokens": tokens,
            "heads": hkv,
            "slots": slots,
            "us": t,
            "MB_moved": io_bytes / 1e6,
            "floor_us": io_bytes / (bw * 1e3),
            "pct_copy_bw": 100 * io_bytes / (t * 1e-6) / (bw * 1e9),
            "bytes_differing": "" if same is None else same,
        }

    half = io_bytes // 2  # a copy reading and writing io_bytes in all
    bufs = [
        (torch.empty(half, dtype=torch.uint8, device=dev), torch.empty(half, dtype=torch.uint8, device=dev))
        for _ in range(_n_sets(io_bytes, cap=8))
    ]
    rows = [row("copy of the same bytes (torch, same run)", _bench([lambda b=b: b[1].copy_(b[0]) for b in bufs]), None)]
    del bufs
    for var in variants or [{}]:
        compress_write(k, v, sl, pages, layout, codec, tuning=WriteTuning(**var))
        same = (pages != ref_pages).float().mean().item()
        tuning = WriteTuning(**var)
        fns = [
            lambda s=s, tuning=tuning: compress_write(s[0], s[1], s[2], s[3], layout, codec, tuning=tuning)
            for s in sets
        ]
        rows.append(row(",".join(f"{a}={b}" for a, b in var.items()) or "default", _bench(fns), same))
    if reference:
        ref_t = _bench([lambda s=s: _compress_reference(s[0], s[1], s[2], s[3], layout, codec) for s in sets[:2]])
        rows.append(row("reference (encode + write_slots)", ref_t, 0.0))
    return rows


def _timed(fn, reset=None, reps: int = 20) -> tuple[float, float]:
    """(wall µs, device µs) medians of ``fn()`` from an idle GPU: wall = host issue + device work until done (one
    eager call as a user sees it), device = CUDA events around it. ``reset()`` runs untimed before each call."""
    import time

    walls, gpus = [], []
    for _ in range(reps + 2):  # two warm-up calls
        if reset is not None:
            reset()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e6)
        gpus.append(start.elapsed_time(end) * 1e3)
    walls, gpus = sorted(walls[2:]), sorted(gpus[2:])
    return walls[len(walls) // 2], gpus[len(gpus) // 2]


def _rewind(cache) -> None:
    """Empty a CompressedKVCache in place (benchmark harness: the same append is timed again into the same pages)."""
    for t in (cache._lens, cache._comp, cache._rec):
        t.zero_()
    cache._host_lens.zero_()
    cache._host_valid = True


def append_bench(
    batch: int = 8,
    hkv: int = 8,
    tokens: int = 16384,
    head_dim: int = 128,
    fmt: KVFormat | str | None = None,
    dtype: torch.dtype = torch.float16,
) -> list[dict]:
    """``CompressedKVCache.append`` of ``tokens`` new tokens per sequence (B x Hkv x T x D, one call) with the
    default ``validate=True`` — the store checks inside the compress-on-write kernel, the commit guarded on the
    device, no host sync — next to ``validate=False`` and to ``ops.write`` of the same tokens alone (one
    compress-on-write launch over B*T tokens, the target's denominator: append with validation <= 1.5x). Capacity is
    reserved first (growth is timed in its own row); each timed call appends into the same emptied cache. Also one
    decode-step append (T = 1) per variant. Columns: wall µs (host + device from an idle GPU), device µs (events)."""
    from jetson_tq import ops
    from jetson_tq.cache.compressed import CompressedKVCache

    dev = _require_cuda()
    fmt = resolve_format(fmt)
    gen = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(batch, hkv, tokens, head_dim, device=dev, generator=gen).to(dtype)
    v = torch.randn(batch, hkv, tokens, head_dim, device=dev, generator=gen).to(dtype)
    k1, v1 = k[:, :, :1].contiguous(), v[:, :, :1].contiguous()
    kt_ = timing_transform(fmt, hkv, head_dim)
    caches = {
        val: CompressedKVCache(fmt, hkv, head_dim, batch, device=dev, dtype=dtype, validate=val, key_transform=kt_)
        for val in (True, False)
    }
    for c in caches.values():
        c.reserve(tokens + 1)
    # ops.write alone: the same tokens as one [B*T, H, D] input (made contiguous outside the timing) into the pages
    c = caches[False]
    kt = k.permute(0, 2, 1, 3).reshape(batch * tokens, hkv, head_dim).contiguous()
    vt = v.permute(0, 2, 1, 3).reshape(batch * tokens, hkv, head_dim).contiguous()
    slots = (torch.arange(batch, device=dev)[:, None] * c.capacity + torch.arange(tokens, device=dev)).flatten()
    positions = torch.arange(tokens, device=dev).repeat(batch)  # klt keys are coded at them
    rows = []

    def row(name, t_tokens, wall_dev, base=None):
        wall, gpu = wall_dev
        r = {"what": name, "B x Hkv x T": f"{batch} x {hkv} x {t_tokens}", "wall_us": wall, "device_us": gpu}
        if base is not None:
            r["x ops.write (wall)"] = wall / base[0]
            r["x ops.write (device)"] = gpu / base[1]
        return r

    write = _timed(lambda: ops.write(kt, vt, slots, c.pages, c.layout, c.codec, positions=positions))
    rows.append(row("ops.write (compress-on-write alone)", tokens, write))
    for val, name in ((True, "append, validate=True (device-side checks)"), (False, "append, validate=False")):
        cache = caches[val]
        timed = _timed(lambda cache=cache: cache.append(k, v), lambda cache=cache: _rewind(cache))
        rows.append(row(name, tokens, timed, write))
    fresh = _timed(
        lambda: CompressedKVCache(fmt, hkv, head_dim, batch, device=dev, dtype=dtype, key_transform=kt_).append(k, v)
    )
    rows.append(row("new cache + append, validate=True (pages grow: allocation)", tokens, fresh, write))
    for val in (True, False):  # one decode step's append (what an eager generate loop pays per layer)
        cache = caches[val]
        cache.append(k[:, :, :64], v[:, :, :64])
        rows.append(
            row(
                f"decode-step append (T=1), validate={val}",
                1,
                _timed(lambda cache=cache: cache.append(k1, v1), reps=50),
            )
        )
    caches[True].check()  # nothing was refused
    return rows


# ------------------------------------------------------------------------------------- prefill
def make_prefill_case(
    batch: int, hq: int, hkv: int, hist: int, t: int, head_dim: int = 128, fmt: KVFormat | None = None, seed: int = 1
) -> tuple[DecodeCase, torch.Tensor, torch.Tensor]:
    """A chunk of ``t`` tokens after ``hist`` history tokens as vLLM presents it: the pages hold all hist + t tokens
    compressed (vLLM writes the chunk before attention), the ring the history's last ``exact_count(hist)`` tokens
    exact (the window rule's rows). Returns (case with k16/v16 over hist + t tokens, chunk k, chunk v)."""
    from jetson_tq.format import exact_count

    fmt = fmt or KVFormat()
    ring = fmt.recent_tokens
    case = make_decode_case(batch, hq, hkv, [hist + t] * batch, head_dim, fmt=fmt, recent_tokens=0, seed=seed)
    rows = int(exact_count(hist, ring, fmt.block_window)) if ring else 0
    clen = hist - rows
    if ring and clen % ring:
        raise ValueError(f"history {hist}: ring rows are filled in position order, which needs (hist - rows) % R == 0")
    dev = case.k16.device
    rk = torch.zeros(batch, hkv, max(ring, 1), head_dim, dtype=torch.float16, device=dev)
    rv = torch.zeros_like(rk)
    rk[:, :, :rows], rv[:, :, :rows] = case.k16[:, :, clen:hist], case.v16[:, :, clen:hist]
    old = case.kv
    case.kv = PagedKV(
        old.pages,
        old.block_table,
        torch.full((batch,), clen, dtype=torch.int32, device=dev),
        rk,
        rv,
        torch.full((batch,), rows, dtype=torch.int32, device=dev),
        old.recent_index,
        old.layout,
        old.codec,
    )
    case.compressed_bytes = batch * hkv * hist * fmt.bytes_per_token(head_dim)  # what the chunk's history costs
    case.buffer_bytes = batch * hkv * rows * 4 * head_dim
    k, v = case.k16[:, :, hist:].contiguous(), case.v16[:, :, hist:].contiguous()
    return case, k, v


def prefill_bench(
    shapes: list[tuple[int, int, int, int, int]] | None = None,
    head_dim: int = 128,
    copy_gbps: float | None = None,
    fmt: KVFormat | str | None = None,
    variants: list[dict] | None = None,
    flash: bool = False,
) -> list[dict]:
    """Chunked prefill (B, Hq, Hkv, history, chunk T) vs SDPA flash over the fp16 history + chunk (causal,
    lower-right), one row per kernel variant (``variants``: ``chunked_prefill`` knob dicts). ``copy_gbps`` is
    accepted for the suite's uniform call and unused (the rows report TFLOP/s, not a byte floor). ``flash``: also
    a row for the vLLM path (``ops.prefill`` with vLLM's FlashAttention, ``kernels.prefill_flash``), and every row
    gets stock vLLM's own kernel on the same fp16 tokens (FlashAttention varlen over 16-token pages) as a column."""
    from torch.nn.attention.bias import causal_lower_right

    from jetson_tq import ops
    from jetson_tq.attention.reference import paged_attention_prefill
    from jetson_tq.kernels.prefill_plan import PrefillTuning, chunked_prefill

    dev = _require_cuda()
    flash_varlen = None
    if flash:
        from jetson_tq.integrations.vllm.flash import vllm_varlen

        flash_varlen = vllm_varlen()
        if flash_varlen is None:
            raise UnsupportedPlatformError("--flash needs vLLM's FlashAttention (the vLLM bundle on a CUDA GPU)")
    shapes = shapes or [(1, 32, 8, 16384, 1024), (1, 32, 8, 65536, 1024), (4, 32, 8, 8192, 512)]
    fmt_name, fmt = fmt if isinstance(fmt, str) else "default", resolve_format(fmt)
    rows = []
    for b, hq, hkv, hist, t in shapes:
        case, k, v = make_prefill_case(b, hq, hkv, hist, t, head_dim, fmt=fmt, seed=1)
        gen = torch.Generator(device=dev).manual_seed(2)
        q = torch.randn(b, hq, t, head_dim, device=dev, dtype=torch.float16, generator=gen)
        kv = case.kv
        kf, vf = case.k16, case.v16
        bias = causal_lower_right(t, hist + t)

        # the tensors are bound as defaults so ``del kf, vf`` below frees them (no closure cell left referring to
        # deleted names)
        def flash(q=q, kf=kf, vf=vf, bias=bias):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(q, kf, vf, attn_mask=bias, enable_gqa=True)

        t_flash = _bench([flash])
        del flash
        t_fa = stock_fa_us(q, kf, vf) if flash_varlen else None
        flops = 4 * b * hq * t * head_dim * (hist + t / 2)
        # the check: the chunk's first 256 tokens of sequence 0 (two 128-token blocks: the second reads the first
        # one compressed); the reference's scores over every position stay ~1 GB
        part, tc = leading_sequences(kv, 1), min(t, 256)
        qc, kc, vc = q[:1, :, :tc].contiguous(), k[:1, :, :tc].contiguous(), v[:1, :, :tc].contiguous()
        ref = paged_attention_prefill(qc, kc, vc, part).float()
        runs = [
            (
                str(var) if var else "{}",
                lambda q, k, v, kv, var=var: chunked_prefill(q, k, v, kv, tuning=PrefillTuning(**var)),
            )
            for var in variants or [{}]
        ]
        if flash_varlen is not None:
            runs.append(
                (
                    "vllm-flash",
                    lambda q, k, v, kv, hist=hist: ops.prefill(
                        q, k, v, kv, varlen=flash_varlen, history=[hist] * q.shape[0]
                    ),
                )
            )
        for name, run in runs:
            got = run(qc, kc, vc, part).float()
            err = ((got - ref).norm() / ref.norm()).item()  # reported; > 2e-3 is flagged in the row
            t_ours = _bench([lambda q=q, k=k, v=v, kv=kv, run=run: run(q, k, v, kv)])
            rows.append(
                {
                    "format": fmt_name,
                    "variant": name,
                    "B": b,
                    "Hq/Hkv": f"{hq}/{hkv}",
                    "history": hist,
                    "chunk": t,
                    "ours_us": t_ours,
                    "sdpa_us": t_flash,
                    "vs_sdpa": t_ours / t_flash,
                    **({"fa_us": t_fa, "vs_fa": t_ours / t_fa} if t_fa else {}),
                    "ours_TFLOPs": flops / (t_ours * 1e-6) / 1e12,
                    "sdpa_TFLOPs": flops / (t_flash * 1e-6) / 1e12,
                    "hist_MB": (case.compressed_bytes + case.buffer_bytes) / 1e6,
                    "check_err": err,
                    "check": "ok" if err <= 2e-3 else "FAILED",
                }
            )
        del case, kf, vf
        torch.cuda.empty_cache()
    return rows


def stock_fa_us(q: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, page: int = 16) -> float:
    """µs of stock vLLM's prefill attention on these fp16 tokens: vLLM's FlashAttention varlen (the version vLLM
    picks here) over 16-token pages, causal from the bottom right, one sequence per batch row."""
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    b, hq, t, d = q.shape
    n = kf.shape[2]
    npg = -(-n // page)
    pad = npg * page - n
    kp = torch.nn.functional.pad(kf.transpose(1, 2), (0, 0, 0, 0, 0, pad)).reshape(b * npg, page, -1, d).contiguous()
    vp = torch.nn.functional.pad(vf.transpose(1, 2), (0, 0, 0, 0, 0, pad)).reshape(b * npg, page, -1, d).contiguous()
    table = torch.arange(b * npg, dtype=torch.int32, device=q.device).view(b, npg)
    qt = q.transpose(1, 2).reshape(b * t, hq, d).contiguous()
    cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=q.device)
    used = torch.full((b,), n, dtype=torch.int32, device=q.device)
    version = get_flash_attn_version()

    def run():
        flash_attn_varlen_func(
            qt,
            kp,
            vp,
            t,
            cu,
            n,
            seqused_k=used,
            causal=True,
            block_table=table,
            fa_version=version,
            softmax_scale=d**-0.5,
        )

    return _bench([run])


# ------------------------------------------------------------------------------------- scores
def scores_bench(b: int = 32, s: int = 32768, d: int = 128, c: int = 16, copy_gbps: float | None = None) -> list[dict]:
    """``turboquant_scores`` kernel vs the reconstruct-then-matmul PyTorch reference, and its byte floor."""
    from jetson_tq.codec.codebook import lloyd_max_codebook
    from jetson_tq.codec.rotation import Rotation, qjl_matrix
    from jetson_tq.codec.scores import turboquant_scores_reference
    from jetson_tq.kernels.scores import turboquant_scores_triton

    dev = _require_cuda()
    bw = copy_gbps or copy_bandwidth()
    pi, sk = Rotation(d, "auto", 0).matrix(dev), qjl_matrix(d, 0, dev)
    cb = lloyd_max_codebook(d, int(math.log2(c))).to(dev)
    nbytes = s * d * 2 + s * 4 + b * d * 4 + 2 * d * d * 4 + b * s * 4
    sets = []
    for _ in range(_n_sets(nbytes)):
        sets.append(
            (
                torch.randn(b, d, device=dev),
                torch.randint(0, c, (s, d), dtype=torch.uint8, device=dev),
                (torch.randint(0, 2, (s, d), device=dev) * 2 - 1).to(torch.int8),
                torch.rand(s, device=dev),
            )
        )
    q, idx, sg, gamma = sets[0]
    ref = turboquant_scores_reference(q, idx, sg, gamma, pi, sk, cb)
    got = turboquant_scores_triton(q, idx, sg, gamma, pi, sk, cb)
    err = ((got - ref).norm() / ref.norm()).item()
    if not err <= 1e-5:
        raise AssertionError(f"scores check failed before timing: rel err {err:.2e}")
    t_k = _bench([lambda a=a: turboquant_scores_triton(a[0], a[1], a[2], a[3], pi, sk, cb) for a in sets])
    t_r = _bench([lambda a=a: turboquant_scores_reference(a[0], a[1], a[2], a[3], pi, sk, cb) for a in sets])
    floor = nbytes / (bw * 1e3)
    return [
        {
            "impl": "triton kernel",
            "B": b,
            "S": s,
            "D": d,
            "C": c,
            "us": t_k,
            "floor_us": floor,
            "pct_copy_bw": 100 * floor / t_k,
            "check_err": err,
        },
        {
            "impl": "reconstruct-then-matmul (torch)",
            "B": b,
            "S": s,
            "D": d,
            "C": c,
            "us": t_r,
            "floor_us": floor,
            "pct_copy_bw": 100 * floor / t_r,
            "check_err": 0.0,
        },
    ]


def table(rows: list[dict]) -> str:
    """Rows as a GitHub markdown table (floats to 3 significant digits)."""
    if not rows:
        return "(no rows)"
    cols = list(dict.fromkeys(k for r in rows for k in r))

    def fmt(x):
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
        return str(x)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
