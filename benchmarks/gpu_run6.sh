#!/usr/bin/env bash
# Run 6 on the H200 (issue 12): register cap (recent-buffer tile, maxnreg) and the split reduce inside the decode
# launch, swept against the run-5 configuration; the public API table; every kernel test file.
# Usage on the device: bash benchmarks/gpu_run6.sh "$OUT"   (each step has its own time limit)
set -o pipefail
OUT=${1:-/tmp/run6}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log() { echo "=== $* ($(date -u +%T))"; }
log env
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
OLD='{"block_r": 64, "fused_reduce": false}'
log "decode sweep, long contexts (run-5 configuration first)"
timeout 110 python3 benchmarks/sweep_decode.py --formats mse_k4v3,mse_k4v3u --out "$OUT/sweep_long" \
  --variants "[$OLD, {\"fused_reduce\": false}, {}, {\"maxnreg\": 144}, {\"maxnreg\": 128}, {\"block_r\": 32}]" \
  2>&1 | tail -30
log "decode sweep, short contexts"
timeout 50 python3 benchmarks/sweep_decode.py --formats mse_k4v3 --out "$OUT/sweep_short" \
  --shapes '[[1,32,8,1024],[8,32,8,16384]]' --variants "[$OLD, {\"fused_reduce\": false}, {}, {\"maxnreg\": 144}]" \
  2>&1 | tail -12
log "public API (default preset)"
timeout 95 python3 benchmarks/bench_api.py --json "$OUT/api.json" 2>&1 | tail -8
log "kernel tests (every tests/test_kernels*.py, 14 xdist workers: compile-bound)"
python3 -c "import xdist" 2>/dev/null && PAR="-n 14" || PAR=""
timeout 160 python3 -m pytest tests/test_kernels*.py -q $PAR -p no:cacheprovider --durations=10 > "$OUT/tests.log" 2>&1
echo "tests rc=$?"
tail -15 "$OUT/tests.log"
log done
