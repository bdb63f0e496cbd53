#!/usr/bin/env bash
# One device call for several snapshots: each NAME=SECONDS runs `bash benchmarks/gpu_run8_NAME.sh $OUT/NAME` inside
# .devwork/NAME/tree under `timeout SECONDS` (helpers' branches, carried as .devwork/NAME/tree), one after another.
#   bash benchmarks/gpu_batch.sh OUT kdec=150 kpre=120 ...
set -u
OUT=${1:?out dir}; shift
ROOT=$PWD
for spec in "$@"; do
  name=${spec%%=*}; secs=${spec#*=}
  dir="$ROOT/.devwork/$name/tree"; mkdir -p "$OUT/$name"
  if [ ! -f "$dir/benchmarks/gpu_run8_$name.sh" ]; then echo "=== $name: no script, skipped"; continue; fi
  echo "=== $name (limit $secs s, $(date -u +%T))"
  t0=$(date +%s)
  (cd "$dir" && PYTHONPATH="$dir" PYTHONUNBUFFERED=1 timeout -k 5 "$secs" bash "benchmarks/gpu_run8_$name.sh" "$OUT/$name") \
    > "$OUT/$name/stdout.log" 2>&1
  echo "=== $name rc=$? after $(( $(date +%s) - t0 )) s"; tail -c 3000 "$OUT/$name/stdout.log"
done
