"""Low-overhead kernel launches: Triton's JIT binds and specializes every argument in Python on every call
(tens of µs for a kernel with ~90 parameters); this binds the constexprs once per launch plan and then calls
the compiled kernel's C launcher directly.

The first launch of a (plan key, runtime specialization) pair goes through ``kernel[grid](...)``, which compiles
and returns the ``CompiledKernel``; later ones reuse it. The runtime specialization is what Triton itself
specializes on and may change between calls of one plan: every tensor's dtype (always part of the key: with dtypes
left out of plan keys, an fp32 query was read through the kernel compiled for fp16), whether
each tensor's data pointer is 16-byte aligned, and for each int argument whether it is 1 or a multiple of 16 (and
whether it fits int32; a tuple's fields likewise). The
caller's plan key must determine every constexpr and launch option. Under the interpreter, or while a launch
hook is installed (profilers), the plain JIT path runs.

Compiles run with Triton's JIT hooks off: a hook makes Triton serialize every constexpr to JSON first, which a
named-tuple constexpr bundle (``_common.constexpr_bundle``) cannot be, and vLLM installs one (its JIT monitor).

``specializations.record()`` (opt-in, a list check when off) sees every launch's Triton specialization key, also
under the interpreter.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
from triton import knobs

from . import specializations
from ._common import INTERPRET


def _runtime_key(args: tuple) -> tuple:
    """Per argument what Triton specializes on: a tensor's dtype and 16-byte alignment, a bool's value, an int's
    (== 1, % 16 == 0, fits int32); exact-type checks first (this runs on every launch), floats and None skipped."""
    key = []
    for a in args:
        t = type(a)
        if t is float or a is None:
            continue
        if t is torch.Tensor or (t is not int and t is not bool and isinstance(a, torch.Tensor)):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif t is bool or isinstance(a, bool):
            key.append(a)
        elif isinstance(a, int):
            key.append((a == 1, a % 16 == 0, -(2**31) <= a < 2**31))
        elif isinstance(a, tuple):  # Triton specializes a tuple argument's fields one by one
            key.append(_runtime_key(a))
    return tuple(key)


def _dtypes(args: tuple) -> tuple:
    """Every tensor argument's dtype (the key of an ``aligned`` launch, which skips ``_runtime_key``)."""
    return tuple([a.dtype for a in args if isinstance(a, torch.Tensor)])


#: called as ``hook(kernel_name, key, seconds)`` for every compile once set (``report_compiles``)
_COMPILE_HOOK: list[Callable[[str, tuple, float], None]] = []


def report_compiles(hook: Callable[[str, tuple, float], None] | None) -> None:
    """From now on, call ``hook(kernel_name, launch_key, seconds)`` after every compile a launch triggers (None: stop);
    the vLLM warm-up sets it once its compiles are done, so a specialization it missed is named in the log."""
    _COMPILE_HOOK[:] = [] if hook is None else [hook]


