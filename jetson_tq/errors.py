"""Named errors: each says what was expected and what was given, so bad input never runs silently."""

from __future__ import annotations


class JetsonTQError(Exception):
    """Base class of every error jetson-tq raises on purpose."""


class FormatError(JetsonTQError, ValueError):
    """A KV format is impossible (bit width, group size, head dim, mode)."""


class ConfigError(JetsonTQError, ValueError):
    """A YAML config has an unknown key, a bad value, or does not fit the model."""


class ShapeError(JetsonTQError, ValueError):
    """A tensor has the wrong rank or size."""


class DTypeError(JetsonTQError, TypeError):
    """A tensor has a dtype the operation does not accept."""


class DeviceError(JetsonTQError, ValueError):
    """Tensors that must share a device do not, or a needed device is missing."""


class ValueRangeError(JetsonTQError, ValueError):
    """A tensor holds NaN/inf, or a value its storage dtype cannot hold (it would decode to NaN/inf)."""


class CapacityError(JetsonTQError, ValueError):
    """A size asked for (tokens, batch, heads, a rotation's dim) needs more memory than the device has free."""


class ArgTypeError(JetsonTQError, TypeError):
    """An argument has the wrong Python type (a list where a tensor belongs, a float where an int does)."""


class UnsupportedPlatformError(JetsonTQError, RuntimeError):
    """The platform (GPU, JetPack, vLLM version) cannot run what was asked."""


class UnsupportedModelError(UnsupportedPlatformError, ValueError):
    """The model cannot be served as asked: its architecture, an attention layer's variant (refused by
    TurboQuantCache, or by the vLLM backend where stock attention cannot take the layer either), its RoPE for a
    calibration, or the generation mode. An UnsupportedPlatformError (what this install can serve) and a ValueError
    (the model given), so a caller catching either still catches it."""


class MissingComponentError(JetsonTQError, RuntimeError):
    """An optional part of jetson-tq (vLLM integration, Triton kernels, jtop) is not in this build."""


def expect_tensor(name: str, value) -> None:
    """Raise ArgTypeError unless ``value`` is a torch.Tensor, DeviceError unless it lives on the CPU or a CUDA GPU."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise ArgTypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.device.type not in ("cpu", "cuda"):  # a meta tensor has no data: every later step would fail on it
        raise DeviceError(f"{name}: expected a tensor on the CPU or a CUDA GPU, got one on {value.device}")


def expect_int(name: str, value, lo: int | None = 0, hi: int | None = None) -> int:
    """Raise ArgTypeError unless ``value`` is an int (not a bool), ValueRangeError unless lo <= value <= hi
    (``lo=None``: the type only)."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgTypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
    if lo is None:
        return int(value)
    if int(value) < lo or (hi is not None and int(value) > hi):
        want = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueRangeError(f"{name}: expected an integer {want}, got {value}")
    return int(value)


def expect_bool(name: str, value) -> bool:
    """Raise ArgTypeError unless ``value`` is True or False (a string such as "no" would read as True)."""
    if not isinstance(value, bool):
        raise ArgTypeError(f"{name}: expected True or False, got {type(value).__name__} {value!r}")
    return value


def expect_rank(name: str, tensor, ranks: tuple[int, ...]) -> None:
    """Raise ShapeError unless ``tensor.dim()`` is one of ``ranks``."""
    expect_tensor(name, tensor)
    if tensor.dim() not in ranks:
        want = " or ".join(str(r) for r in ranks)
        raise ShapeError(f"{name}: expected a {want}-d tensor, got shape {tuple(tensor.shape)}")


def expect_last_dim(name: str, tensor, size: int) -> None:
    """Raise ShapeError unless the last dimension of ``tensor`` is ``size``."""
    expect_tensor(name, tensor)
    if tensor.dim() == 0 or tensor.shape[-1] != size:
        raise ShapeError(f"{name}: expected last dimension {size}, got shape {tuple(tensor.shape)}")


def expect_float(name: str, tensor) -> None:
    """Raise DTypeError unless ``tensor`` is fp32, fp16 or bf16."""
    import torch

    expect_tensor(name, tensor)
    if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise DTypeError(f"{name}: expected float32, float16 or bfloat16, got {tensor.dtype}")


def expect_same_device(**tensors) -> None:
    """Raise DeviceError unless all given tensors live on one device."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise DeviceError(f"tensors must share one device, got {listing}")
