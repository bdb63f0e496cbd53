#!/usr/bin/env bash
# Run 7 on the H200 (issue 12, compress-on-write), <= 60 s: first the compress and append kernel tests (the opt-in
# fast_write path included), then the default path beside fast_write and a device copy of the same bytes, at 16k and
# 2k tokens per launch (random slots).
# Usage on the device: bash benchmarks/gpu_run7_kcmp.sh "$OUT"   (each step has its own time limit)
source benchmarks/gpu_preamble.sh "$@"  # OUT, PYTHONPATH, log(), machine and versions
log "kernel tests: compress + append (8 xdist workers)"
PAR=(); python3 -c "import xdist" 2>/dev/null && PAR=(-n 8)
timeout 35 python3 -m pytest tests/test_kernels_compress.py tests/test_kernels_append.py -q "${PAR[@]}" \
  -p no:cacheprovider --durations=5 > "$OUT/tests.log" 2>&1
echo "tests rc=$?"
grep -v PytestBenchmarkWarning "$OUT/tests.log" | grep -v "warner(" | tail -10
log "compress-on-write, mse_k4v3 (default preset), D=128, 8 KV heads"
timeout 20 python3 benchmarks/bench_compress.py --format mse_k4v3 --tokens 16384,2048 --no-reference \
  --variants '[{}, {"fast_write": true}]' --json "$OUT/compress_mse_k4v3.json" > "$OUT/compress_mse_k4v3.log" 2>&1
echo "bench rc=$?"
grep -E "^\| (copy|default|fast)|copy bandwidth|Error" "$OUT/compress_mse_k4v3.log" | cut -d'|' -f2-3,6,9-10 | head -12
log "done"
