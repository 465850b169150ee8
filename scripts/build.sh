#!/usr/bin/env bash
# Configures (once) and builds commgrad for one LibTorch line, reusing the
# build directory between runs:
#   COMMGRAD_TORCH=pypi   (default) into ./build, against the torch wheel in .venv
#   COMMGRAD_TORCH=system into ./build-system, against Debian's libtorch-dev
#   COMMGRAD_BUILD_DIR    another build directory
#   scripts/build.sh [cmake --build target...]
# Without targets, on the pypi line, it also installs the Python package
# (python/: `import commgrad`) into the virtual environment, its extension
# linked against this build tree (built in <build dir>/python).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
jobs=${COMMGRAD_JOBS:-$(nproc)}

cache=$build_dir/CMakeCache.txt
if [[ -f $cache ]] && ! grep -qx "COMMGRAD_TORCH_LINE:STRING=$COMMGRAD_TORCH" "$cache"; then
  echo "build: $build_dir was configured for another LibTorch line than COMMGRAD_TORCH=$COMMGRAD_TORCH;" \
       "remove it or set COMMGRAD_BUILD_DIR" >&2
  exit 2
fi
if [[ ! -f $build_dir/build.ninja ]]; then
  args=(-DCMAKE_BUILD_TYPE=Release -DCOMMGRAD_TORCH_LINE="$COMMGRAD_TORCH")
  if [[ $COMMGRAD_TORCH == pypi ]]; then
    args+=(-DCMAKE_PREFIX_PATH="$(torch_prefix)")
  fi
  cmake -S . -B "$build_dir" -G Ninja "${args[@]}"
fi
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$build_dir" -j "$jobs" "${targets[@]}"

if [[ $COMMGRAD_TORCH == pypi && $# -eq 0 ]]; then
  # --no-build-isolation: the extension must be built against the
  # environment's own torch; --no-deps: pip leaves torch alone.
  echo "build: installing the Python package (python/) into ${COMMGRAD_VENV#"$PWD"/}"
  tree=$(cd "$build_dir" && pwd)
  CMAKE_BUILD_PARALLEL_LEVEL=$jobs "$COMMGRAD_VENV/bin/python" -m pip install -q --disable-pip-version-check \
    --no-build-isolation --no-deps \
    -C cmake.define.CMAKE_PREFIX_PATH="$tree" -C build-dir="$tree/python" ./python
fi