class FastLauncher:
    """``launch(grid, args, constexprs, plan_key, num_warps=, num_stages=, maxnreg=)`` for one ``@triton.jit``
    kernel."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._compiled: dict[tuple, tuple] = {}

    def __call__(
        self,
        grid: tuple[int, ...],
        args: tuple,
        constexprs: dict,
        plan_key: tuple,
        *,
        num_warps: int,
        num_stages: int = 1,
        maxnreg: int | None = None,
        aligned: bool | None = None,
    ) -> None:
        """``aligned=True``: the caller vouches that ``plan_key`` fixes every int argument and that every tensor's data
        pointer is 16-byte aligned (an OR of the pointers, % 16) — then no per-argument key is built; None: the
        generic per-argument key."""
        opts = _options(num_warps, num_stages, maxnreg)
        rec = specializations.active()
        if rec is not None:
            rec.add(specializations.spec_key(self.kernel, args, constexprs, opts))
            if not rec.launch:
                return
        if INTERPRET or not args[0].is_cuda or _launch_hooked():
            with compile_hooks_off():
                self.kernel[grid](*args, **constexprs, **opts)
            return
        spec = _runtime_key(args) if aligned is None else (_dtypes(args), aligned)
        key = (plan_key, num_warps, num_stages, maxnreg, spec)
        entry = self._compiled.get(key)
        if entry is None:
            start = time.perf_counter()
            with compile_hooks_off():
                compiled = self.kernel[grid](*args, **constexprs, **opts)
            for hook in _COMPILE_HOOK:
                hook(getattr(self.kernel, "__name__", str(self.kernel)), key, time.perf_counter() - start)
            names = self.kernel.arg_names
            template = [constexprs.get(n) for n in names]
            slots = [i for i, n in enumerate(names) if n not in constexprs]
            if len(slots) != len(args):  # a parameter neither passed positionally nor as a constexpr
                return
            self._compiled[key] = (compiled, template, slots)
            return
        compiled, template, slots = entry
        full = list(template)
        for i, a in zip(slots, args):
            full[i] = a
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(args[0].device.index)
        compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *full)

    def compile(
        self,
        grid: tuple[int, ...],
        args: tuple,
        constexprs: dict,
        *,
        num_warps: int,
        num_stages: int = 1,
        maxnreg: int | None = None,
    ):
        """The ``CompiledKernel`` these arguments launch (compiled now, or taken from Triton's cache; nothing runs);
        None under the interpreter."""
        opts = _options(num_warps, num_stages, maxnreg)
        rec = specializations.active()
        if rec is not None:  # a compile too (it fills Triton's cache for the launch that follows)
            rec.add(specializations.spec_key(self.kernel, args, constexprs, opts))
        if INTERPRET:
            return None
        with compile_hooks_off():
            return self.kernel.warmup(*args, grid=grid, **constexprs, **opts)


@contextlib.contextmanager
def compile_hooks_off() -> Iterator[None]:
    """Triton's JIT cache and post-compile hooks unset while our kernels compile (restored afterwards)."""
    runtime = knobs.runtime
    saved = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    runtime.jit_cache_hook = runtime.jit_post_compile_hook = None
    try:
        yield
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved


def resident_programs(compiled, num_warps: int, device: torch.device) -> int:
    """Programs of ``compiled`` that one SM holds at once: the least of what its registers, shared memory (plus the
    1 KB the driver reserves per block), warp and block slots allow. Registers are allocated per warp in units of
    256 from one of the SM's 4 sub-partitions (a quarter of the register file each): at 144 registers 3 warps fit a
    sub-partition, so 12 per SM, not 65536 // 4608 = 14 (H200: splits sized for 14 ran 1.17 waves, 646 vs
    432 us at 12). Without a GPU (offline compiles) the H100/H200 figures: 64k registers, 228 KB, 64 warps."""
    regs_sm, smem_sm, threads_sm = 65536, 233472, 2048
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        regs_sm = getattr(p, "regs_per_multiprocessor", regs_sm)
        smem_sm = getattr(p, "shared_memory_per_multiprocessor", smem_sm)
        threads_sm = getattr(p, "max_threads_per_multi_processor", threads_sm)
    warp_regs = -(-max(1, compiled.n_regs) * 32 // 256) * 256
    by_regs = 4 * ((regs_sm // 4) // warp_regs) // num_warps
    by_smem = smem_sm // (compiled.metadata.shared + 1024)
    return max(1, min(by_regs, by_smem, threads_sm // (32 * num_warps), 32))


def _options(num_warps: int, num_stages: int, maxnreg: int | None) -> dict:
    """Triton launch options; ``maxnreg`` only when a register cap is asked for."""
    opts = dict(num_warps=num_warps, num_stages=num_stages)
    return opts if maxnreg is None else dict(opts, maxnreg=maxnreg)


def _launch_hooked() -> bool:
    """True when a profiler installed launch hooks (Triton 3.6 keeps them as ``HookChain`` lists, else None)."""
    return any(getattr(h, "calls", h) for h in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))
