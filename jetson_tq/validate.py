"""Input checks the public API runs at its entry points, so bad numbers fail loudly instead of decoding to NaN.

Policy (docs/robustness.md):
- ``CompressedKVCache(validate=True)`` (the default) rejects, at ``append``, K/V holding NaN/inf and
  K/V whose stored fields would overflow their dtype: the fp16 recent buffer, fp16 key/value norms,
  the fp16 scale/zero of value groups, raw fp16 fields of a float32 cache. The error names the
  sequence, KV head and position. Attention over such a cache rejects a non-finite query.
  On the reference path ``check_kv_storable`` runs before the write; on the kernel path the compress-on-write
  kernel computes the same checks and records a store fault code (``store_fault_code`` is its PyTorch reference,
  ``store_fault_error`` its message), with no host sync. ``validate=False`` skips these data checks.
- Always checked (host-side, free): Python types, ``softmax_scale`` (finite, > 0), seeds.
Bytes per token are unchanged: values that do not fit the format are refused, never stored wider.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import cast

import torch

from .errors import (
    ArgTypeError,
    CapacityError,
    DeviceError,
    DTypeError,
    ValueRangeError,
    expect_bool,
    expect_int,
    expect_same_device,
    expect_tensor,
)
from .format import KVFormat

FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504
FP32_MAX = float(torch.finfo(torch.float32).max)  # a bound x <= FP32_MAX means "finite" (NaN and inf fail it)
#: prod keys also store ||r|| = ||k|| * ||k/||k|| - k_mse||; that factor is <= 1.23 for any input we tried
#: (one-hot vectors in the rotated basis, D = 64/128, every bit width), so key norms get half the range.
PROD_RNORM_HEADROOM = 2.0
SEED_MAX = 2**63 - 1


def check_seed(name: str, seed: object) -> int:
    """An int seed in [0, 2**63 - 1] (no float truncation, no negative seed, as ``KVFormat`` requires)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ArgTypeError(f"{name}: expected an integer seed in [0, {SEED_MAX}], got {type(seed).__name__} {seed!r}")
    if not 0 <= int(seed) <= SEED_MAX:
        raise ValueRangeError(f"{name}: expected an integer seed in [0, {SEED_MAX}], got {seed}")
    return int(seed)


def check_softmax_scale(scale: object) -> None:
    """None, or a finite number > 0 (a NaN or negative scale silently breaks the softmax)."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ArgTypeError(f"softmax_scale: expected a float > 0 or None, got {type(scale).__name__} {scale!r}")
    if not (math.isfinite(scale) and float(scale) > 0):
        raise ValueRangeError(f"softmax_scale: expected a finite float > 0 or None, got {scale}")


def check_cache_args(
    fmt: object,
    num_kv_heads: object,
    head_dim: object,
    batch_size: object,
    device: object,
    seed: object,
    initial_capacity: object,
    block_size: object,
    validate: object,
) -> torch.device:
    """Python types and ranges of ``CompressedKVCache(...)``'s arguments; returns the torch.device."""
    if not isinstance(fmt, KVFormat):
        raise ArgTypeError(f"fmt: expected a KVFormat, got {type(fmt).__name__}")
    for name, value, lo in (
        ("num_kv_heads", num_kv_heads, 1),
        ("head_dim", head_dim, 2),
        ("batch_size", batch_size, 1),
        ("initial_capacity", initial_capacity, 0),
        ("block_size", block_size, 1),
    ):
        expect_int(name, value, lo)
    expect_bool("validate", validate)
    if seed is not None:
        check_seed("seed", seed)
    return check_device(device)


def check_device(device: object) -> torch.device:
    """A torch.device that exists here (DeviceError for 'bogus', or 'cuda' without a CUDA GPU)."""
    if not isinstance(device, (str, torch.device)):
        raise ArgTypeError(f"device: expected a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise DeviceError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r} ({e})") from e
    if dev.type not in ("cpu", "cuda"):
        raise DeviceError(
            f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r} (a {dev.type} device holds no "
            f"data jetson-tq can compute on)"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device: {device!r} asked for, but torch sees no CUDA GPU here")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise DeviceError(f"device: expected cuda:0..cuda:{torch.cuda.device_count() - 1}, got {device!r}")
    return dev


def _host_free_bytes() -> int | None:
    """RAM (and swap) that can still be allocated here: psutil's ``available`` plus free swap; None when unknown."""
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available + psutil.swap_memory().free)


