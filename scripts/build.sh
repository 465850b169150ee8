#!/usr/bin/env bash
# Configures (once) and builds commgrad in ./build, reusing it between runs.
#   scripts/build.sh [cmake --build target...]
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${COMMGRAD_BUILD_DIR:-build}
jobs=${COMMGRAD_JOBS:-$(nproc)}

if [[ ! -f $build_dir/build.ninja ]]; then
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release
fi
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$build_dir" -j "$jobs" "${targets[@]}"
