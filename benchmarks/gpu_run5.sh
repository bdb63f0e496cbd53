#!/usr/bin/env bash
# Run 5 on the H200 (issue 12): uniform 4-bit keys vs Lloyd-Max, fused query rotation, Walsh-Hadamard
# compress-on-write, prefill at the issue's shapes, then kernel tests (in parallel: compile-bound).
# Usage on the device: bash benchmarks/gpu_run5.sh "$OUT"   (TEST_FILES="tests/a.py tests/b.py": those files whole;
# default: the decode and compress test files, each split in two processes)
source benchmarks/gpu_preamble.sh "$@"  # OUT, PYTHONPATH, log(), machine and versions
log "decode sweep mse_k4v3u"
timeout 90 python3 benchmarks/sweep_decode.py --formats mse_k4v3u --out "$OUT/sweep" \
  --variants '[{}, {"block_n": 16, "num_warps": 1}, {"block_r": 16}]' 2>&1 | tail -12
log "decode mse_k4v3u"
timeout 75 python3 benchmarks/bench_decode.py --format mse_k4v3u --json "$OUT/decode_k4v3u.json" \
  --shapes '[[1,32,8,1024],[8,32,8,16384],[1,32,8,131072],[8,32,8,65536],[8,28,4,65536]]' 2>&1 | tail -8
log "decode mse_k4v3 (Lloyd-Max, fused query rotation)"
timeout 45 python3 benchmarks/bench_decode.py --format mse_k4v3 --json "$OUT/decode_k4v3.json" \
  --shapes '[[1,32,8,1024],[8,32,8,65536]]' 2>&1 | tail -5
log "compress mse_k4v3u"
timeout 40 python3 benchmarks/bench_compress.py --format mse_k4v3u \
  --variants '[{}, {"fast_rotation": false}, {"block_t": 64, "num_warps": 4}]' 2>&1 | tail -6
log "compress blog_k3v2"
timeout 30 python3 benchmarks/bench_compress.py --format blog_k3v2 --variants '[{}]' 2>&1 | tail -4
log "prefill mse_k4v3u"
timeout 45 python3 benchmarks/bench_prefill.py --format mse_k4v3u --issue-shapes 2>&1 | tail -4
log "kernel tests (one pytest per file or half file, in parallel: compile-bound)"
run_tests() {  # name, timeout, pytest args...
  local n=$1 t=$2; shift 2
  ( timeout "$t" python3 -m pytest -q -p no:cacheprovider "$@" > "/tmp/$n.log" 2>&1; echo "$n rc=$?" >> /tmp/tests_rc.txt ) &
}
if [ -n "$TEST_FILES" ]; then
  for f in $TEST_FILES; do run_tests "$(basename "$f" .py)" 200 "$f"; done
else
  run_tests decode_a 150 tests/test_kernels_decode.py -k matches_reference
  run_tests decode_b 150 tests/test_kernels_decode.py -k "not matches_reference"
  run_tests compress_a 150 tests/test_kernels_compress.py -k dtype0
  run_tests compress_b 150 tests/test_kernels_compress.py -k "not dtype0"
fi
wait
for f in /tmp/*.log; do echo "--- $f"; cat "$f"; done > "$OUT/tests.log"
cat /tmp/tests_rc.txt
for f in /tmp/*.log; do echo "--- $f"; tail -3 "$f"; done
log "done"
