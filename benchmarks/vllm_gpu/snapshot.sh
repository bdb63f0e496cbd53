#!/bin/bash
# Copy this worktree (code only) + the bundle (core, wheels, FA3 part; the op library only with WITH_C=1) into DEST for a device call (the device sends /work/main's tree:
# DEST is a git-ignored folder there, passed as `carry`). Usage: benchmarks/vllm_gpu/snapshot.sh DEST [BUNDLE]
set -e
DEST=${1:?destination}; B=${2:-.devwork/vllm_bundle}
rm -rf "$DEST"; mkdir -p "$DEST/bundle"
tar -c --exclude=./.git --exclude=./.venv --exclude=./.devwork --exclude=./out --exclude='__pycache__' \
    --exclude=.pytest_cache --exclude=.hypothesis --exclude='*.egg-info' . | tar -x -C "$DEST"
cp "$B"/vllm-core.tar.gz* "$DEST/bundle/"; cp -r "$B/wheels" "$DEST/bundle/"
for f in "$B"/vllm-fa3.tar.xz*; do [ -e "$f" ] && cp "$f" "$DEST/bundle/"; done
if [ -n "$WITH_C" ]; then for f in "$B"/vllm-c.tar.xz*; do [ -e "$f" ] && cp "$f" "$DEST/bundle/"; done; fi
du -sh "$DEST"