def free_bytes(device: torch.device) -> int | None:
    """Bytes an allocation on ``device`` can still get (None when unknown): for CUDA the driver's free memory plus
    what torch's caching allocator holds unused, on an integrated GPU (Jetson) at least the host's available RAM
    (``mem_get_info`` there leaves out reclaimable page cache)."""
    if device.type == "cpu":
        return _host_free_bytes()
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if torch.cuda.get_device_properties(device).is_integrated:
        free = max(free, _host_free_bytes() or 0)
    return int(free)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units up to EiB, for messages)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} EiB"


def check_allocatable(what: str, nbytes: int, device: torch.device) -> None:
    """Raise CapacityError before allocating ``nbytes`` on ``device`` when that is more than it has free (a huge
    size would otherwise fail deep in the allocator, or be granted and then take the machine's memory)."""
    free = free_bytes(device)
    if free is not None and nbytes > free:
        raise CapacityError(
            f"{what}: needs {human_bytes(nbytes)} ({nbytes:,} bytes) on {device}, expected at most "
            f"the {human_bytes(free)} free there"
        )


def _first_index(bad: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in bad.nonzero()[0])


def _nonfinite_index(t: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first NaN/inf element of ``t`` (None when all are finite or ``t`` is not floating)."""
    if not t.dtype.is_floating_point or bool(torch.isfinite(t).all()):
        return None
    return _first_index(~torch.isfinite(t))


def _where(index: tuple[int, ...], seqs: list[int], starts: list[int], batched: bool) -> str:
    """'sequence b, KV head h, position p' for an index [B?, H, T, ...] of the appended chunk."""
    b, rest = (index[0], index[1:]) if batched else (0, index)
    return f"sequence {seqs[b]}, KV head {rest[0]}, position {starts[b] + rest[1]}"


def check_finite(name: str, t: torch.Tensor, seqs: list[int], starts: list[int], batched: bool) -> None:
    """Raise ValueRangeError naming the first NaN/inf element of ``t`` ([B, H, T, D] or [H, T, D])."""
    idx = _nonfinite_index(t)
    if idx is not None:
        raise ValueRangeError(
            f"{name}: expected finite values, got {t[idx].item()} at "
            f"{_where(idx, seqs, starts, batched)}, coordinate {idx[-1]}"
        )


def _check_at_most(name: str, what: str, values: torch.Tensor, limit: float, hint: str, seqs, starts, batched) -> None:
    """``values`` [B?, H, T, ...] must stay <= ``limit``; else name where, by how much, and what to do."""
    bad = values > limit
    if bool(bad.any()):
        idx = _first_index(bad)
        raise ValueRangeError(
            f"{name}: expected {what} <= {limit:.6g} (what its fp16 storage holds), got "
            f"{values[idx].item():.6g} at {_where(idx, seqs, starts, batched)}; {hint}"
        )


#: The checks in the order ``check_kv_storable`` reports them (its first failing one names the error); the store
#: fault code of the compress-on-write kernel carries the same rank.
(
    RANK_K_FINITE,
    RANK_V_FINITE,
    RANK_K_ABS,
    RANK_V_ABS,
    RANK_KEY_NORM,
    RANK_VALUE_NORM,
    RANK_GROUP_MIN,
    RANK_GROUP_SCALE,
) = range(8)
_NORM_HINT = "use a format with norm_dtype float32 (4 more bytes per token and norm) or scale the input down"
_GROUP_HINT = "group scale and zero are stored as fp16: scale the values down or use value mode mse/fp16"


def _limit_checks(
    fmt: KVFormat, cache_dtype: torch.dtype, raw_dtype: torch.dtype
) -> list[tuple[int, str, str, float, str]]:
    """(rank, tensor name, quantity, limit, hint) of every fp16-stored quantity, in the order they are checked."""
    out = []
    for rank, name, mode in ((RANK_K_ABS, "k", fmt.key_mode), (RANK_V_ABS, "v", fmt.value_mode)):
        if cache_dtype == torch.float16 or (mode == "fp16" and raw_dtype == torch.float16):
            hint = (
                "the fp16 cache's recent buffer holds them as fp16; use a bfloat16 cache"
                if cache_dtype == torch.float16
                else "a float32 cache stores fp16-mode fields as fp16"
            )
            out.append((rank, name, "|value|", FP16_MAX, hint))
    if fmt.key_mode in ("prod", "mse") and fmt.norm_dtype == "float16":
        limit = FP16_MAX / (PROD_RNORM_HEADROOM if fmt.key_mode == "prod" else 1.0)
        out.append((RANK_KEY_NORM, "k", "key norm", limit, _NORM_HINT))
    if fmt.value_mode == "mse" and fmt.norm_dtype == "float16":
        out.append((RANK_VALUE_NORM, "v", "value norm", FP16_MAX, _NORM_HINT))
    if fmt.value_mode == "group":
        out.append((RANK_GROUP_MIN, "v", "|group minimum|", FP16_MAX, _GROUP_HINT))
        out.append((RANK_GROUP_SCALE, "v", "group scale (max - min) / levels", FP16_MAX, _GROUP_HINT))
    return out


def _field_limits(
    k: torch.Tensor, v: torch.Tensor, fmt: KVFormat, cache_dtype: torch.dtype, raw_dtype: torch.dtype
) -> list[tuple[str, str, torch.Tensor, float, str]]:
    """(tensor name, quantity, per-token values [B?, H, T], limit, hint) for every fp16-stored quantity."""
    kf, vf = k.float(), v.float()
    out = []
    for rank, name, what, limit, hint in _limit_checks(fmt, cache_dtype, raw_dtype):
        if rank in (RANK_K_ABS, RANK_V_ABS):
            values = (kf if name == "k" else vf).abs().amax(dim=-1)
        elif rank in (RANK_KEY_NORM, RANK_VALUE_NORM):
            values = (kf if name == "k" else vf).norm(dim=-1)
        else:
            g = vf.unflatten(-1, (-1, fmt.value_group_for(vf.shape[-1])))
            lo, hi = g.amin(dim=-1), g.amax(dim=-1)
            values = (
                lo.abs().amax(dim=-1)
                if rank == RANK_GROUP_MIN
                else ((hi - lo) / ((1 << fmt.value_bits) - 1)).amax(dim=-1)
            )
        out.append((name, what, values, limit, hint))
    return out


#: Tokens checked per step: bounds the check's fp32 temporaries (a few MB) at any append size.
CHECK_CHUNK_ELEMENTS = 1 << 20


def _storable_flag(
    k: torch.Tensor, v: torch.Tensor, fmt: KVFormat, cache_dtype: torch.dtype, raw_dtype: torch.dtype
) -> torch.Tensor:
    """One device bool: every element finite and every stored quantity within its limit (token chunks at a time)."""
    t = k.shape[-2]
    step = max(1, CHECK_CHUNK_ELEMENTS // max(1, k[..., :1, :].numel()))
    ok = torch.ones((), dtype=torch.bool, device=k.device)
    for i in range(0, t, step):
        kc, vc = k[..., i : i + step, :], v[..., i : i + step, :]
        ok &= torch.isfinite(kc).all() & torch.isfinite(vc).all()
        for _, _, values, limit, _ in _field_limits(kc, vc, fmt, cache_dtype, raw_dtype):
            ok &= (values <= limit).all()
    return ok


def check_kv_storable(
    k: torch.Tensor,
    v: torch.Tensor,
    fmt: KVFormat,
    cache_dtype: torch.dtype,
    raw_dtype: torch.dtype,
    seqs: list[int],
    starts: list[int],
) -> None:
    """Reject K/V [B, H, T, D] or [H, T, D] that are non-finite or overflow a field of ``fmt`` (see module doc).

    ``seqs`` / ``starts``: the sequence id and first position of each leading row, for the message.
    All conditions are reduced to one flag first (token chunks at a time, so the check's memory is bounded), so a
    good append costs one device sync; the details are computed only on failure.
    """
    if bool(_storable_flag(k, v, fmt, cache_dtype, raw_dtype)):
        return
    where = (seqs, starts, k.dim() == 4)
    check_finite("k", k, *where)
    check_finite("v", v, *where)
    for name, what, values, limit, hint in _field_limits(k, v, fmt, cache_dtype, raw_dtype):
        _check_at_most(name, what, values, limit, hint, *where)


# ------------------------------------------------------------------------ the same checks on the device
#: A store fault as the compress-on-write kernel records it: one int64, the smallest of a launch kept
#: (``tl.atomic_min``), FAULT_NONE when there is none: rank << 60 | slot << 23 | KV head << 13 | coordinate << 2 |
#: class (0 nan, 1 +inf, 2 -inf for the finiteness ranks; 3 for a bound). The smallest code is the first failing
#: check in ``check_kv_storable``'s order, then the first element in (slot, KV head, coordinate) order.
FAULT_NONE = 2**63 - 1
FAULT_RANK_SHIFT, FAULT_SLOT_SHIFT, FAULT_HEAD_SHIFT, FAULT_COORD_SHIFT = 60, 23, 13, 2
FAULT_MAX_SLOTS, FAULT_MAX_HEADS, FAULT_MAX_COORDS = 1 << 37, 1 << 10, 1 << 11
FAULT_CLASS_BOUND = 3


@dataclass(frozen=True)
class StoreLimits:
    """The bounds ``check_kv_storable`` holds K/V to, as numbers a kernel compares with (x <= bound fails for NaN; a
    bound of FP32_MAX means only "finite"). Group bounds hold |group minimum| and group scale (max - min) / levels;
    ``value_norm`` holds ||v|| of mse values."""

    k_abs: float
    v_abs: float
    key_norm: float
    value_group: float
    value_levels: int
    value_norm: float = FP32_MAX

    @staticmethod
    def of(fmt: KVFormat, cache_dtype: torch.dtype, raw_dtype: torch.dtype) -> StoreLimits:
        """The bounds of a ``fmt`` cache in ``cache_dtype`` whose raw fields are ``raw_dtype``."""
        bound = {rank: limit for rank, _, _, limit, _ in _limit_checks(fmt, cache_dtype, raw_dtype)}
        return StoreLimits(
            k_abs=bound.get(RANK_K_ABS, FP32_MAX),
            v_abs=bound.get(RANK_V_ABS, FP32_MAX),
            key_norm=bound.get(RANK_KEY_NORM, FP32_MAX),
            value_group=bound.get(RANK_GROUP_MIN, FP32_MAX),
            value_levels=(1 << fmt.value_bits) - 1,
            value_norm=bound.get(RANK_VALUE_NORM, FP32_MAX),
        )


def store_fault_code(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, fmt: KVFormat, limits: StoreLimits) -> int:
    """The store fault code of writing k, v [N, H, D] at ``slots`` [N] (slot < 0 skipped), computed in PyTorch:
    the reference of the compress-on-write kernel's device check (``kernels.compress_write``)."""
    keep = slots >= 0
    kf, vf, sl = k[keep].float(), v[keep].float(), slots[keep].long()
    if sl.numel() == 0:
        return FAULT_NONE
    n, h, d = kf.shape
    heads = torch.arange(h, device=k.device)[None, :, None]
    base = (sl[:, None, None] << FAULT_SLOT_SHIFT) | (heads << FAULT_HEAD_SHIFT)  # [N, H, 1]
    elem = base | (torch.arange(d, device=k.device) << FAULT_COORD_SHIFT)
    best = FAULT_NONE
    for rank, x in ((RANK_K_FINITE, kf), (RANK_V_FINITE, vf)):
        bad = ~torch.isfinite(x)
        if bool(bad.any()):
            cls = torch.where(torch.isnan(x), 0, torch.where(x > 0, 1, 2))
            best = min(best, int(torch.where(bad, (rank << FAULT_RANK_SHIFT) | elem | cls, FAULT_NONE).min()))
    token_bad = [(RANK_K_ABS, ~(kf.abs() <= limits.k_abs).all(-1)), (RANK_V_ABS, ~(vf.abs() <= limits.v_abs).all(-1))]
    if fmt.key_mode in ("prod", "mse"):
        token_bad.append((RANK_KEY_NORM, ~(kf.norm(dim=-1) <= limits.key_norm)))
    if fmt.value_mode == "mse":
        token_bad.append((RANK_VALUE_NORM, ~(vf.norm(dim=-1) <= limits.value_norm)))
    if fmt.value_mode == "group":
        g = vf.unflatten(-1, (-1, fmt.value_group_for(d)))
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        token_bad.append((RANK_GROUP_MIN, ~(lo.abs() <= limits.value_group).all(-1)))
        token_bad.append((RANK_GROUP_SCALE, ~((hi - lo) / limits.value_levels <= limits.value_group).all(-1)))
    for rank, bad in token_bad:
        if bool(bad.any()):
            codes = (rank << FAULT_RANK_SHIFT) | base[..., 0] | FAULT_CLASS_BOUND
            best = min(best, int(torch.where(bad, codes, FAULT_NONE).min()))
    return best


def store_fault_error(
    code: int, capacity: int, fmt: KVFormat, cache_dtype: torch.dtype, raw_dtype: torch.dtype
) -> ValueRangeError | None:
    """The named error of a store fault ``code`` of a cache whose sequence b owns slots [b * capacity, (b + 1) *
    capacity) (None for FAULT_NONE): what was expected, what was found, and where."""
    if code == FAULT_NONE:
        return None
    rank = code >> FAULT_RANK_SHIFT
    slot = (code >> FAULT_SLOT_SHIFT) & (FAULT_MAX_SLOTS - 1)
    head = (code >> FAULT_HEAD_SHIFT) & (FAULT_MAX_HEADS - 1)
    coord = (code >> FAULT_COORD_SHIFT) & (FAULT_MAX_COORDS - 1)
    where = f"sequence {slot // capacity}, KV head {head}, position {slot % capacity}"
    if rank in (RANK_K_FINITE, RANK_V_FINITE):
        got = ("nan", "inf", "-inf")[code & 3]
        name = "k" if rank == RANK_K_FINITE else "v"
        return ValueRangeError(f"{name}: expected finite values, got {got} at {where}, coordinate {coord}")
    for r, name, what, limit, hint in _limit_checks(fmt, cache_dtype, raw_dtype):
        if r == rank:
            return ValueRangeError(
                f"{name}: expected {what} <= {limit:.6g} (what its fp16 storage holds), got more at {where}; {hint}"
            )
    if rank == RANK_KEY_NORM:  # a float32 norm of finite keys past the float32 range
        return ValueRangeError(
            f"k: expected key norm <= {FP32_MAX:.6g} (what its float32 storage holds), got more "
            f"at {where}; scale the input down"
        )
    return ValueRangeError(f"k, v: store check {rank} failed at {where}")


def check_attention_inputs(q: object, cache_or_kv: object, softmax_scale: object, *chunk: tuple[str, object]) -> None:
    """Types and scale always; a finite query (and chunk K/V) when the cache was built with ``validate=True`` and the
    query is on the CPU. CUDA queries are not data-checked: that would cost a host sync per call and break CUDA graph
    capture; a NaN query only gives NaN output for that query (the cache is untouched: K/V are checked at append)."""
    expect_tensor("q", q)
    for name, t in chunk:
        expect_tensor(name, t)
    if not hasattr(cache_or_kv, "pages"):
        raise ArgTypeError(f"cache: expected a CompressedKVCache or PagedKV, got {type(cache_or_kv).__name__}")
    check_softmax_scale(softmax_scale)
    if getattr(cache_or_kv, "validate", False) and not cast(torch.Tensor, q).is_cuda:
        for name, t in (("q", q), *chunk):
            tensor = cast(torch.Tensor, t)  # expect_tensor checked it above
            idx = _nonfinite_index(tensor)
            if idx is not None:
                raise ValueRangeError(f"{name}: expected finite values, got {tensor[idx].item()} at index {idx}")


def _data_checked(q: torch.Tensor, cache_or_kv: object) -> bool:
    """Data checks run for a cache built with ``validate=True`` and a query on the CPU (see check_attention_inputs)."""
    return bool(getattr(cache_or_kv, "validate", False)) and not q.is_cuda


def check_attention_mask(mask: object, q: torch.Tensor, cache_or_kv: object) -> None:
    """``attn_mask``: a bool tensor (True = attend) or an additive float one (0 / -inf), on q's device; for validated
    CPU calls, no NaN or +inf in a float mask (the reference zeroes fully masked rows, which would hide them)."""
    expect_tensor("attn_mask", mask)
    mask = cast(torch.Tensor, mask)  # checked just above
    expect_same_device(q=q, attn_mask=mask)
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise DTypeError(f"attn_mask: expected a bool mask (True = attend) or an additive float mask, got {mask.dtype}")
    if mask.dtype.is_floating_point and _data_checked(q, cache_or_kv):
        bad = torch.isnan(mask) | (mask == math.inf)
        if bool(bad.any()):
            idx = _first_index(bad)
            raise ValueRangeError(f"attn_mask: expected finite values or -inf, got {mask[idx].item()} at index {idx}")


def check_attention_output(
    name: str, out: torch.Tensor, q: torch.Tensor, cache_or_kv: object, softmax_scale: object
) -> None:
    """For validated CPU calls: finite inputs can still overflow float32 in q . k x scale (a query of 3e38, a scale of
    1e300); name that instead of returning NaN/inf."""
    if _data_checked(q, cache_or_kv) and not bool(torch.isfinite(out).all()):
        largest = float(q.detach().abs().max()) if q.numel() else 0.0
        raise ValueRangeError(
            f"{name}: expected query . key x softmax_scale to fit float32, but the output is not "
            f"finite (largest |q| {largest:.3g}, softmax_scale {softmax_scale}); scale the query or "
            f"the softmax_scale down"
        )


def check_scores_values(qjl_signs: torch.Tensor, gamma: torch.Tensor, **floats: torch.Tensor) -> None:
    """``turboquant_scores`` data: signs exactly +1/-1, gamma (a residual norm) finite and >= 0, floats finite."""
    bad = (qjl_signs != 1) & (qjl_signs != -1)
    if bool(bad.any()):
        idx = _first_index(bad)
        raise ValueRangeError(f"qjl_signs: expected only +1 or -1, got {int(qjl_signs[idx])} at index {idx}")
    for name, t in {"gamma": gamma, **floats}.items():
        bad_at = _nonfinite_index(t)
        if bad_at is not None:
            raise ValueRangeError(f"{name}: expected finite values, got {t[bad_at].item()} at index {bad_at}")
    if bool((gamma < 0).any()):
        idx = _first_index(gamma < 0)
        raise ValueRangeError(f"gamma: expected residual norms >= 0, got {gamma[idx].item()} at index {idx}")


def orthogonality_tolerance(dtype: torch.dtype) -> float:
    """Largest |Pi Pi^T - I| entry accepted for a rotation stored in ``dtype``: 16 of its ulps at 1 (an fp16 copy of
    an exact rotation stays within ~2 ulps), at least 1e-4 for fp32 (a Haar matrix rounded to fp32: ~1e-7)."""
    return max(1e-4, 16 * torch.finfo(dtype).eps)


def check_rotation(name: str, pi: torch.Tensor) -> None:
    """``pi`` [D, D] must be orthogonal (rows orthonormal): the raw-score formula reads <Pi q, c> as the key's inner
    product only then, and a scaled or arbitrary matrix gives plausible-looking but wrong scores."""
    p64 = pi.double()
    err = (p64 @ p64.T - torch.eye(pi.shape[0], dtype=torch.float64, device=pi.device)).abs()
    worst = float(err.max()) if err.numel() else 0.0
    tol = orthogonality_tolerance(pi.dtype)
    if not worst <= tol:
        i, j = _first_index(err == err.max())
        raise ValueRangeError(
            f"{name}: expected an orthogonal rotation (Pi @ Pi.T = I within {tol:.1e} for "
            f"{pi.dtype}), got |Pi @ Pi.T - I| = {worst:.3g} at row {i}, column {j}"
        )
