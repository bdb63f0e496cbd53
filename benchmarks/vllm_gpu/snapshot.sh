#!/bin/bash
# Copy this worktree (code only) + the bundle (core, wheels, FA3 part) into DEST for a device call (the device sends
# /work/main's tree: DEST is a git-ignored folder there, passed as `carry`); PARTS="moe c" also puts each op library
# part in DEST-KEY/ for a staging call, and every call's bytes are checked against the 64 MiB limit (parts.py plan).
# Usage: [PARTS="moe c"] benchmarks/vllm_gpu/snapshot.sh DEST [BUNDLE]
set -e
DEST=${1:?destination}; B=${2:-.devwork/vllm_bundle}
rm -rf "$DEST"; mkdir -p "$DEST/bundle"
tar -c --exclude=./.git --exclude=./.venv --exclude=./.devwork --exclude=./out --exclude='__pycache__' \
    --exclude=.pytest_cache --exclude=.mypy_cache --exclude=.ruff_cache --exclude=.hypothesis --exclude='*.egg-info' . | tar -x -C "$DEST"
cp "$B"/vllm-core.tar.gz* "$B/manifest.json" "$DEST/bundle/"; cp -r "$B/wheels" "$DEST/bundle/"
for f in "$B"/vllm-fa3.tar.xz*; do [ -e "$f" ] && cp "$f" "$DEST/bundle/"; done
# the op libraries do not fit one call beside the bundle: each goes in DEST-KEY/ with a copy of parts.py, carried by
# a staging call of its own (`python3 DEST-KEY/parts.py stage DEST-KEY`) made just before the call carrying DEST
CALLS=()
for key in ${PARTS:-}; do
  rm -rf "$DEST-$key"; mkdir -p "$DEST-$key"
  cp "$B"/vllm-"$key".tar.xz* "$DEST-$key/" || { echo "snapshot: no vllm-$key.tar.xz in $B (bundle.py --with-$key)"; exit 1; }
  cp "$B/manifest.json" benchmarks/vllm_gpu/parts.py "$DEST-$key/"
  CALLS+=("$DEST-$key")
done
python3 benchmarks/vllm_gpu/parts.py plan "${CALLS[@]}" "$DEST"
