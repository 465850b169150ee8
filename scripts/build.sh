#!/usr/bin/env bash
# Configures (once) and builds commgrad for one LibTorch line, reusing the
# build directory between runs:
#   COMMGRAD_TORCH=pypi   (default) into ./build, against the torch wheel in .venv
#   COMMGRAD_TORCH=system into ./build-system, against Debian's libtorch-dev
#   COMMGRAD_BUILD_DIR    another build directory
#   scripts/build.sh [cmake --build target...]
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
