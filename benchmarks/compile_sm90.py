"""Compile every kernel launch of the test-sized cases for sm_90 (H200) on a machine without a GPU.

    python benchmarks/compile_sm90.py [--formats mse_k4v3,mse_k4v3u] [--d 128]

Each launcher runs on CPU tensors with Triton's driver replaced by a stub whose target is sm_90:
``kernel[grid](...)`` compiles (frontend, ptxas) and skips the launch. Catches what the CPU
interpreter cannot (constexpr rules, layouts, shared memory, register spills) at no device time, and
prints per compiled kernel: registers, stack frame (spills), shared memory and SASS instructions
(Triton's bundled cuobjdump).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

COMPILED: list[tuple[str, object]] = []
_DUMPED: list[str] = []


class _StubDriver:
    """Enough of Triton's driver for ``JITFunction.run(warmup=True)``: device 0, stream 0, target sm_90."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def _install() -> None:
    triton.runtime.driver.set_active(_StubDriver())
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        COMPILED.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = run
    from jetson_tq.kernels import _common, compress_write, hybrid_decode_plan, prefill

    for mod in (_common, compress_write, hybrid_decode_plan, prefill):
        mod.cuda_or_interpreter = lambda t: None


def _resources(kernel, sass_dir: Path | None = None, tag: str = "") -> dict:
    """Registers, stack bytes, shared bytes and SASS instruction count of a compiled kernel."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    usage = subprocess.run(
        [str(tools / "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True
    ).stdout
    sass = subprocess.run([str(tools / "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    if sass_dir is not None:  # numbered in compile order, so two trees' dumps pair up file by file
        sass_dir.mkdir(parents=True, exist_ok=True)
        _DUMPED.append(tag)
        (sass_dir / f"{len(_DUMPED):03d}_{tag}_{kernel.name}.sass").write_text(sass)
    get = lambda key: int(m.group(1)) if (m := re.search(rf"{key}:(\d+)", usage)) else -1  # noqa: E731
    return {
        "regs": get("REG"),
        "stack": get("STACK"),
        "shared": kernel.metadata.shared,
        "sass": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M)),
        "loops": _loops(sass),
    }


def _flash_dequant(kv) -> None:
    """The dequantization ``prefill_flash`` launches: token-major workspace rows, keys rotated back."""
    import torch

    from jetson_tq.kernels._common import codec_constants, page_spec
    from jetson_tq.kernels.prefill_plan import DEQUANT_TOKENS, dequantize_segment

    seg, dp = 128, page_spec(kv.layout, kv.codec)[0].DP
    wk = torch.empty(kv.batch_size * seg, kv.num_kv_heads, dp, dtype=torch.float16)
    cb = codec_constants(kv.codec, torch.device("cpu"))["codebook"]
    dequantize_segment(kv, cb, wk, torch.empty_like(wk), 0, seg, 1, 16, True, DEQUANT_TOKENS, True, unrotate_keys=True)


def _loops(sass: str) -> list[int]:
    """Instruction counts of every loop (backward branch to its target), in code order: in the attention
    kernels the first is the compressed-tile loop, the second the recent-buffer loop."""
    found = []
    for m in re.finditer(
        r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:\w+\s+)?`?\(?\.L_x_\d+\)?|"
        r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:\w+\s+)?0x([0-9a-f]+)",
        sass,
    ):
        if m.group(2):
            here, target = int(m.group(2), 16), int(m.group(3), 16)
            if target < here:
                found.append((target, (here - target) // 16 + 1))
    return [n for _, n in sorted(found)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="mse_k4v3,mse_k4v3u,blog_k3v2")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--ops", default="decode,prefill,compress,append", help="which launches to compile")
    ap.add_argument(
        "--decode-knobs",
        help="JSON list of DecodeTuning field sets (default: the standard six), e.g. '[{}, {\"block_n\": 32}]'",
    )
    ap.add_argument(
        "--sass-dir",
        type=Path,
        help="also write each compiled kernel's SASS here (numbered in compile "
        "order: compare two trees with `diff -r`)",
    )
    ap.add_argument(
        "--prefill-knobs",
        default="[{}]",
        help='JSON list of PrefillTuning field sets, e.g. \'[{}, {"block_m": 64, "num_warps": 4}]\'',
    )
    ap.add_argument(
        "--klt",
        default="any",
        help="klt formats: the transform structure (tests/helpers/klt_cases.STRUCTURES: any, bytes, cubic, "
        "bytes-cubic)",
    )
    ap.add_argument("--sink", action="store_true", help="klt formats: the transform with a calibrated sink")
    ap.add_argument(
        "--extras",
        action="store_true",
        help="decode and prefill also with attention sinks, a soft cap and a sliding window (attention.extras)",
    )
    ap.add_argument(
        "--multitoken",
        type=int,
        default=0,
        help="decode also in the multi-token form with this many query tokens per sequence (speculative "
        "verification rows; 0: not)",
    )
    args = ap.parse_args(argv)
    _install()
    from jetson_tq.attention.extras import NO_EXTRAS, AttentionExtras
    from jetson_tq.kernels.append import append_rows
    from jetson_tq.kernels.compress_write_plan import WriteTuning, compress_write
    from jetson_tq.kernels.hybrid_decode_plan import DecodeTuning, hybrid_decode
    from jetson_tq.kernels.prefill_plan import PrefillTuning, chunked_prefill
    from jetson_tq.paged import AppendState, AppendStep, allocate_pages
    from jetson_tq.validate import FAULT_NONE, StoreLimits
    from tests.helpers.kernel_cases import build_paged_kv, fmt_for
    from tests.helpers.klt_cases import STRUCTURES, uneven_transform, with_sink

    d, hkv, g = args.d, 2, 4
    ops = set(args.ops.split(","))
    prefill_knobs = json.loads(args.prefill_knobs)
    decode_knobs = (
        json.loads(args.decode_knobs)
        if args.decode_knobs
        else [
            {},
            {"num_splits": 1},
            {"fused_reduce": True},
            {"block_r": 64},
            {"block_n": 32, "num_warps": 2},
            {"maxnreg": 0},
        ]
    )
    for name in args.formats.split(","):
        gen = torch.Generator().manual_seed(0)
        fmt = fmt_for(name, d)
        kt = (
            uneven_transform(hkv, d, fmt.key_code_bits(d), d, 1.0, gen, **STRUCTURES[args.klt])
            if fmt.key_mode == "klt"
            else None
        )
        if kt is not None and args.sink:
            kt = with_sink(kt, gen)
        kv = build_paged_kv(fmt, hkv, d, [70, 9], [3, 0], torch.float16, gen, key_transform=kt)
        q = torch.randn(2, hkv * g, d).half()
        extras = [("", NO_EXTRAS)]
        if args.extras:
            extras.append(("+x", AttentionExtras(sinks=torch.zeros(hkv * g), soft_cap=30.0, sliding_window=40)))
        for (tag, ex), (i, knobs) in (
            (e, k) for e in extras for k in enumerate(decode_knobs if "decode" in ops else ())
        ):
            n0 = len(COMPILED)
            hybrid_decode(q, kv, tuning=DecodeTuning(**knobs), extras=ex)
            for kname, k in COMPILED[n0:]:
                res = _resources(k, args.sass_dir, f"{name}_decode{i}{tag}")
                print(f"{name:10s} decode{tag:2s} {str(knobs):34s} {kname:24s} {res}", flush=True)
            if args.multitoken and fmt.key_mode != "klt":  # q [B, Q, Hq, D] with the Q new tokens' k, v
                qm = args.multitoken
                n0 = len(COMPILED)
                km = torch.randn(2, qm, hkv, d).half()
                hybrid_decode(
                    torch.randn(2, qm, hkv * g, d).half(), kv, tuning=DecodeTuning(**knobs), extras=ex, k=km, v=km
                )
                for kname, k in COMPILED[n0:]:
                    res = _resources(k, args.sass_dir, f"{name}_decode{i}{tag}_q{qm}")
                    print(f"{name:10s} decode{tag:2s} q={qm} {str(knobs):30s} {kname:24s} {res}", flush=True)
        qp = torch.randn(2, hkv * g, 8, d).half()
        kp = torch.randn(2, hkv, 8, d).half()
        kv_block = build_paged_kv(
            fmt.with_(recent_tokens=16, window="block"),
            hkv,
            d,
            [64, 0],
            [5, 9],
            torch.float16,
            torch.Generator().manual_seed(0),
            recent_cap=16,
            key_transform=kt,
        )
        for window, view in (("sliding", kv), ("block", kv_block)) if "prefill" in ops else ():
            for (tag, ex), (i, knobs) in ((e, k) for e in extras for k in enumerate(prefill_knobs)):
                n0 = len(COMPILED)
                chunked_prefill(qp, kp, kp.clone(), view, tuning=PrefillTuning(**knobs), extras=ex)
                for kname, k in COMPILED[n0:]:
                    res = _resources(k, args.sass_dir, f"{name}_prefill_{window}{i}{tag}")
                    print(f"{name:10s} prefill{tag:2s} {window:7s} {str(knobs):25s} {kname:24s} {res}", flush=True)
            if window == "block" and fmt.key_mode in ("mse", "klt"):  # the FlashAttention path's dequantization
                n0 = len(COMPILED)
                _flash_dequant(view)
                for kname, k in COMPILED[n0:]:
                    res = _resources(k, args.sass_dir, f"{name}_flash_dequant")
                    print(
                        f"{name:10s} flash   {window:7s} {'token-major, keys back':25s} {kname:24s} {res}", flush=True
                    )
        pages = allocate_pages(kv.layout, 8, hkv, torch.device("cpu"))
        kc = torch.randn(32, hkv, d).half()
        limits = StoreLimits.of(fmt, torch.float16, torch.float16)  # the cache's device-side checks (validate=True)
        variants = (
            {},
            {"block_t": 64, "num_warps": 4},
            {"checked": True},
            {"checked": True, "maxnreg": 128},
            {"checked": True, "maxnreg": 128, "rows": True},  # rows: a cache append of 4 sequences x 8 tokens
        )
        for i, knobs in enumerate(variants if "compress" in ops else ()):
            n0 = len(COMPILED)
            check = dict(fault=torch.tensor([FAULT_NONE, 0]), limits=limits) if knobs.get("checked") else {}
            kin = kc.view(4, 8, hkv, d).transpose(1, 2).contiguous().transpose(1, 2) if knobs.get("rows") else kc
            compress_write(
                kin,
                kin.clone(),
                torch.arange(32),
                pages,
                kv.layout,
                kv.codec,
                tuning=WriteTuning(**{a: b for a, b in knobs.items() if a not in ("checked", "rows")}),
                positions=torch.arange(32) if fmt.key_mode == "klt" else None,
                **check,
            )
            for kname, k in COMPILED[n0:]:
                res = _resources(k, args.sass_dir, f"{name}_compress{i}")
                print(f"{name:10s} compress {str(knobs):34s} {kname:24s} {res}", flush=True)
    for block in (False, True) if "append" in ops else ():  # the cache's append bookkeeping (format-independent)
        ring = torch.zeros(2, hkv, 16, d).half()
        lens = torch.tensor([3, 20], dtype=torch.int32)
        n0 = len(COMPILED)
        state = AppendState(
            ring, ring.clone(), lens, lens.clone(), lens.clone(), torch.zeros((), dtype=torch.bool), block
        )
        append_rows(kp, kp.clone(), state, AppendStep(0, 64, True, True))
        for kname, k in COMPILED[n0:]:
            res = _resources(k, args.sass_dir, f"append_{'block' if block else 'sliding'}")
            print(f"{'any':10s} append {'block' if block else 'sliding':36s} {kname:24s} {res}", flush=True)
    if "append" in ops:  # validate=True on the kernel path: slots first, the commit guarded by the fault record
        ring = torch.zeros(2, hkv, 16, d).half()
        lens = torch.tensor([3, 20], dtype=torch.int32)
        n0 = len(COMPILED)
        for stage, commit, guard in ((True, False, None), (False, True, torch.tensor([FAULT_NONE, 0]))):
            state = AppendState(ring, ring.clone(), lens, lens.clone(), lens.clone(), torch.zeros((), dtype=torch.bool))
            append_rows(kp, kp.clone(), state, AppendStep(0, 64, stage, commit, guard))
        for kname, k in COMPILED[n0:]:
            res = _resources(k, args.sass_dir, "append_guarded")
            print(f"{'any':10s} append {'stage / guarded commit':36s} {kname:24s} {res}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
