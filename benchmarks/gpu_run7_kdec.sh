#!/usr/bin/env bash
# Run 7 (decode) on the H200 (issue 12): the default preset's 4-bit Lloyd-Max key lookup by byte permutes (inline
# PTX prmt, prmt_keys=True, the default on CUDA) against the warp-shuffle gather it replaces (prmt_keys=False),
# with the split count sized from the compiled kernel's resident programs per SM (every variant: one full wave), at
# the default register cap (128) and at 144 / none (14 / 12 resident programs, fewer spills), side by side with SDPA
# flash on fp16 KV; then the decode kernel tests (PTX path on the GPU).
# Usage on the device: bash benchmarks/gpu_run7_kdec.sh "$OUT"   (150 s in all; each step has its own limit)
source benchmarks/gpu_preamble.sh "$@"  # OUT, PYTHONPATH, log(), machine and versions
log "decode: prmt lookup vs shuffle gather vs flash"
S='[[1,32,8,1024],[8,32,8,16384],[1,32,8,131072],[8,32,8,65536],[8,28,4,65536]]'
timeout 70 python3 benchmarks/sweep_decode.py --formats mse_k4v3 --out "$OUT/sweep" --shapes "$S" \
  --variants '[{}, {"prmt_keys": false}, {"maxnreg": 144}, {"maxnreg": 0}]' 2>&1 | tee "$OUT/sweep.log" | tail -27
log "decode kernel tests (test_kernels_decode.py, the decode cases of test_kernels_head_dims.py)"
PAR=(); python3 -c "import xdist" 2>/dev/null && PAR=(-n 8)
timeout 70 python3 -m pytest tests/test_kernels_decode.py tests/test_kernels_head_dims.py -k "decode" -q "${PAR[@]}" \
  -p no:cacheprovider --durations=5 > "$OUT/tests.log" 2>&1
echo "tests rc=$?"
grep -v PytestBenchmarkWarning "$OUT/tests.log" | grep -v "warner(" | tail -12
log "done"
