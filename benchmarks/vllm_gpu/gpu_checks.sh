#!/usr/bin/env bash
# The GPU correctness checks in one device call, each alone on the GPU or beside one other check only (H200 call 11 ran
# them beside each other and beside a -n 6 kernel-test run: the CPU-bound Triton compiles made all three miss their
# limits): every kernel test file (issue 12), then tests/test_vllm_scheduling.py (scheduling invariance, prefix
# caching, preemption; issue 14) beside the default preset's forced-preemption greedy run (issue 10), then, if time
# is left, capacity-only engines. Everything lands in OUT/results.tgz (a device call returns few files).
#   bash benchmarks/vllm_gpu/gpu_checks.sh OUT [TOTAL_SECONDS]   (repo root = the vllmgpu snapshot)
set -u
OUT=${1:?out}; TOTAL=${2:-560}; T0=$(date +%s); R="$OUT/r"; mkdir -p "$R"
el() { echo $(( $(date +%s) - T0 )); }
source benchmarks/vllm_gpu/unpack.sh bundle /tmp/jtq_site > "$R/unpack.log" 2>&1 || { cat "$R/unpack.log"; exit 1; }
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_DEEP_GEMM_WARMUP=skip JTQ_MODELS=/tmp/jtq_models PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest tests/test_kernels*.py -q -n 14 -p no:cacheprovider --durations=10 -rfE \
  > "$R/kernel_tests.log" 2>&1; echo "kernel tests rc=$? after $(el) s"
grep -v PytestBenchmarkWarning "$R/kernel_tests.log" | grep -E "passed|failed|error|FAILED|ERROR" | tail -6
(VLLM_ENABLE_V1_MULTIPROCESSING=1 timeout 230 python3 -m pytest tests/test_vllm_scheduling.py -v -p no:cacheprovider \
  --durations=5 > "$R/sched.log" 2>&1; echo "sched rc=$?" >> "$R/sched.log") &
SCHED=$!
python3 benchmarks/vllm_gpu/run.py --out "$R/corr" --plan corr --only corr_ours_k4v3_preempt --budget 220 \
  > "$R/corr.log" 2>&1
wait $SCHED
echo "=== scheduling test and preemption run done after $(el) s"
grep -E "PASS|FAIL|ERROR|passed|failed|rc=" "$R/sched.log" | tail -8
grep -v '"kind": "capacity"' "$R/corr.log" | cut -c1-300 | tail -4
python3 -c "import json; d=json.load(open('$R/corr/summary.json')); print({k: v for k, v in d.items() if k != 'workloads'})" 2>&1 | cut -c1-700
LEFT=$(( TOTAL - $(el) ))
if [ "$LEFT" -ge 60 ]; then
  echo "=== capacity-only engines, budget $LEFT s"
  python3 benchmarks/vllm_gpu/run.py --out "$R/cap" --plan short --only ours_blog_k3v2,vllm_tq_3bit_nc --budget "$LEFT" \
    > "$R/cap.log" 2>&1; cut -c1-400 "$R/cap.log" | grep -v '"kind": "done"' | tail -4
fi
tar -czf "$OUT/results.tgz" -C "$R" . && rm -rf "$R"
echo "=== done after $(el) s"
