#!/usr/bin/env bash
# Sourced by every benchmarks/gpu_run*.sh (repo root as cwd): OUT (the script's first argument, else /tmp/<script>),
# the tree on PYTHONPATH, log(), and the machine and versions as the first lines of the output.
set -o pipefail
OUT=${1:-/tmp/$(basename "$0" .sh)}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log() { echo "=== $* ($(date -u +%T))"; }
log env
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
