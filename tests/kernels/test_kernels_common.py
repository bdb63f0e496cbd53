"""Host-side helpers the kernels share (no Triton launch): the affine codebook fit and the
compress-on-write tile fallback."""

from __future__ import annotations

import pytest
import torch

from jetson_tq.codec.codebook import lloyd_max_codebook, uniform_codebook
from jetson_tq.kernels import compress_write_plan as cw
from jetson_tq.kernels._common import _linear_codebook_fit


@pytest.mark.parametrize("d", [50, 64, 128])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_affine_codebook_fit(d, bits):
    """Every uniform codebook is c[k] = alpha + beta k (kernels read its indices as one bit plane); a 2-bit
    Lloyd-Max one needs the (k >> 1) term, 3/4-bit Lloyd-Max ones fit no such form (kernels gather them)."""
    k = torch.arange(1 << bits, dtype=torch.float64)
    uni = uniform_codebook(d, bits)
    a, b, g = _linear_codebook_fit(uni)
    assert g == 0.0 and (a + b * k - uni.double()).abs().max().item() <= 1e-6 * uni.abs().max().item()
    lm = lloyd_max_codebook(d, bits)
    fit = _linear_codebook_fit(lm)
    if bits <= 2:
        a, b, g = fit
        assert (a + b * k + g * torch.floor(k / 2) - lm.double()).abs().max().item() <= 1e-6
    else:
        assert fit is None


def test_compress_tile_defaults_by_head_dim():
    assert cw.default_block_t(64) == cw.default_block_t(128) == cw.BLOCK_T
    assert cw.default_block_t(256) == cw.BLOCK_T // 2
    assert cw.default_block_t(512) == cw.BLOCK_T // 4


def test_compress_tile_halves_when_shared_memory_overflows(monkeypatch):
    """A tile that does not fit (Triton raises OutOfResources at compile time, before any write) is
    retried at half the tokens, and the size that fit is remembered for the next call."""
    from triton.runtime.errors import OutOfResources

    from jetson_tq.codec.kv import KVCodec
    from jetson_tq.config import load_config
    from jetson_tq.format import PagedLayout
    from jetson_tq.kernels._launch import FastLauncher

    tried, fits = [], [32]

    class FakeKernel:
        def __getitem__(self, grid):
            def launch(*args, CFG, **kwargs):
                block_t = getattr(CFG.BLOCK_T, "value", CFG.BLOCK_T)  # the bundle's tile size (plain or constexpr)
                tried.append(block_t)
                if block_t > fits[0]:
                    raise OutOfResources(block_t * 2304, 232448, "shared memory")

            return launch

    monkeypatch.setattr(cw, "_LAUNCH", FastLauncher(FakeKernel()))  # CPU tensors: the plain launch path
    monkeypatch.setattr(cw, "cuda_or_interpreter", lambda t: None)
    monkeypatch.setattr(cw, "_FITTED_BLOCK_T", {})
    fmt = load_config("blog_k3v2").default
    layout, codec = PagedLayout(fmt, 256, 16), KVCodec(fmt, 256)
    k = torch.zeros(4, 2, 256)
    pages = torch.zeros(2, 2, layout.page_bytes, dtype=torch.uint8)
    cw.compress_write(k, k, torch.arange(4), pages, layout, codec)
    assert tried == [64, 32]
    cw.compress_write(k, k, torch.arange(4), pages, layout, codec)
    assert tried == [64, 32, 32]  # remembered
    tried.clear()
    fits[0] = 0  # nothing fits: the error surfaces after the smallest tile
    with pytest.raises(OutOfResources):
        cw.compress_write(k, k, torch.arange(4), pages, layout, codec, tuning=cw.WriteTuning(block_t=64))
    assert tried == [64, 32, 16]


