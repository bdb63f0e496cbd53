#!/usr/bin/env bash
# The reproducible mode on the GPU (issue 25), ~150 s:
#   bash benchmarks/vllm_gpu/repro_check.sh OUT   (repo root = the vllmgpu snapshot, the bundle beside it)
# 1. tests/integrations/vllm/test_vllm_reproducible.py: the scheduling test's four engines (batch composition,
#    128-token chunks, forced preemption, prefix-cache hits) with JETSON_TQ_REPRODUCIBLE=1 and =0 side by side;
#    passes when every output of the mode-on engines equals the roomy batch's bitwise (tokens and log-probabilities).
#    The dump OUT/repro.json holds both modes' runs and differences.
# 2. benchmarks/vllm_gpu/repro_cost.py: decode attention µs per layer, mode off (CUDA graph) vs on (eager), same run.
set -u
OUT=${1:?out}; T0=$(date +%s); mkdir -p "$OUT"
# shellcheck disable=SC1091
source benchmarks/vllm_gpu/unpack.sh bundle /tmp/jtq_site > "$OUT/unpack.log" 2>&1 || { cat "$OUT/unpack.log"; exit 1; }
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_DEEP_GEMM_WARMUP=skip PYTHONUNBUFFERED=1
export VLLM_ENABLE_V1_MULTIPROCESSING=1 JETSON_TQ_REPRO_JSON="$OUT/repro.json"
timeout "${TEST_LIMIT:-150}" python3 -m pytest tests/integrations/vllm/test_vllm_reproducible.py -v \
  -p no:cacheprovider -rfE --durations=3 > "$OUT/repro_test.log" 2>&1
echo "rc=$?" >> "$OUT/repro_test.log"
grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" "$OUT/repro_test.log" | tail -8
python3 - "$OUT/repro.json" <<'EOF'
import json, sys
try:
    s = json.load(open(sys.argv[1]))["summary"]
except (OSError, KeyError, ValueError) as e:
    sys.exit(f"repro_check: no dump ({e})")
for mode, r in s.items():
    print(f"mode {mode}: {r['token_differences']} of {r['outputs']} outputs with other tokens, "
          f"{r['logprob_differences']} with other log-probabilities (largest gap {r['largest_logprob_gap']:.3g}); "
          f"preemptions {r['preemptions']}, prefix-cache hits {r['prefix_cache_hits']}; generate s {r['generate_s']} "
          f"for {r['generated_tokens']} tokens")
EOF
echo "=== repro_cost after $(( $(date +%s) - T0 )) s"
timeout "${COST_LIMIT:-90}" python3 benchmarks/vllm_gpu/repro_cost.py --json "$OUT/repro_cost.json" 2>&1 | tail -8
echo "=== done after $(( $(date +%s) - T0 )) s"
