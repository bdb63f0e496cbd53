#!/usr/bin/env bash
# One device call: tests/test_vllm_scheduling.py (scheduling invariance, prefix caching, preemption; issue 14) on the
# GPU beside the default preset's forced-preemption greedy run (correctness only, so they may share the GPU), then the
# 32k aggregate (ours, stock) alone on the GPU. Everything ends up in OUT/results.tgz (a call returns few files).
#   bash benchmarks/vllm_gpu/checks_then_aggregate.sh OUT [TOTAL_SECONDS]   (repo root = the vllmgpu snapshot)
set -u
OUT=${1:?out}; TOTAL=${2:-570}; T0=$(date +%s); R="$OUT/r"; mkdir -p "$R"
source benchmarks/vllm_gpu/unpack.sh bundle /tmp/jtq_site > "$R/unpack.log" 2>&1 || { cat "$R/unpack.log"; exit 1; }
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_DEEP_GEMM_WARMUP=skip JTQ_MODELS=/tmp/jtq_models PYTHONUNBUFFERED=1
(VLLM_ENABLE_V1_MULTIPROCESSING=1 timeout 170 python3 -m pytest tests/test_vllm_scheduling.py -v -p no:cacheprovider \
  --durations=5 > "$R/sched.log" 2>&1; echo "sched rc=$?" >> "$R/sched.log") &
SCHED=$!
python3 benchmarks/vllm_gpu/run.py --out "$R/corr" --plan corr --only corr_ours_k4v3_preempt --budget 150 \
  > "$R/corr.log" 2>&1
wait $SCHED
echo "=== sched ($(( $(date +%s) - T0 )) s)"; grep -E "PASS|FAIL|ERROR|passed|failed|rc=" "$R/sched.log" | tail -12
echo "=== corr"; grep -v '"kind": "capacity"' "$R/corr.log" | cut -c1-400 | tail -6
LEFT=$(( TOTAL - ($(date +%s) - T0) ))
echo "=== aggregate, budget $LEFT s"
python3 benchmarks/vllm_gpu/run.py --out "$R/agg" --plan agg --budget "$LEFT" > "$R/agg.log" 2>&1
cut -c1-700 "$R/agg.log" | tail -8
python3 -c "import json; print(json.dumps(json.load(open('$R/agg/summary.json'))['targets']))" 2>&1 | tail -2
tar -czf "$OUT/results.tgz" -C "$R" . && rm -rf "$R"
echo "=== done after $(( $(date +%s) - T0 )) s"
