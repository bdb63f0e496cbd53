#!/usr/bin/env bash
# Run 8 (kpre) on the H200 (issue 12, prefill): chunked prefill by a bounded fp16 workspace (the history dequantized
# once per chunk, then an fp16 flash loop with the same window rule) and its knobs, beside the run-7 kernel (in-loop
# dequantization, benchmarks/prefill_run7.py) and SDPA flash: chunk 2048 over 32k history, 32/8 and 28/4, and chunk
# 512 over 8k, mse_k4v3; per-kernel times of one call (profiler); the prefill kernel tests (test_kernels_prefill.py
# and the prefill cases of test_kernels_head_dims.py) beside the compile warm-up. Allowance 130 s wall.
# Usage on the device: bash benchmarks/gpu_run8_kpre.sh "$OUT"   (each step has its own time limit; few files)
source benchmarks/gpu_preamble.sh "$@"  # OUT, PYTHONPATH, log(), machine and versions
V32=('{}' '{"num_stages": 2}' '{"num_stages": 4}' '{"tma": true}' '{"block_m": 64, "num_warps": 4}' '{"impl": "run7"}')
V28=('{}' '{"tma": true}' '{"block_m": 64, "num_warps": 4}')
VSHORT=('{}' '{"impl": "run7"}')
join() { local IFS=,; echo "[$*]"; }
log "kernel tests (-n 8) beside the compile warm-up (one process per shape and variant, Triton's disk cache)"
PAR=(); python3 -c "import xdist" 2>/dev/null && PAR=(-n 8)
timeout 55 python3 -m pytest tests/test_kernels_prefill.py tests/test_kernels_head_dims.py -k "prefill" -q \
  "${PAR[@]}" -p no:cacheprovider --durations=6 > "$OUT/tests.log" 2>&1 &
TESTS=$!
WARM=()
# warm-up shapes: the issue shapes' constexprs and argument divisibility (4096 tokens = 256 block-table entries)
for v in "${V32[@]}"; do
  timeout 50 python3 benchmarks/bench_prefill.py --compile-only --format mse_k4v3 --shapes '[[1,32,8,3840,256]]' \
    --variants "[$v]" >> "$OUT/warm.log" 2>&1 & WARM+=($!)
done
for v in "${V28[@]}"; do
  timeout 50 python3 benchmarks/bench_prefill.py --compile-only --format mse_k4v3 --shapes '[[1,28,4,3840,256]]' \
    --variants "[$v]" >> "$OUT/warm.log" 2>&1 & WARM+=($!)
done
for p in "${WARM[@]}"; do wait "$p" || echo "warm-up pid $p rc=$?"; done
log "warm-up done"
grep -E "Error|error:" "$OUT/warm.log" | tail -3
wait $TESTS; echo "tests rc=$?"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | cut -c1-200 | tail -8
log "prefill, chunk 2048 over 32k, mse_k4v3 ({} = the defaults; run7 = the in-loop kernel)"
timeout 30 python3 benchmarks/bench_prefill.py --format mse_k4v3 --shapes '[[1,32,8,32768,2048]]' \
  --variants "$(join "${V32[@]}")" --json "$OUT/prefill_32_8.json" > "$OUT/bench.log" 2>&1; echo "rc=$?"
timeout 20 python3 benchmarks/bench_prefill.py --format mse_k4v3 --shapes '[[1,28,4,32768,2048]]' \
  --variants "$(join "${V28[@]}")" --json "$OUT/prefill_28_4.json" >> "$OUT/bench.log" 2>&1; echo "rc=$?"
log "prefill, chunk 512 over 8k, 32/8"
timeout 12 python3 benchmarks/bench_prefill.py --format mse_k4v3 --shapes '[[1,32,8,8192,512]]' \
  --variants "$(join "${VSHORT[@]}")" --json "$OUT/prefill_short.json" >> "$OUT/bench.log" 2>&1; echo "rc=$?"
log "per-kernel CUDA times of one call (dequantization, flash), 32/8 chunk 2048 over 32k"
timeout 12 python3 benchmarks/bench_prefill.py --profile --format mse_k4v3 --shapes '[[1,32,8,32768,2048]]' \
  --variants '[{}]' 2>&1 | grep -E "^profile|Error" | cut -c1-110 | tail -6
grep -E "Error" "$OUT/bench.log" | tail -3
log "summary: Hq/Hkv history chunk variant ours_us sdpa_us ours/sdpa check_err"
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for f in ("prefill_32_8", "prefill_28_4", "prefill_short"):
    p = pathlib.Path(sys.argv[1]) / f"{f}.json"
    for r in json.loads(p.read_text()) if p.exists() else []:
        print(r["Hq/Hkv"], r["history"], r["chunk"], r["variant"], f'{r["ours_us"]:.0f} {r["sdpa_us"]:.0f}',
              f'{r["vs_sdpa"]:.2f} {r["check_err"]:.1e}')
PY
log "done"
