"""One prefill of a whole vLLM engine under ``torch.profiler``: where a step's time goes, ours against stock.

    python benchmarks/vllm_gpu/profile_step.py --engine ours|stock [--model qwen2.5-7b] [--tokens 16000]
        [--prompts 1] [--output-tokens 1] [--config mse_k4v3] [--gpu-util 0.55] [--stacks 6] [--warm-prompts 2]

Starts one engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, eager, dummy weights, the model's shape from
``models.py``; stock on FlashAttention), prefills ``--warm-prompts`` prompts (2) of ``--tokens`` tokens untimed (0: the
profile holds the engine's first request, as a server's first user meets it), then
``--prompts`` more at once under the profiler (several: the scheduler's mixed steps, a long chunk beside a short one
and, with ``--output-tokens`` > 1, decode rows among them), and prints the wall time, the CUDA kernels by total time,
the host operations by total time and every host call that can wait for the GPU (synchronize, item, copies to the
host). ``--stacks N`` also records Python stacks and prints, for the host calls that waited longest (CUDA API calls
that block: copies, synchronizations), the N innermost frames of the package and of vLLM that issued them. Run once per
engine, on a GPU with the vLLM bundle unpacked: the gap between two engines' kernel sums is device
work, the rest host time the GPU waited for.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

WAITS = ("Synchronize", "aten::item", "_local_scalar_dense", "Memcpy DtoH", "aten::tolist", "cudaMemcpy ")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["ours", "stock"], required=True)
    ap.add_argument("--model", default="qwen2.5-7b", help="a shape in models.py")
    ap.add_argument("--tokens", type=int, default=16000, help="prompt tokens (one prefill step up to 16,384)")
    ap.add_argument("--config", default="mse_k4v3", help="JETSON_TQ_CONFIG of the ours engine")
    ap.add_argument("--prompts", type=int, default=1, help="prompts profiled together (1..8)")
    ap.add_argument("--output-tokens", type=int, default=1, help="tokens each generates (> 1: decode rows too)")
    ap.add_argument("--gpu-util", type=float, default=0.55)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--stacks", type=int, default=0, help="Python frames shown per blocking call site (0: none)")
    ap.add_argument(
        "--warm-prompts", type=int, default=2, help="prompts run untimed first (0: profile the engine's first request)"
    )
    args = ap.parse_args(argv)
    if not 1 <= args.tokens <= 16384:
        ap.error(f"--tokens: expected 1..16384 (one step of 16,384 batched tokens), got {args.tokens}")
    if not 1 <= args.prompts <= 8:
        ap.error(f"--prompts: expected 1..8 (max_num_seqs 8), got {args.prompts}")
    if not 1 <= args.output_tokens <= 1024:
        ap.error(f"--output-tokens: expected 1..1024, got {args.output_tokens}")
    if not 0 <= args.stacks <= 32:
        ap.error(f"--stacks: expected 0..32 frames, got {args.stacks}")
    if not 0 <= args.warm_prompts <= 8:
        ap.error(f"--warm-prompts: expected 0..8, got {args.warm_prompts}")
    import torch

    if not torch.cuda.is_available():
        print("profile_step: needs a CUDA GPU with the vLLM bundle", file=sys.stderr)
        return 2
    if args.engine == "ours":
        os.environ["JETSON_TQ_CONFIG"] = args.config
    else:
        os.environ.pop("JETSON_TQ_CONFIG", None)
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_V2_MODEL_RUNNER="0")
    import job
    from models import write_model_dir

    job.SPEC = dict(
        name=args.engine,
        model=str(write_model_dir(args.model, Path(os.environ.get("JTQ_MODELS", "/tmp/jtq_models")))),
        max_model_len=args.tokens + 1024,
        gpu_util=args.gpu_util,
        max_num_seqs=8,
        max_num_batched_tokens=16384,
        eager=True,
        backend=None if args.engine == "ours" else "FLASH_ATTN",
    )
    llm = job.build_llm()
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)

    def prefill(n: int) -> float:
        prompts = [
            {"prompt_token_ids": torch.randint(100, 30000, (args.tokens,), generator=gen).tolist()} for _ in range(n)
        ]
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    for _ in range(args.warm_prompts):
        prefill(1)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, with_stack=args.stacks > 0) as prof:
        wall = prefill(args.prompts)
    events = prof.key_averages()
    cuda = torch.autograd.DeviceType.CUDA
    kernels = sorted((e for e in events if e.device_type == cuda), key=lambda e: -e.device_time_total)
    host = sorted((e for e in events if e.device_type != cuda), key=lambda e: -e.cpu_time_total)
    what = f"{args.prompts} x {args.tokens}-token prompts, {args.output_tokens} out"
    print(f"{args.engine}: {what}: {wall * 1e3:.1f} ms wall, ", end="")
    print(f"kernels {sum(e.device_time_total for e in kernels) / 1e3:.1f} ms")
    for e in kernels[: args.top]:
        print(f"  kernel {e.key[:70]:<70} x{e.count:<5} {e.device_time_total / 1e3:8.2f} ms")
    for e in host[: args.top]:
        print(f"  host   {e.key[:70]:<70} x{e.count:<5} {e.cpu_time_total / 1e3:8.2f} ms")
    for e in host:
        if any(w in e.key for w in WAITS):
            print(f"  wait   {e.key[:70]:<70} x{e.count:<5} {e.cpu_time_total / 1e3:8.2f} ms")
    if args.stacks:
        for (op, frames), (n, us) in blocking_sites(prof.events(), args.stacks)[: args.top]:
            print(f"  site   {op} x{n} {us / 1e3:.2f} ms")
            for f in frames:
                print(f"           {f}")
    return 0


BLOCKING_API = ("cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
OWN_FRAMES = ("jetson_tq/", "vllm/")


def blocking_sites(events, depth: int) -> list[tuple[tuple[str, tuple[str, ...]], tuple[int, float]]]:
    """Blocking CUDA API calls grouped by the op that issued them and its ``depth`` innermost package / vLLM frames,
    longest total host time first: [((op, frames), (count, us))]."""
    sites: dict[tuple[str, tuple[str, ...]], list[float]] = {}
    for e in events:
        if not any(e.name.startswith(b) for b in BLOCKING_API):
            continue
        op, parent = e.name, e.cpu_parent
        while parent is not None and not parent.stack:
            op, parent = parent.name, parent.cpu_parent
        frames = tuple(f for f in (parent.stack if parent is not None else []) if any(o in f for o in OWN_FRAMES))
        key = (f"{e.name} <- {parent.name if parent is not None else op}", frames[:depth])
        sites.setdefault(key, []).append(e.cpu_time_total)
    return sorted(((k, (len(v), sum(v))) for k, v in sites.items()), key=lambda kv: -kv[1][1])


if __name__ == "__main__":
    raise SystemExit(main())
