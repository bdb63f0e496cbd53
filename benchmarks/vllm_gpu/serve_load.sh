#!/usr/bin/env bash
# benchmarks/load_serve.py against `vllm serve` on the GPU machine (issue 25): jetson-tq's plugin with the default
# preset ("ours") or stock vLLM on TRITON_ATTN ("stock"), the same model, flags, KV budget and load, one engine per
# device call (~5 min each; both in one call would pass the 10-minute limit):
#   bash benchmarks/vllm_gpu/serve_load.sh OUT ours|ours-repro|stock [DURATION_S=150] [KV_GIB=2]  (repo root: snapshot)
# KV_GIB may be fractional: 0.9 gives ours about the KV tokens stock has at 2 (~36k, after the 455 MiB of fp16 recent
# rows for 64 sequences), so ours preempts too.
# ours-repro: ours with the reproducible mode (JETSON_TQ_REPRODUCIBLE=1). REQ_TIMEOUT (default 150 s) bounds each
# request and how long in-flight requests may take after the load; load_serve prints the GPU memory timeline.
# Model: the Qwen2.5-7B shape with dummy bf16 weights and a local 32k-word tokenizer (benchmarks/vllm_gpu/models.py),
# max_model_len 32768, 64 sequences, a KV budget of KV_GIB GiB for both engines (2 GiB: ~37k tokens stock, ~4x
# that for ours; 64 clients of 100-30k-token prompts ask for ~330k, so requests queue and vLLM preempts).
# Writes OUT/load_WHICH.json (the script's summary), OUT/load_WHICH.txt (what it printed) and OUT/server_WHICH.log.gz.
set -u
OUT=${1:?out}; WHICH=${2:?ours, ours-repro or stock}; DUR=${3:-150}; KV_GIB=${4:-2}; PORT=8123
mkdir -p "$OUT"
KV_BYTES=$(python3 -c "import sys; v = float(sys.argv[1]); assert 0 < v < 10**4; print(int(v * 2**30))" "$KV_GIB" 2>/dev/null) \
  || { echo "serve_load.sh: KV_GIB must be a positive number of GiB (below 10^4), got '$KV_GIB'" >&2; exit 2; }
# shellcheck disable=SC1091
source benchmarks/vllm_gpu/unpack.sh bundle /tmp/jtq_site > "$OUT/unpack.log" 2>&1 || { cat "$OUT/unpack.log"; exit 1; }
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_DEEP_GEMM_WARMUP=skip VLLM_USE_V2_MODEL_RUNNER=0 PYTHONUNBUFFERED=1
export VLLM_ENABLE_V1_MULTIPROCESSING=1   # vllm serve: the engine core in its own process (unpack.sh sets 0)
MODEL=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks/vllm_gpu'); from models import write_model_dir, \
write_tokenizer; print(write_tokenizer(write_model_dir('qwen2.5-7b', '/tmp/jtq_models/with_tokenizer')))")
args=(--model "$MODEL" --host 127.0.0.1 --port "$PORT" --served-model-name m --load-format dummy --dtype bfloat16
      --max-model-len 32768 --max-num-seqs 64 --max-num-batched-tokens 16384 --gpu-memory-utilization 0.5
      --kv-cache-memory-bytes "$KV_BYTES"
      --compilation-config '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "custom_ops": ["none"],
                             "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]}'
      --ir-op-priority '{"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}')
case "$WHICH" in
  ours) export JETSON_TQ_CONFIG=mse_k4v3 ;;
  ours-repro) export JETSON_TQ_CONFIG=mse_k4v3 JETSON_TQ_REPRODUCIBLE=1 ;;
  stock) unset JETSON_TQ_CONFIG; args+=(--attention-backend TRITON_ATTN) ;;
  *) echo "serve_load.sh: expected ours, ours-repro or stock, got '$WHICH'" >&2; exit 2 ;;
esac
T0=$(date +%s)
python3 -m vllm.entrypoints.openai.api_server "${args[@]}" > "$OUT/server_$WHICH.log" 2>&1 &
PID=$!
until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; do
  if ! kill -0 "$PID" 2>/dev/null || (( $(date +%s) - T0 > 240 )); then
    echo "serve_load.sh: vllm serve ($WHICH) did not come up in $(( $(date +%s) - T0 )) s:"; tail -40 "$OUT/server_$WHICH.log"
    kill "$PID" 2>/dev/null; exit 1
  fi
  sleep 2
done
echo "serve_load.sh: $WHICH up after $(( $(date +%s) - T0 )) s; $(grep -m1 -o 'KV cache size: [0-9,]* tokens' "$OUT/server_$WHICH.log")"
python3 benchmarks/load_serve.py --port "$PORT" --clients 64 --duration "$DUR" --max-requests 20000 --min-prompt 100 \
  --max-prompt 30000 --max-tokens 128 --request-timeout "${REQ_TIMEOUT:-150}" --warmup 30 --settle 60 --server-pid "$PID" \
  --expect-queueing --expect-preemption --json "$OUT/load_$WHICH.json" 2>&1 | tee "$OUT/load_$WHICH.txt"
RC=${PIPESTATUS[0]}
kill "$PID"; wait "$PID" 2>/dev/null
grep -c "Traceback" "$OUT/server_$WHICH.log" | sed 's/^/serve_load.sh: tracebacks in the server log: /'
gzip -f "$OUT/server_$WHICH.log"
echo "serve_load.sh: $WHICH done after $(( $(date +%s) - T0 )) s, load_serve exit $RC"
exit "$RC"
