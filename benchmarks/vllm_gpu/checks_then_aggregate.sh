#!/usr/bin/env bash
# One device call. Phase 1, correctness only, side by side on the GPU: tests/test_vllm_scheduling.py (scheduling
# invariance, prefix caching, preemption; issue 14), the default preset's forced-preemption greedy run, and every
# kernel test file (issue 12). Phase 2, alone on the GPU: the 32k aggregate (ours, then stock). Phase 3, if time is
# left: the compress-on-write bench (default beside fast_write). Everything lands in OUT/results.tgz.
#   bash benchmarks/vllm_gpu/checks_then_aggregate.sh OUT [TOTAL_SECONDS]   (repo root = the vllmgpu snapshot)
set -u
OUT=${1:?out}; TOTAL=${2:-580}; T0=$(date +%s); R="$OUT/r"; mkdir -p "$R"
el() { echo $(( $(date +%s) - T0 )); }
source benchmarks/vllm_gpu/unpack.sh bundle /tmp/jtq_site > "$R/unpack.log" 2>&1 || { cat "$R/unpack.log"; exit 1; }
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_DEEP_GEMM_WARMUP=skip JTQ_MODELS=/tmp/jtq_models PYTHONUNBUFFERED=1
(VLLM_ENABLE_V1_MULTIPROCESSING=1 timeout 170 python3 -m pytest tests/test_vllm_scheduling.py -v -p no:cacheprovider \
  --durations=5 > "$R/sched.log" 2>&1; echo "sched rc=$?" >> "$R/sched.log") &
SCHED=$!
(timeout 165 python3 -m pytest tests/test_kernels*.py -q -n 6 -p no:cacheprovider --durations=10 > "$R/kernel_tests.log" 2>&1;
 echo "kernel tests rc=$?" >> "$R/kernel_tests.log") &
KT=$!
python3 benchmarks/vllm_gpu/run.py --out "$R/corr" --plan corr --only corr_ours_k4v3_preempt --budget 150 \
  > "$R/corr.log" 2>&1
wait $SCHED $KT
echo "=== phase 1 done after $(el) s"
grep -E "PASS|FAIL|ERROR|passed|failed|rc=" "$R/sched.log" | tail -8
grep -v PytestBenchmarkWarning "$R/kernel_tests.log" | grep -E "passed|failed|error|rc=" | tail -4
grep -v '"kind": "capacity"' "$R/corr.log" | cut -c1-400 | tail -4
python3 -c "import json; d=json.load(open('$R/corr/summary.json')); print({k: v for k, v in d.items() if k != 'workloads'})" 2>&1 | cut -c1-600
LEFT=$(( TOTAL - $(el) - 25 ))
echo "=== aggregate, budget $LEFT s"
python3 benchmarks/vllm_gpu/run.py --out "$R/agg" --plan agg --budget "$LEFT" > "$R/agg.log" 2>&1
cut -c1-700 "$R/agg.log" | tail -8
python3 -c "import json; print(json.dumps(json.load(open('$R/agg/summary.json'))['targets']))" 2>&1 | tail -2
if [ $(( TOTAL - $(el) )) -ge 22 ]; then
  echo "=== compress bench ($(el) s)"
  timeout 20 python3 benchmarks/bench_compress.py --format mse_k4v3 --tokens 16384,2048 --no-reference \
    --variants '[{}, {"fast_write": true}]' --json "$R/compress.json" > "$R/compress.log" 2>&1; echo "bench rc=$?"
  grep -E "^\| (copy|default|fast)|copy bandwidth|Error" "$R/compress.log" | head -12
fi
tar -czf "$OUT/results.tgz" -C "$R" . && rm -rf "$R"
echo "=== done after $(el) s"
