"""Which Triton specializations a run compiles: an opt-in recorder of ``FastLauncher`` launches (also under the CPU
interpreter, where nothing compiles), so a test can check that the vLLM warm-up compiles every kernel variant a
first request needs.

A key is derived the way Triton 3.6's ``JITFunction`` keys its per-device kernel cache (``create_function_from_
signature`` + ``native_specialize_impl`` with the NVIDIA backend's ``BaseBackend`` rules): each constexpr's value;
for other arguments ``None`` -> constexpr None, bool -> u1, float -> fp32 (no value specialization), int == 1 ->
constexpr 1, other ints by type (i32 / i64 / u64 by range) and whether they are divisible by 16 ("D"), tensors by
pointer dtype and whether the data pointer is 16-byte aligned ("D"), tuples element-wise; plus the launch options
(num_warps, num_stages, maxnreg). Two launches with equal keys share one compile on the GPU; different keys are
different compiles. No kernel here declares ``do_not_specialize`` or typed (annotated) runtime parameters; a
kernel that does is refused rather than keyed wrongly.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ..attention.extras import AttentionExtras
from ..codec.kv import KVCodec
from ..errors import ConfigError

# torch dtype -> Triton's pointer type name (triton.runtime.jit's type canonicalisation)
_TRITON_TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.bool: "i1",
}


@dataclass(frozen=True)
class SpecKey:
    """One compile of one kernel: its name, every parameter's (type, specialization) and the launch options."""

    kernel: str
    params: tuple[tuple[str, object], ...]  # (parameter name, Triton's specialization of its argument)
    options: tuple[tuple[str, object], ...]  # (num_warps, num_stages, maxnreg)

    def differences(self, other: SpecKey) -> list[str]:
        """The fields where ``other`` (same kernel) differs from this key, as 'name: ours vs theirs'."""
        mine, theirs = dict(self.params + self.options), dict(other.params + other.options)
        return [f"{n}: {_short(mine.get(n))} vs {_short(theirs.get(n))}" for n in mine if mine[n] != theirs.get(n)]


def arg_specialization(arg: object) -> object:
    """Triton's (type, specialization) of one non-constexpr argument."""
    if arg is None:
        return ("constexpr", None)
    if isinstance(arg, bool):
        return ("u1", None)
    if isinstance(arg, int):
        if arg == 1:
            return ("constexpr", 1)
        div = "D" if arg % 16 == 0 else ""
        if -(2**31) <= arg < 2**31:
            return ("i32", div)
        return ("u64", div) if 2**63 <= arg < 2**64 else ("i64", div)
    if isinstance(arg, float):
        return ("fp32", None)
    if isinstance(arg, torch.Tensor):
        return ("*" + _TRITON_TYPES[arg.dtype], "D" if arg.data_ptr() % 16 == 0 else "")
    if isinstance(arg, tuple):
        specs = [arg_specialization(a) for a in arg]
        return (tuple(s[0] for s in specs), tuple(s[1] for s in specs))  # type: ignore[index]
    raise ConfigError(f"specialization key: no Triton rule for an argument of type {type(arg).__name__}")


def layer_variant(codec: KVCodec, extras: AttentionExtras, device: torch.device) -> tuple:
    """What of one layer's codec and extras the kernels' launch keys see beyond its page layout and the step's
    shapes: the compile-time facts of its klt transform (``KltSpec``: per layer, from its calibrated bit
    allocation), the extras' constexpr flags (``_masking.extras_flags``) and the sliding window's int
    specialization (the window is an int argument: keyed on == 1 and % 16, not on its value). The soft cap is an
    fp32 argument and the sinks an fp32 copy: neither's value is keyed. Layers of one variant and layout compile
    the same kernels for the same steps; layers of two variants do not."""
    from ._common import klt_constants
    from ._masking import extras_flags

    klt = klt_constants(codec, device).get("spec") if codec.key_coder is not None else None
    window = arg_specialization(extras.sliding_window) if extras.sliding_window is not None else None
    return klt, tuple(sorted(extras_flags(extras).items())), window


def spec_key(kernel, args: tuple, constexprs: dict, options: dict) -> SpecKey:
    """The key Triton compiles ``kernel`` (a ``@triton.jit`` function, or the interpreter's stand-in) under for
    positional ``args``, constexpr keywords ``constexprs`` and launch ``options``."""
    fn = getattr(kernel, "fn", kernel)
    sig = inspect.signature(fn)
    params: list[tuple[str, object]] = []
    pos = iter(args)
    for p in sig.parameters.values():
        annotation = "" if p.annotation is inspect.Parameter.empty else str(p.annotation)
        constexpr = "constexpr" in annotation
        if annotation and not constexpr:
            raise ConfigError(f"{fn.__name__}: typed parameter {p.name} ({annotation}) is not keyed here")
        if p.name in constexprs:
            params.append((p.name, ("constexpr", constexprs[p.name])))
            continue
        value = next(pos, p.default)
        if value is inspect.Parameter.empty:
            raise ConfigError(f"{fn.__name__}: no argument for parameter {p.name}")
        params.append((p.name, ("constexpr", value) if constexpr else arg_specialization(value)))
    if getattr(kernel, "do_not_specialize", None) or getattr(kernel, "do_not_specialize_on_alignment", None):
        raise ConfigError(f"{fn.__name__}: do_not_specialize parameters are not keyed here")
    opts = tuple((n, options.get(n)) for n in ("num_warps", "num_stages", "maxnreg"))
    return SpecKey(f"{fn.__module__}.{fn.__qualname__}", tuple(params), opts)


class Recorder:
    """The specialization keys launched (or compiled) while it is active, in first-seen order."""

    def __init__(self, launch: bool) -> None:
        self.launch = launch
        self.keys: dict[SpecKey, int] = {}  # key -> launches

    def add(self, key: SpecKey) -> None:
        """Count one launch of ``key``."""
        self.keys[key] = self.keys.get(key, 0) + 1

    def missing_from(self, have: Iterable[SpecKey]) -> list[SpecKey]:
        """The keys recorded here that ``have`` lacks."""
        known = set(have)
        return [k for k in self.keys if k not in known]


_ACTIVE: list[Recorder] = []


def active() -> Recorder | None:
    """The innermost active recorder (None when recording is off: the launcher's only cost then)."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def record(launch: bool = True) -> Iterator[Recorder]:
    """Record every ``FastLauncher`` launch's specialization key; ``launch=False`` records without running the
    kernels (outputs stay unwritten: for finding keys of shapes too large for the interpreter)."""
    rec = Recorder(launch)
    _ACTIVE.append(rec)
    try:
        yield rec
    finally:
        _ACTIVE.remove(rec)


def describe_missing(missing: Iterable[SpecKey], have: Iterable[SpecKey]) -> str:
    """One line per missing key: its kernel and how it differs from the closest key of ``have`` (same kernel)."""
    pool = list(have)
    lines = []
    for key in missing:
        same = [h for h in pool if h.kernel == key.kernel]
        if not same:
            lines.append(f"{key.kernel}: never compiled")
            continue
        near = min(same, key=lambda h: len(key.differences(h)))
        lines.append(f"{key.kernel.rsplit('.', 1)[-1]}: {'; '.join(key.differences(near))} (request vs warm-up)")
    return "\n".join(lines)


def _short(value: object) -> str:
    """A specialization as short text (a constexpr bundle's repr can be long)."""
    text = repr(value)
    return text if len(text) <= 160 else text[:157] + "..."
