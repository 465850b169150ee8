#!/usr/bin/env bash
# README command 2: install what is missing, build everything, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh
cd build
# Ranks are threads or processes on 2 cores: two tests at a time.
ctest --output-on-failure -j "${COMMGRAD_TEST_JOBS:-2}" "$@"
# The shm transport's in-process tests under AddressSanitizer + UBSan, in a
# tree of their own (a few minutes; COMMGRAD_TEST_SANITIZER=0 skips it).
if [[ "${COMMGRAD_TEST_SANITIZER:-1}" != 0 && $# -eq 0 ]]; then
  cmake --build . --target check-shm-asan
fi
