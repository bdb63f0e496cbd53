#!/usr/bin/env bash
# Run 7 (kpre) on the H200 (issue 12, prefill): the chunked-prefill kernel (whole fp16 tiles dequantized once per
# 128-row program, wgmma) and its knobs next to SDPA flash, chunk 2048 over 32k history, 32/8 and 28/4, mse_k4v3;
# the prefill kernel tests run beside the compile warm-up. Allowance 120 s wall.
# Usage on the device: bash benchmarks/gpu_run7_kpre.sh "$OUT"   (each step has its own time limit)
# As run (call A, 2026-12-01, commit 98f9fb5: raw output results/h200_2026-12-01/run7_kpre/): the variants were
# {"impl": "run6"} (the run-6 kernel, benchmarks/prefill_run6.py, deleted after), {} (then num_stages 2),
# num_stages 1 / 3 and block_n 32; num_stages 1 won and is now the default, so {} below is that run's num_stages 1.
source benchmarks/gpu_preamble.sh "$@"  # OUT, PYTHONPATH, log(), machine and versions
V32=('{}' '{"num_stages": 2}' '{"num_stages": 3}' '{"block_n": 32}')
V28=('{}' '{"num_stages": 2}')
join() { local IFS=,; echo "[$*]"; }
log "kernel tests (-n 8) beside the compile warm-up (one process per shape and variant, Triton's disk cache)"
PAR=(); python3 -c "import xdist" 2>/dev/null && PAR=(-n 8)
timeout 60 python3 -m pytest tests/test_kernels_prefill.py -q "${PAR[@]}" -p no:cacheprovider --durations=8 \
  > "$OUT/tests.log" 2>&1 &
TESTS=$!
WARM=()
i=0
# warm-up shapes: the issue shapes' constexprs and argument divisibility (4096 tokens = 256 block-table entries)
for v in "${V32[@]}"; do
  timeout 60 python3 benchmarks/bench_prefill.py --compile-only --format mse_k4v3 --shapes '[[1,32,8,3840,256]]' \
    --variants "[$v]" > "$OUT/warm_$i.log" 2>&1 & WARM+=($!); i=$((i + 1))
done
for v in "${V28[@]}"; do
  timeout 60 python3 benchmarks/bench_prefill.py --compile-only --format mse_k4v3 --shapes '[[1,28,4,3840,256]]' \
    --variants "[$v]" > "$OUT/warm_$i.log" 2>&1 & WARM+=($!); i=$((i + 1))
done
for p in "${WARM[@]}"; do wait "$p" || echo "warm-up pid $p rc=$?"; done
log "warm-up done"
wait $TESTS; echo "tests rc=$?"
grep -v PytestBenchmarkWarning "$OUT/tests.log" | grep -v "warner(" | tail -14
log "prefill, chunk 2048 over 32k, mse_k4v3 ({} = the defaults)"
timeout 35 python3 benchmarks/bench_prefill.py --format mse_k4v3 --shapes '[[1,32,8,32768,2048]]' \
  --variants "$(join "${V32[@]}")" --json "$OUT/prefill_32_8.json" 2>&1 | tail -7
timeout 22 python3 benchmarks/bench_prefill.py --format mse_k4v3 --shapes '[[1,28,4,32768,2048]]' \
  --variants "$(join "${V28[@]}")" --json "$OUT/prefill_28_4.json" 2>&1 | tail -5
log "done"
