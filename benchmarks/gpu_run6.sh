#!/usr/bin/env bash
# Run 6 on the H200 (issue 12): register cap, recent buffer spread over the splits, split reduce inside the decode
# launch; sweeps around the new defaults, the decode tables, the public API and every kernel test file.
# Usage on the device: bash benchmarks/gpu_run6.sh "$OUT"   (each step has its own time limit)
# (Run 6a, the first call, swept block_r / fused_reduce / maxnreg against the run-5 configuration with the script
# of commit 4d85a29: results/h200_2026-12-01/run6a.)
source benchmarks/gpu_preamble.sh "$@"  # OUT, PYTHONPATH, log(), machine and versions
log "decode sweep, long contexts ({} = the defaults)"
timeout 90 python3 benchmarks/sweep_decode.py --formats mse_k4v3,mse_k4v3u --out "$OUT/sweep_long" \
  --variants '[{}, {"fused_reduce": false}, {"maxnreg": 0}, {"maxnreg": 0, "waves": 12}, {"waves": 32}]' 2>&1 | tail -24
log "decode sweep, short contexts"
timeout 40 python3 benchmarks/sweep_decode.py --formats mse_k4v3,mse_k4v3u --out "$OUT/sweep_short" \
  --shapes '[[1,32,8,1024],[8,32,8,16384]]' --variants '[{}, {"fused_reduce": false}, {"maxnreg": 0}]' 2>&1 | tail -16
log "decode tables"
S='[[1,32,8,1024],[8,32,8,16384],[1,32,8,131072],[8,32,8,65536],[8,28,4,65536]]'
for f in mse_k4v3 mse_k4v3u; do
  timeout 30 python3 benchmarks/bench_decode.py --format $f --json "$OUT/decode_$f.json" --shapes "$S" 2>&1 | tail -7
done
timeout 20 python3 benchmarks/bench_decode.py --format blog_k3v2 --json "$OUT/decode_blog_k3v2.json" \
  --shapes '[[1,32,8,131072],[8,32,8,65536]]' 2>&1 | tail -4
log "public API (default preset)"
timeout 70 python3 benchmarks/bench_api.py --json "$OUT/api.json" 2>&1 | tail -7
log "kernel tests (every tests/test_kernels*.py, 14 xdist workers: compile-bound)"
PAR=(); python3 -c "import xdist" 2>/dev/null && PAR=(-n 14)
timeout 150 python3 -m pytest tests/test_kernels*.py -q "${PAR[@]}" -p no:cacheprovider --durations=10 > "$OUT/tests.log" 2>&1
echo "tests rc=$?"
grep -v PytestBenchmarkWarning "$OUT/tests.log" | grep -v "warner(" | tail -16
log "done"
