"""Compress-on-write, the host side: launch knobs, input checks, the write setup, and ``compress_write``."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

import torch
import triton
from triton.runtime.errors import OutOfResources

from ..codec.kv import KVCodec
from ..errors import ArgTypeError, DTypeError, ShapeError, expect_same_device
from ..format import PagedLayout
from ..validate import (
    FAULT_MAX_COORDS,
    FAULT_MAX_HEADS,
    FP32_MAX,
    StoreLimits,
)
from ._common import (
    INTERPRET,
    KEY_KLT,
    KEY_RAW,
    PageSpec,
    codec_constants,
    constexpr_bundle,
    cuda_or_interpreter,
    klt_constants,
    next_pow2,
    page_spec,
)
from ._launch import FastLauncher, resident_programs
from .compress_write import WriteConstexprs, _compress_write_kernel

KLT_COEFFS_PER_STEP = 16  # klt keys: coefficients per step (offline sm_90a compiles, D=128 and 80 at 128 tokens: no
# spills; unrolled steps of 16 or 32 spilled 48-1012 B)
BLOCK_T = 128  # H200, 16k tokens x 8 heads: 547 us at 128 tokens / 8 warps, 761 at 64 / 8, 1152 at 16 / 4
# (format, head dim, device, knobs, compile-relevant dtypes) -> the largest tile that fit in shared memory. A fact of
# the compiled kernel, the same for every layer (codec) of a format, so it spans write setups: kept per setup, each
# layer's first write would retry a compile that cannot fit (seconds each) before finding the same size.
_FITTED_BLOCK_T: dict = {}


def default_block_t(head_dim: int) -> int:
    """Tokens per program: shared memory grows with D^2 (the split rotation/sketch matrices); at D=256
    128 tokens need 288 KB (> the H200's 227 KB per block, seen on the GPU), 64 need 176-192 KB."""
    return BLOCK_T if head_dim <= 128 else BLOCK_T // 2 if head_dim <= 256 else BLOCK_T // 4


@dataclass(frozen=True)
class WriteTuning:
    """Launch knobs of ``compress_write``."""

    block_t: int | None = None  # tokens per program; None: by head dim (``default_block_t``), halved while a tile
    # does not fit in shared memory (the size that fit is remembered)
    num_warps: int = 8
    exact_signs: bool = True  # False: the QJL sketch by single fp16 products when indices have <= 2 bits: faster,
    # but ~0.05 % of sign bits (those whose sketch is within rounding of 0) then differ from the fp32 reference —
    # harmless for the estimator, visible as ~1 % output differences against it
    maxnreg: int | None = None  # register cap per thread (128: two 8-warp programs per SM)
    klt_precision: str = "tf32x3"  # klt keys: tl.dot input precision of the encode product on the GPU (3 tensor-core
    # products, ~fp32 accurate; "ieee": fp32 FMAs, whose lowering holds a thread's whole operand rows and columns in
    # registers); the interpreter computes in fp32


DEFAULT_TUNING = WriteTuning()


def _check_inputs(
    k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor, layout: PagedLayout
) -> None:
    """Named errors for K/V, slots or pages that do not fit ``layout``."""
    cuda_or_interpreter(k)
    expect_same_device(k=k, v=v, slots=slots, pages=pages)
    if k.shape != v.shape or k.dim() not in (3, 4) or k.shape[-2] != pages.shape[1] or k.shape[-1] != layout.head_dim:
        raise ShapeError(
            f"k, v: expected [N, {pages.shape[1]}, {layout.head_dim}] or [R, T, {pages.shape[1]}, {layout.head_dim}],"
            f" got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    n = k.shape[0] if k.dim() == 3 else k.shape[0] * k.shape[1]
    if slots.dim() != 1 or slots.shape[0] != n:
        raise ShapeError(f"slots: expected [{n}], got {tuple(slots.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise DTypeError(f"{name}: expected float16, bfloat16 or float32, got {t.dtype}")
    if pages.dtype != torch.uint8 or pages.shape[2] != layout.page_bytes:
        raise ShapeError(
            f"pages: expected uint8 [blocks, H, {layout.page_bytes}], got {pages.dtype} {tuple(pages.shape)}"
        )


def compress_write(
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    pages: torch.Tensor,
    layout: PagedLayout,
    codec: KVCodec,
    *,
    tuning: WriteTuning = DEFAULT_TUNING,
    fault: torch.Tensor | None = None,
    limits: StoreLimits | None = None,
    positions: torch.Tensor | None = None,
) -> None:
    """Encode k, v [N, H, D] (fp16/bf16/fp32) and store them at ``slots`` [N] of ``pages`` (slot < 0 skipped).
    k, v may also be rows [R, T, H, D] of T tokens each (any strides, last dim contiguous; slots [R * T] row by row):
    one launch reads them in place (a cache append of several sequences, ``CompressedKVCache``).

    ``fault`` (int64 [2], with ``limits``): the launch also runs ``validate.check_kv_storable``'s checks and keeps the
    smallest store fault code (``validate.store_fault_code`` is the same in PyTorch) in ``fault[0]`` unless
    ``fault[1]`` is set (the record was closed by a refused commit); nothing syncs with the host.

    Hadamard keys are rotated by one tensor-core product of k in its own dtype with the +-1 matrix sqrt(D) Pi
    (exact products, fp32 sums; the norm from ||M k||^2 = D ||k||^2) and their codes counted against the
    boundaries times sqrt(D) ||k||; other rotations use dense hi+lo split products (~fp32 accurate). Values are
    quantized from the packing's chunk tiles with one reciprocal per group. Codes differ from the reference
    only at ties (H200: 57.6 us for 16k tokens of mse_k4v3, 33.8 % of copy bandwidth). ``tuning``: launch
    knobs (``WriteTuning``).

    klt keys (``codec.klt``) are coded at ``positions`` (integers, shaped like ``slots``; required): RoPE undone with
    the angle reduced in float64, one fp32-accurate product with the encode matrix, each coefficient's nearest level
    by binary search over its thresholds; their codes differ from the reference only where a coefficient is within
    rounding of a threshold.
    """
    _check_inputs(k, v, slots, pages, layout)
    pos = _klt_positions(codec, positions, slots)
    rows = k.dim() == 4
    n = k.shape[0] * k.shape[1] if rows else k.shape[0]
    if n == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    hkv = pages.shape[1]
    if fault is not None:
        _check_fault_record(fault, k, limits)
    checked = limits if fault is not None else None
    opts = (id(codec), layout.block_size, k.device, k.dtype, v.dtype, hkv, tuning, checked)
    setup = _SETUPS.get(opts)
    if setup is None or setup.codec is not codec:
        setup = _SETUPS[opts] = _setup(codec, layout, k.device, k.dtype, v.dtype, hkv, tuning, checked)
    chosen = tuning.block_t is None
    block_t = tuning.block_t or _FITTED_BLOCK_T.get(setup.fit_key, default_block_t(layout.head_dim))
    args = (
        k,
        v,
        slots,
        pages,
        setup.keys,
        setup.values,
        slots if fault is None else fault,
        pos,
        setup.klt_args,
        setup.sqrt_d,
        n,
        k.stride(-3),
        k.stride(-2),
        v.stride(-3),
        v.stride(-2),
        layout.page_bytes,
        setup.klt_scale,
        k.shape[1] if rows else n,  # rows: tokens per row and the row strides
        k.stride(0) if rows else 0,
        v.stride(0) if rows else 0,
    )
    while True:
        try:
            grid = (triton.cdiv(n, block_t), hkv)
            maxnreg = tuning.maxnreg
            if maxnreg is None and checked is not None:
                maxnreg = setup.check_register_cap(grid, args, block_t, rows, tuning.num_warps)
            _LAUNCH(
                grid,
                args,
                setup.constexprs(block_t, rows),
                (setup.serial, block_t, rows),
                num_warps=tuning.num_warps,
                maxnreg=maxnreg,
            )
            break
        except OutOfResources:  # raised at compile time, before anything is written
            if block_t <= 16:
                raise
            block_t //= 2
    if chosen:
        _FITTED_BLOCK_T[setup.fit_key] = block_t


_LAUNCH = FastLauncher(_compress_write_kernel)
# The write setups (this launch's plans) by everything they bake in. ``ops.write``'s callers (the cache, the vLLM
# backend) pass tensors, not setups, so this stands in for an owner; an entry is taken only while its codec is the
# caller's (an id() can be reused).
_SETUPS: dict = {}
_SERIAL = itertools.count()


@dataclass
class _WriteSetup:
    """One write configuration (codec, device, dtypes, heads, knobs): its device constants and compile-time
    bundles, made once (cached by ``compress_write``)."""

    codec: KVCodec
    keys: tuple  # the kernel's ``keys``: (Pi, S, W = S Pi^T as fp16 (hi, lo) pairs, key codebook, its boundaries,
    # (sqrt(D) Pi)^T in k's dtype (SIGN_MMA > 0) or a placeholder)
    values: tuple  # the kernel's ``values``: (Pi_v as an fp16 (hi, lo) pair, the value codebook's boundaries)
    sqrt_d: float  # sqrt(D) rounded to fp32, as the reference divides by it
    page: tuple  # the ``PageSpec`` bundle
    cfg: WriteConstexprs  # with the default tile; ``constexprs`` sets BLOCK_T
    fit_key: tuple  # key of the tile size that fit in shared memory
    klt_args: tuple  # the kernel's ``klt``: klt keys' device constants (meta, enc, mid, mean, turns), placeholders
    # for other keys
    klt_scale: float  # klt keys: RoPE's attention scaling (1.0 otherwise)
    klt_bundle: tuple  # the ``KltSpec`` bundle
    serial: int = field(default_factory=lambda: next(_SERIAL))  # the launch key (an id() could be reused)
    bundles: dict = field(default_factory=dict)  # BLOCK_T -> constexpr kwargs
    caps: dict = field(default_factory=dict)  # (BLOCK_T, rows) -> register cap of the checked kernel

    def constexprs(self, block_t: int, rows: bool, check: bool | None = None) -> dict:
        """The launch's constexpr kwargs (PAGE, CFG) at ``block_t`` tokens per program, for row input or not
        (``check=False``: those of the same write without the store checks)."""
        key = (block_t, rows, check)
        kw = self.bundles.get(key)
        if kw is None:
            cfg = replace(self.cfg, BLOCK_T=block_t, ROWS=rows)
            cfg = cfg if check is None else replace(cfg, CHECK=check)
            kw = self.bundles[key] = dict(PAGE=self.page, CFG=constexpr_bundle(cfg), KLT=self.klt_bundle)
        return kw

    def check_register_cap(self, grid: tuple, args: tuple, block_t: int, rows: bool, num_warps: int) -> int | None:
        """Registers per thread the checked kernel may use and still keep as many programs per SM as the kernel
        without the checks (compiled and loaded once on CUDA to read its count; None elsewhere): the checks add a
        few live values and a rare path, and crossing 128 registers at 8 warps would halve the programs per SM
        (offline sm_90, mse_k4v3: 128 -> 143 uncapped, 128 with the cap and no spills)."""
        key = (block_t, rows)
        if key not in self.caps:
            cap = None
            if not INTERPRET and args[0].is_cuda:
                plain = _LAUNCH.compile(grid, args, self.constexprs(block_t, rows, check=False), num_warps=num_warps)
                plain.run  # noqa: B018  loads the binary: registers per thread are known from then on
                cap = _register_cap(resident_programs(plain, num_warps, args[0].device), num_warps)
            self.caps[key] = cap
        return self.caps[key]


def _register_cap(programs: int, num_warps: int) -> int:
    """The most registers per thread (a multiple of 8, <= 255) at which ``programs`` programs of ``num_warps`` warps
    still fit an SM's register file (the allocation model of ``_launch.resident_programs``)."""
    for regs in range(255, 7, -1):
        if regs % 8 and regs != 255:
            continue
        warp_regs = -(-regs * 32 // 256) * 256
        if 4 * (16384 // warp_regs) // num_warps >= programs:
            return regs
    return 8


def _klt_positions(codec: KVCodec, positions: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    """The positions the kernel reads: klt keys' ``positions`` flattened to one integer per slot (int32 or int64);
    the slots as a placeholder for other keys (not read)."""
    if codec.key_coder is None:
        return slots
    if positions is None:
        raise ShapeError("klt keys are coded at their positions: pass positions (one per slot)")
    expect_same_device(slots=slots, positions=positions)
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise DTypeError(f"positions: expected integers, got {positions.dtype}")
    if positions.numel() != slots.numel():
        raise ShapeError(f"positions: expected {slots.numel()} (one per slot), got {tuple(positions.shape)}")
    pos = positions.reshape(-1)
    return (pos if pos.dtype in (torch.int32, torch.int64) else pos.long()).contiguous()


def _check_fault_record(fault: torch.Tensor, k: torch.Tensor, limits: StoreLimits | None) -> None:
    """Named errors for a fault record the kernel cannot write, or one without bounds."""
    if limits is None:
        raise ArgTypeError("fault: the store checks need their bounds, got limits=None")
    if fault.dtype != torch.int64 or fault.shape != (2,) or fault.device != k.device:
        raise ShapeError(
            f"fault: expected int64 [2] on {k.device}, got {fault.dtype} {tuple(fault.shape)} on {fault.device}"
        )
    if k.shape[-2] > FAULT_MAX_HEADS or k.shape[-1] > FAULT_MAX_COORDS:
        raise ShapeError(
            f"k: the store fault code holds at most {FAULT_MAX_HEADS} KV heads and {FAULT_MAX_COORDS} "
            f"coordinates, got {tuple(k.shape)}"
        )


def _setup(
    codec: KVCodec,
    layout: PagedLayout,
    device: torch.device,
    dtype: torch.dtype,
    v_dtype: torch.dtype,
    hkv: int,
    tuning: WriteTuning,
    limits: StoreLimits | None,
) -> _WriteSetup:
    spec, page = page_spec(layout, codec)
    consts = codec_constants(codec, device)
    # 1: one exact product of k with sqrt(D) Pi; 2: fp32 keys, the unit vector split hi + lo; 0: dense split products
    sign_mode = (1 if dtype != torch.float32 else 2) if hadamard_rotation(spec, codec) else 0
    signs = (
        _sign_matrix_t(codec, device, torch.float16 if dtype == torch.float32 else dtype)
        if sign_mode
        else consts["hsigns"]
    )
    sqrt_d = float(torch.tensor(math.sqrt(layout.head_dim), dtype=torch.float32))  # the reference divides by this
    klt = klt_constants(codec, device)
    if codec.key_coder is not None:
        klt_args = (klt["meta"], klt["enc"], klt["mid"], klt["mean"], klt["turns"])
        klt_steps = int(codec.key_coder.t.bits.max())
    else:  # placeholders of the same dtypes (never read)
        meta, _, _, mean, turns, _ = klt["read"]
        klt_args, klt_steps = (meta, mean, mean, mean, turns), 0
    cfg = WriteConstexprs(
        HKV=hkv,
        KCWP=max(16, next_pow2(spec.KCW)),
        CHP=max(16, next_pow2(spec.CH)),
        VCWP=max(16, next_pow2(spec.VCW)),
        SIGN_MMA=sign_mode,
        SPLIT_SKETCH=tuning.exact_signs or spec.KB > 2,
        SYM_SEARCH=1 <= spec.KB <= 4 and _symmetric(consts["bounds"]),
        V_FP16=v_dtype == torch.float16,
        BLOCK_T=default_block_t(layout.head_dim),
        INTERP=INTERPRET,
        CHECK=limits is not None,
        KLT_STEPS=klt_steps,
        KCBP=max(16, next_pow2(spec.KCB)),
        KLT_CW=min(KLT_COEFFS_PER_STEP, spec.DP),
        KLT_DOT="ieee" if INTERPRET else tuning.klt_precision,
    )
    if limits is not None:
        # |k| per element only where the norm cannot tell: raw keys, or inputs that can exceed the bound (an fp16
        # input is within 65504 whenever it is finite)
        wide = dtype != torch.float16 and limits.k_abs < FP32_MAX
        cfg = replace(
            cfg,
            K_ABS=limits.k_abs,
            K_ELEMS=spec.KEY_MODE in (KEY_RAW, KEY_KLT) or wide,  # klt keys have no norm that tells
            V_ABS=limits.v_abs,
            KEY_NORM=limits.key_norm,
            VALUE_NORM=limits.value_norm,
            VALUE_GROUP=limits.value_group,
        )
    fit_key = (
        layout.fmt,
        layout.head_dim,
        str(device),
        tuning.exact_signs,
        tuning.num_warps,
        sign_mode,
        v_dtype == torch.float16,
        limits is not None,
    )
    klt_scale = klt["scale"] if codec.key_coder is not None else 1.0
    keys = (*consts["write_mats"], consts["codebook"], consts["bounds"], signs)
    values = (consts["vwrite"], consts["vbounds"])
    return _WriteSetup(codec, keys, values, sqrt_d, page, cfg, fit_key, klt_args, klt_scale, klt["bundle"])


def _sign_matrix_t(codec: KVCodec, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(sqrt(D) Pi)^T = (H diag(s))^T of a Hadamard rotation: entries +-1, exact in fp16 and bf16."""
    d = codec.head_dim
    m = (codec.key_rotation.matrix64() * math.sqrt(d)).round()
    if not bool((m.abs() == 1).all()):
        raise AssertionError("a Hadamard rotation times sqrt(D) has +-1 entries")
    return m.T.contiguous().to(device=device, dtype=dtype)


def _symmetric(bounds: torch.Tensor) -> bool:
    """True when the decision boundaries mirror about an exact 0 (every Lloyd-Max and uniform codebook)."""
    b = bounds.cpu()
    return b.numel() % 2 == 1 and bool(b[b.numel() // 2] == 0) and torch.equal(b, -b.flip(0))


def hadamard_rotation(spec: PageSpec, codec: KVCodec) -> bool:
    """True when keys are rotated by a randomized Hadamard matrix (D a power of two whose key chunks are whole
    power-of-two tiles): the sign-matrix product applies; otherwise the kernel rotates with the dense hi+lo
    split products."""
    rot = codec.key_rotation
    return (
        spec.KEY_MODE != KEY_RAW
        and rot is not None
        and rot.kind == "hadamard"
        and spec.D == spec.DP
        and spec.KCW == next_pow2(spec.KCW)
        and spec.KCW >= 16
    )
