#!/usr/bin/env bash
# Run 8 (decode) on the H200 (issue 12), default preset mse_k4v3: tiles addressed by page (one block id per tile) and
# the value runs of a chunk chained in one fresh accumulator (chain_values, the default now) against one accumulator
# per run (chain_values=false), 32-token one-warp tiles (128 registers, 16 programs/SM) and software pipelining
# (num_stages=2), side by side with SDPA flash on fp16 KV; then the decode kernel tests (PTX path on the GPU).
# Usage on the device: bash benchmarks/gpu_run8_kdec.sh "$OUT"   (150 s in all; each step has its own limit)
source benchmarks/gpu_preamble.sh "$@"  # OUT, PYTHONPATH, log(), machine and versions
log "decode: chained value runs, 32-token one-warp tiles, vs run 7's kernel and flash"
S='[[1,32,8,1024],[8,32,8,16384],[1,32,8,131072],[8,32,8,65536],[8,28,4,65536]]'
V='[{}, {"chain_values": false}, {"block_n": 32, "num_warps": 1}, {"num_stages": 2}]'
timeout 68 python3 benchmarks/sweep_decode.py --formats mse_k4v3 --out "$OUT/sweep" --shapes "$S" --variants "$V" \
  2>&1 | tee "$OUT/sweep.log" | tail -27
log "decode kernel tests (test_kernels_decode.py, the decode cases of test_kernels_head_dims.py)"
PAR=(); python3 -c "import xdist" 2>/dev/null && PAR=(-n 12)
timeout 66 python3 -m pytest tests/test_kernels_decode.py tests/test_kernels_head_dims.py -k "decode" -q "${PAR[@]}" \
  -p no:cacheprovider --durations=5 > "$OUT/tests.log" 2>&1
echo "tests rc=$?"
grep -v PytestBenchmarkWarning "$OUT/tests.log" | grep -v "warner(" | tail -12
log "done"
