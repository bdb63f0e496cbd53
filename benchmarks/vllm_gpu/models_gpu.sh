#!/usr/bin/env bash
# Issue 21 on the H200: the model matrix, SmolLM2's real weights vs stock, `vllm serve` with the plugin. Stages:
#   matrix            benchmarks/vllm_gpu/matrix.py, MATRIX_BUDGET seconds (default 420), MATRIX_WORKERS (3),
#                     MATRIX_MODELS (a,b,...: those rows only; default all), MATRIX_GPU_UTIL (vLLM's per-engine memory
#                     check, default 0.25: gpt-oss-20b's bf16 weights need ~0.6 of an 80 GB card), MATRIX_FP8=1 (a
#                     third engine per row: stock fp8 KV at the same budget), MATRIX_KV_GIB (every engine's KV budget,
#                     default 2: Gemma-3-12B's 8 x 8k decode row needs ~8). MoE rows need the optional part
#                     vllm-moe.tar.xz (bundle.py --with-moe, staged by an earlier call: parts.py)
#   convert GGUF      SmolLM2-135M-Instruct's GGUF -> /tmp/jtq_smollm2 (safetensors + tokenizer; needs the gguf
#                     wheel: GGUF_WHEEL=path, carried beside the bundle); a GGUF path that is not there but whose
#                     pieces staged by earlier calls are (benchmarks/vllm_gpu/gguf_parts.sh) is joined first
#   calibrate         python -m jetson_tq calibrate on /tmp/jtq_smollm2 (the weights vLLM serves) with CAL_TEXT (a UTF-8
#                     file: its last tokens) -> /tmp/jtq_kt/smollm2-kl52.{pt,yaml}; the 5x preset is then
#                     REAL_CONFIGS=...,/tmp/jtq_kt/smollm2-kl52.yaml
#   real              benchmarks/vllm_gpu/real_weights.py on /tmp/jtq_smollm2 with TEXT (a UTF-8 file), REAL_CONFIGS:
#                     vLLM's prompt_logprobs PPL / KL / greedy vs stock, then the transformers harness on the same windows
#   serve             benchmarks/vllm_gpu/serve_smoke.py on /tmp/jtq_smollm2 (SERVE_MODEL to override)
#   spec              benchmarks/vllm_gpu/spec_decode.py: n-gram speculation, stock vs ours plain / with speculation vs
#                     the nearly exact config, on SPEC_MODEL (default qwen2.5-7b, all layers), SPEC_ARGS passed on
#                     (SPEC_ARGS="--method eagle3": EAGLE-3 with a generated one-layer head, dummy weights;
#                     SPEC_ARGS="--method draft_model --model-dir /tmp/jtq_smollm2 --text opticks": SmolLM2's real
#                     weights drafting for themselves, after the convert stage)
#   passthru          real_weights.py --dummy: PASSTHRU_MODEL (default qwen2.5-0.5b, all layers, vLLM's random weights)
#                     with the fp16 preset vs stock TRITON_ATTN in one process, greedy ids and log-probabilities:
#                     prints "VERDICT fp16 vs stock: BITWISE IDENTICAL ..." or how far it differs (~1-2 min)
# Everything lands in OUT/results.tgz (a device call returns few files).
#   bash benchmarks/vllm_gpu/models_gpu.sh OUT STAGE [ARG]...     (repo root = the snapshot with bundle/)
set -u
OUT=${1:?out}; shift; T0=$(date +%s); R="$OUT/r"; mkdir -p "$R"
el() { echo $(( $(date +%s) - T0 )); }
source benchmarks/vllm_gpu/unpack.sh bundle /tmp/jtq_site > "$R/unpack.log" 2>&1 || { cat "$R/unpack.log"; exit 1; }
grep -E '^(unpack|parts):' "$R/unpack.log"
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_DEEP_GEMM_WARMUP=skip PYTHONUNBUFFERED=1
SMOL=/tmp/jtq_smollm2
while [ $# -gt 0 ]; do
  stage=$1; shift
  echo "=== $stage after $(el) s"
  case $stage in
    matrix)
      python3 benchmarks/vllm_gpu/matrix.py --out "$R/matrix" --budget "${MATRIX_BUDGET:-420}" \
        --workers "${MATRIX_WORKERS:-3}" ${MATRIX_MODELS:+--models "$MATRIX_MODELS"} \
        ${MATRIX_GPU_UTIL:+--gpu-util "$MATRIX_GPU_UTIL"} ${MATRIX_FP8:+--fp8} \
        ${MATRIX_KV_GIB:+--kv-gib "$MATRIX_KV_GIB"} > "$R/matrix.log" 2>&1
      tail -25 "$R/matrix.log" ;;
    spec)
      read -r -a spec_args <<< "${SPEC_ARGS:-}"  # extra arguments, split on spaces on purpose
      python3 benchmarks/vllm_gpu/spec_decode.py --out "$R/spec" --model "${SPEC_MODEL:-qwen2.5-7b}" "${spec_args[@]}" \
        > "$R/spec.log" 2>&1
      tail -30 "$R/spec.log" ;;
    convert)
      GGUF=${1:?convert needs the GGUF path}; shift
      if [ ! -f "$GGUF" ] && [ "$GGUF" = /tmp/jtq_gguf/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
        bash benchmarks/vllm_gpu/gguf_parts.sh join || exit 1
      fi
      [ -n "${GGUF_WHEEL:-}" ] && python3 -m pip install -q --no-index --no-deps --target /tmp/jtq_site "$GGUF_WHEEL"
      python3 - "$GGUF" "$SMOL" <<'PY' 2>&1 | tail -3
import sys
from pathlib import Path
from jetson_tq.models.smollm2 import convert_gguf
out = Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True); convert_gguf(Path(sys.argv[1]), out); print("converted", out)
PY
      ;;
    calibrate)
      python3 -m jetson_tq calibrate --model "$SMOL" --text "${CAL_TEXT:?set CAL_TEXT to a UTF-8 file}" \
        --out /tmp/jtq_kt/smollm2-kl52.pt > "$R/calibrate.log" 2>&1
      tail -3 "$R/calibrate.log" ;;
    real)
      python3 benchmarks/vllm_gpu/real_weights.py --model "$SMOL" --text "${TEXT:?set TEXT to a UTF-8 file}" \
        --out "$R/real_weights.json" --configs "${REAL_CONFIGS:-mse_k4v3,fp16}" --budget "${REAL_BUDGET:-300}" \
        --transformers > "$R/real_weights.log" 2>&1
      grep -E "^\||RESULT" "$R/real_weights.log" | cut -c1-400 ;;
    serve)
      python3 benchmarks/vllm_gpu/serve_smoke.py --model "${SERVE_MODEL:-$SMOL}" --out "$R/serve.json" 2>&1 \
        | cut -c1-1500 ;;
    passthru)
      python3 benchmarks/vllm_gpu/real_weights.py --dummy "${PASSTHRU_MODEL:-qwen2.5-0.5b}" --configs fp16 \
        --out "$R/passthru.json" --windows 2 --window-len 512 --prompts 4 --prompt-tokens 256 --new-tokens 32 \
        --top 5 --budget "${PASSTHRU_BUDGET:-150}" > "$R/passthru.log" 2>&1
      grep -E "^VERDICT|RESULT|Error" "$R/passthru.log" | cut -c1-400 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
tar -czf "$OUT/results.tgz" -C "$R" . && rm -rf "$R"
echo "=== done after $(el) s"