def test_fast_launcher_compiles_once_per_argument_dtypes(monkeypatch):
    """The compiled kernel is reused only for the same argument dtypes: the H200 test run 6 found an fp32 query fed
    to the kernel compiled for an fp16 one (same plan key, so no recompile) returning NaN."""
    from jetson_tq.kernels import _launch

    compiles, runs = [], []

    class Compiled:
        function = packed_metadata = None

        def run(self, *args):
            runs.append(args)

    class FakeKernel:
        arg_names = ["a", "x", "n", "BLOCK"]

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                compiles.append(tuple(t.dtype for t in args if isinstance(t, torch.Tensor)))
                return Compiled()

            return launch

    class CudaLike:  # the first argument only has to say it is on CUDA
        is_cuda = True
        device = torch.device("cpu")

    monkeypatch.setattr(_launch, "INTERPRET", False)
    monkeypatch.setattr(_launch, "_launch_hooked", lambda: False)
    monkeypatch.setattr(_launch.torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    launcher = _launch.FastLauncher(FakeKernel())
    reported: list = []
    _launch.report_compiles(lambda name, key, seconds: reported.append((name, key, seconds)))
    try:
        for dtype in (torch.float16, torch.float16, torch.float32, torch.float16, torch.float32):
            launcher(
                (1,), (CudaLike(), torch.zeros(4, dtype=dtype), 4), {"BLOCK": 16}, ("plan",), num_warps=1, aligned=True
            )
    finally:
        _launch.report_compiles(None)
    assert compiles == [(torch.float16,), (torch.float32,)]
    assert len(runs) == 3  # every later call of a compiled dtype launches directly
    assert [r[1][0] for r in reported] == [("plan",), ("plan",)] and all(r[2] >= 0 for r in reported)  # each compile


def test_runtime_key_follows_what_triton_specializes_on():
    """A launch without ``aligned`` compiles again when a tensor's dtype or 16-byte alignment, or an int's class
    (== 1, % 16, int32 range; a tuple's fields too), changes, and reuses the kernel otherwise (floats and None never
    matter)."""
    from jetson_tq.kernels._launch import _runtime_key

    x = torch.zeros(64, dtype=torch.float16)
    base = _runtime_key((x, 32, 0.5, None, True))
    assert _runtime_key((x, 48, 0.25, None, True)) == base  # 48: still % 16, not 1, int32
    for other in (
        (x.float(), 32, 0.5, None, True),  # dtype
        (x[1:], 32, 0.5, None, True),  # 2-byte offset: not 16-byte aligned
        (x, 1, 0.5, None, True),  # == 1
        (x, 33, 0.5, None, True),  # not % 16
        (x, 2**31 + 16, 0.5, None, True),  # int64
        (x, 32, 0.5, None, False),  # a bool's value
    ):
        assert _runtime_key(other) != base, other
    assert _runtime_key((torch.nn.Parameter(x.float()), 32)) == _runtime_key((x.float(), 32))  # tensor subclasses
    packed = _runtime_key((x, (32, 0.5)))  # a tuple argument (the decode kernel's ints): its fields one by one
    assert _runtime_key((x, (48, 0.25))) == packed
    assert _runtime_key((x, (1, 0.5))) != packed and _runtime_key((x, (33, 0.5))) != packed


def _run_ptx(asm: str, x: int) -> list[int]:
    """The four output registers of ``nibble_lut_asm``'s PTX on input word ``x``: a reading of the few PTX
    instructions it uses (and, shr, shl, sub, lop3, prmt in its default mode), so CI checks the byte logic."""
    regs = {"$4": x}

    def val(t: str) -> int:
        return int(t, 16) if t.startswith("0x") else int(t) if t.isdigit() else regs[t]

    def prmt(a: int, b: int, c: int) -> int:
        src = [(a >> (8 * i)) & 255 for i in range(4)] + [(b >> (8 * i)) & 255 for i in range(4)]
        out = 0
        for i in range(4):
            sel = (c >> (4 * i)) & 15
            byte = src[sel & 7]
            out |= ((255 if byte & 128 else 0) if sel & 8 else byte) << (8 * i)
        return out

    def lop3(a: int, b: int, c: int, lut: int) -> int:
        return sum(
            ((lut >> ((((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1))) & 1) << i for i in range(32)
        )

    ops = {
        "and.b32": lambda a, b: a & b,
        "shr.b32": lambda a, b: a >> b,
        "shl.b32": lambda a, b: (a << b) & 0xFFFFFFFF,
        "sub.u32": lambda a, b: (a - b) & 0xFFFFFFFF,
        "prmt.b32": prmt,
        "lop3.b32": lop3,
    }
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}.":
            continue
        op, rest = line.split(None, 1)
        dst, *src = [t.strip() for t in rest.split(",")]
        regs[dst] = ops[op](*[val(t) for t in src])
    return [regs[f"${i}"] for i in range(4)]


@pytest.mark.parametrize("d", [64, 128, 100])
def test_nibble_lut_asm_is_the_fp16_codebook(d):
    """The byte-permute lookup's PTX gives exactly fp16(c[code]) for both codes of every byte value (the GPU
    tests run it; here its instructions are read in Python), and declines an asymmetric codebook."""
    from jetson_tq.kernels._tiles import nibble_lut_asm

    cb = lloyd_max_codebook(d, 4).float()
    asm = nibble_lut_asm(cb)
    want = [int(b) & 0xFFFF for b in cb.half().view(torch.int16)]
    gen = torch.Generator().manual_seed(d)
    words = [list(range(4 * i, 4 * i + 4)) for i in range(64)] + torch.randint(0, 256, (64, 4), generator=gen).tolist()
    for e in words:  # all 256 byte values, then random words
        r = _run_ptx(asm, sum(v << (8 * i) for i, v in enumerate(e)))
        lo = [r[0] & 0xFFFF, r[0] >> 16, r[1] & 0xFFFF, r[1] >> 16]
        hi = [r[2] & 0xFFFF, r[2] >> 16, r[3] & 0xFFFF, r[3] >> 16]
        assert lo == [want[v & 15] for v in e] and hi == [want[v >> 4] for v in e], f"bytes {e}"
    skew = cb.clone()
    skew[0] -= 0.01
    assert nibble_lut_asm(skew) is None


@pytest.mark.parametrize(
    "regs,shared,warps,want",
    [
        (128, 5120, 1, 16),
        (167, 5120, 1, 12),
        (144, 5120, 1, 12),
        (128, 5120, 2, 8),
        (40, 5120, 1, 32),
        (64, 100_000, 1, 2),
    ],
)
def test_resident_programs(regs, shared, warps, want):
    """Programs per SM from registers (per-warp units of 256 in one of 4 sub-partitions: 144 registers -> 12, the
    H200 run-7 timing), shared memory (+1 KB per block) and block slots."""
    from types import SimpleNamespace

    from jetson_tq.kernels._launch import resident_programs

    compiled = SimpleNamespace(n_regs=regs, metadata=SimpleNamespace(shared=shared))
    assert resident_programs(compiled, warps, torch.device("cpu")) == want


def test_workspaces_stay_bounded_under_ragged_shapes(monkeypatch):
    """Scratch buffers come in power-of-two size classes: 300 distinct leading sizes (ragged batches) hold at most
    twice the largest one, not one buffer per shape (which grew the H200 server's memory by 16.5 GB)."""
    from jetson_tq.kernels import _common

    monkeypatch.setattr(_common, "_WORKSPACES", {})
    for n in range(1, 301):
        w = _common.workspace("t", (n, 8), torch.float32, torch.device("cpu"))
        assert w.shape == (n, 8) and w.is_contiguous()
        w.fill_(n)
    assert _common.workspace_bytes() <= 2 * 512 * 8 * 4
    assert len(_common._WORKSPACES) == 10  # classes 1, 2, 4, ..., 512
    c = _common.counters(5, torch.device("cpu"))
    assert c.shape == (5,) and int(c.abs().sum()) == 0
