#!/usr/bin/env bash
# Run 8 (decode) on the H200 (issue 12), call C: the final default of the one-warp 3/4-bit-key programs (tiles
# addressed by page, value runs chained per chunk, softmax sum reduced once, num_stages=2) against the same kernel
# without software pipelining (num_stages=1, call B's default), side by side with SDPA flash on fp16 KV: the default
# preset mse_k4v3 at the five issue-12 shapes, mse_k4v3u (uniform keys, the same one-warp programs) at two.
# Call B (commit b4196a6) timed the candidates: sweep variants {}, chain_values=false, block_n=32/num_warps=1,
# num_stages=2. The decode kernel tests run in the lead's full GPU test run of the merged tree.
# Usage on the device: bash benchmarks/gpu_run8_kdec.sh "$OUT"   (90 s in all; each step has its own limit)
source benchmarks/gpu_preamble.sh "$@"  # OUT, PYTHONPATH, log(), machine and versions
log "decode mse_k4v3: default (num_stages=2) vs num_stages=1 vs flash"
S='[[1,32,8,1024],[8,32,8,16384],[1,32,8,131072],[8,32,8,65536],[8,28,4,65536]]'
timeout 45 python3 benchmarks/sweep_decode.py --formats mse_k4v3 --out "$OUT/sweep" --shapes "$S" \
  --variants '[{}, {"num_stages": 1}]' 2>&1 | tee "$OUT/sweep.log" | tail -17
log "decode mse_k4v3u: default vs num_stages=1 vs flash"
timeout 30 python3 benchmarks/sweep_decode.py --formats mse_k4v3u --out "$OUT/sweep_u" \
  --shapes '[[8,32,8,65536],[1,32,8,131072]]' --variants '[{}, {"num_stages": 1}]' 2>&1 | tee "$OUT/sweep_u.log" | tail -8
log "done"
