#!/bin/bash
# Unpack the vLLM bundle on the GPU machine and register jetson-tq as a vLLM plugin; then `export` the paths.
#   source benchmarks/vllm_gpu/unpack.sh [BUNDLE_DIR] [SITE]      (run from the repository root)
# Wheels go in with pip --no-index --no-deps --target; vllm-core.tar.gz(.partNN) is extracted next to them, then
# every optional part found (parts.py: in BUNDLE_DIR or JTQ_PARTS, default /tmp/jtq_parts; JTQ_REQUIRE_PARTS="moe"
# stops here when a staged part is missing);
# a jetson_tq dist-info with the `vllm.general_plugins` entry point makes vLLM load our plugin from the
# tree (PYTHONPATH), so no build step is needed. Prints the seconds each step took.
B=${1:-.devwork/vllm_bundle}
SITE=${2:-/tmp/jtq_site}
REPO=$(pwd)
t0=$(date +%s%N)
rm -rf "$SITE"; mkdir -p "$SITE"  # fresh each run (a warm machine keeps /tmp)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$B"/wheels/*.whl || return 1 2>/dev/null || exit 1
t1=$(date +%s%N)
cat "$B"/vllm-core.tar.gz* | tar -xzf - -C "$SITE" || return 1 2>/dev/null || exit 1
# optional parts (vllm-{c,moe,fa3}.tar.xz, checksummed) from the bundle or from earlier staging calls' /tmp/jtq_parts
python3 benchmarks/vllm_gpu/parts.py extract "$SITE" "$B" "${JTQ_PARTS:-/tmp/jtq_parts}" || return 1 2>/dev/null || exit 1
t2=$(date +%s%N)
VER=$(python3 -c "import tomllib;print(tomllib.load(open('pyproject.toml','rb'))['project']['version'])")
DI="$SITE/jetson_tq-$VER.dist-info"
mkdir -p "$DI"
printf 'Metadata-Version: 2.1\nName: jetson-tq\nVersion: %s\n' "$VER" > "$DI/METADATA"
printf '[vllm.general_plugins]\njetson_tq = jetson_tq.integrations.vllm.plugin:register\n' > "$DI/entry_points.txt"
printf 'jetson_tq\n' > "$DI/top_level.txt"
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/jtq_triton_cache} VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-/tmp/jtq_vllm_cache}
python3 - <<'PY'
import importlib.metadata as m, time
t = time.time()
import vllm
eps = [e.value for e in m.entry_points(group="vllm.general_plugins")]
print(f"unpack: vllm {vllm.__version__} from {vllm.__file__}; plugins {eps}; import {time.time() - t:.1f} s")
import importlib.util as u  # which op libraries vLLM will load: the real .so, or the bundle's stand-in / none
print("unpack: op libraries " + ", ".join(
    f"{n}: {(u.find_spec('vllm.' + n) or type('', (), {'origin': 'absent'})).origin.rsplit('/', 1)[-1]}"
    for n in ("_C_stable_libtorch", "_moe_C_stable_libtorch")))
PY
echo "unpack: wheels $(( (t1 - t0) / 1000000 )) ms, vllm tar $(( (t2 - t1) / 1000000 )) ms, site $(du -sh "$SITE" | cut -f1)"
