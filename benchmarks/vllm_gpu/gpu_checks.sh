#!/usr/bin/env bash
# The GPU correctness checks, each alone on the GPU (H200 call 11 ran them beside each other and beside a -n 6
# kernel-test run: the CPU-bound Triton compiles made all three miss their limits). Stages, in the order given:
#   compress  the compress-on-write and append kernel tests (issue 12)
#   kernels   every kernel test file (issue 12; at most KERNEL_CAP seconds, default 300)
#   sched     tests/integrations/vllm/test_vllm_scheduling.py (scheduling invariance, prefix caching, preemption; issue 14), its
#             outputs dumped, beside stock vLLM (and the presets in SCHED_CONFIGS) on the same engines
#             (benchmarks/vllm_gpu/sched_compare.py)
#   preempt   the default preset's forced-preemption greedy run (issue 10)
# Everything lands in OUT/results.tgz (a device call returns few files).
#   bash benchmarks/vllm_gpu/gpu_checks.sh OUT TOTAL_SECONDS STAGE...   (repo root = the vllmgpu snapshot)
set -u
OUT=${1:?out}; TOTAL=${2:?seconds}; shift 2; T0=$(date +%s); R="$OUT/r"; mkdir -p "$R"
el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( TOTAL - $(el) )); }
summary() { grep -v PytestBenchmarkWarning "$1" | grep -E "passed|failed|error|FAILED|ERROR|rc=" | tail -"${2:-6}"; }
source benchmarks/vllm_gpu/unpack.sh bundle /tmp/jtq_site > "$R/unpack.log" 2>&1 || { cat "$R/unpack.log"; exit 1; }
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_DEEP_GEMM_WARMUP=skip JTQ_MODELS=/tmp/jtq_models PYTHONUNBUFFERED=1
for stage in "$@"; do
  echo "=== $stage after $(el) s ($(left) s left)"
  case $stage in
    compress)
      timeout "$(( $(left) < 120 ? $(left) : 120 ))" python3 -m pytest tests/kernels/test_kernels_compress.py \
        tests/kernels/test_kernels_append.py -q -n 14 -p no:cacheprovider --durations=8 -rfE > "$R/compress_tests.log" 2>&1
      echo "rc=$?" >> "$R/compress_tests.log"; summary "$R/compress_tests.log" ;;
    kernels)
      CAP=${KERNEL_CAP:-300}
      timeout "$(( $(left) < CAP ? $(left) : CAP ))" python3 -m pytest tests/kernels/test_kernels*.py -q -n 14 \
        -p no:cacheprovider --durations=15 -rfE > "$R/kernel_tests.log" 2>&1
      echo "rc=$?" >> "$R/kernel_tests.log"; summary "$R/kernel_tests.log" ;;
    sched)
      LIM=$(( $(left) < 230 ? $(left) : 230 ))
      (VLLM_ENABLE_V1_MULTIPROCESSING=1 JETSON_TQ_SCHED_JSON="$R/sched_mse_k4v3.json" timeout "$LIM" python3 -m pytest \
        tests/integrations/vllm/test_vllm_scheduling.py -v -p no:cacheprovider --durations=5 > "$R/sched.log" 2>&1
       echo "rc=$?" >> "$R/sched.log") &
      timeout "$LIM" python3 benchmarks/vllm_gpu/sched_compare.py --out "$R" --configs "${SCHED_CONFIGS:-stock}" \
        > "$R/sched_others.log" 2>&1
      wait
      python3 benchmarks/vllm_gpu/sched_compare.py --out "$R" --reuse "$R"/sched_*.json 2>&1 | tail -30
      summary "$R/sched.log" 8 ;;
    preempt)
      python3 benchmarks/vllm_gpu/run.py --out "$R/corr" --plan corr --only corr_ours_k4v3_preempt --budget "$(left)" \
        > "$R/corr.log" 2>&1
      grep -v '"kind": "capacity"' "$R/corr.log" | cut -c1-300 | tail -4 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
tar -czf "$OUT/results.tgz" -C "$R" . && rm -rf "$R"
echo "=== done after $(el) s"
