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

# Create .venv with the pinned CPU stack; re-install only when the requirement files change.
setup_venv() {
  local stamp="$VENV/.jetson_tq_stamp" want
  want="$(cat "$ROOT"/requirements/*.txt "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then return 0; fi
  echo "[jetson-tq] setting up $VENV (pinned CPU stack, first run takes a few minutes)" >&2
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q -r "$ROOT/requirements/cpu-test.txt"
  "$PY" -m pip install -q --no-deps -e "$ROOT"
  echo "$want" > "$stamp"
}

mode="${1:-}"
[[ $# -gt 0 ]] && shift
case "$mode" in
  demo) setup_venv; exec "$PY" -m jetson_tq demo "$@" ;;
  test) setup_venv; cd "$ROOT"; exec "$PY" -m pytest "$@" ;;
  -h|--help|help) usage ;;
  *) usage >&2; exit 2 ;;
esac
