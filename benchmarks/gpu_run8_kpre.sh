#!/usr/bin/env bash
# Run 8 (kpre) on the H200 (issue 12, prefill), call C: the final default — chunked prefill by a bounded fp16
# workspace (history dequantized once per chunk, then an fp16 flash loop with the same window rule) — against SDPA
# flash: chunk 2048 over 32k history at 32/8 and 28/4, chunk 512 over 8k at 32/8, mse_k4v3; then per-kernel times of
# one call (query transform, dequantization, flash). The prefill tests run in the lead's kernel-test run. 75 s wall.
# As run in call B (2026-12-01 19:17 UTC, commit 85808f9; raw output results/h200_2026-12-01/run8_kpre/callB/): the
# variants were {} num_stages 2/4, tma, block_m 64 with 4 warps and the run-7 kernel ({"impl": "run7"}), plus
# tests/test_kernels_prefill.py and the prefill cases of test_kernels_head_dims.py beside the warm-up. Call C (19:55 UTC,
# main 712f508) ran this version: raw output results/h200_2026-12-01/run8_kpre/callC/ (its profile step timed out).
# Usage on the device: bash benchmarks/gpu_run8_kpre.sh "$OUT"   (each step has its own time limit; few files)
source benchmarks/gpu_preamble.sh "$@"  # OUT, PYTHONPATH, log(), machine and versions
log "compile warm-up, one process per head layout (Triton's disk cache)"
WARM=()
for hs in '32,8' '28,4'; do  # the issue shapes' constexprs and argument divisibility (4096 tokens = 256 blocks)
  timeout 40 python3 benchmarks/bench_prefill.py --compile-only --format mse_k4v3 --shapes "[[1,$hs,3840,256]]" \
    >> "$OUT/warm.log" 2>&1 & WARM+=($!)
done
for p in "${WARM[@]}"; do wait "$p" || echo "warm-up pid $p rc=$?"; done
grep -E "Error|error:" "$OUT/warm.log" | tail -3
log "prefill vs SDPA: chunk 2048 over 32k (32/8, 28/4), chunk 512 over 8k (32/8)"
timeout 30 python3 benchmarks/bench_prefill.py --format mse_k4v3 \
  --shapes '[[1,32,8,32768,2048],[1,28,4,32768,2048],[1,32,8,8192,512]]' --json "$OUT/prefill.json" \
  > "$OUT/bench.log" 2>&1; echo "rc=$?"
grep -E "Error" "$OUT/bench.log" | tail -3
log "per-kernel CUDA times of one call, 32/8 chunk 2048 over 32k"
timeout 12 python3 benchmarks/bench_prefill.py --profile --format mse_k4v3 --shapes '[[1,32,8,32768,2048]]' \
  2>&1 | grep -E "^profile|Error" | cut -c1-110 | tail -6
log "summary: Hq/Hkv history chunk variant ours_us sdpa_us ours/sdpa ours_TFLOPs sdpa_TFLOPs check_err"
python3 - "$OUT/prefill.json" <<'PY'
import json, pathlib, sys
p = pathlib.Path(sys.argv[1])
for r in json.loads(p.read_text()) if p.exists() else []:
    print(r["Hq/Hkv"], r["history"], r["chunk"], r["variant"], f'{r["ours_us"]:.0f} {r["sdpa_us"]:.0f}',
          f'{r["vs_sdpa"]:.2f} {r["ours_TFLOPs"]:.0f} {r["sdpa_TFLOPs"]:.0f} {r["check_err"]:.1e}')
PY
log "done"
