#!/usr/bin/env bash
# README command 2: install what is missing, build everything, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh
cd build
# Ranks are threads or processes on 2 cores: two tests at a time.
ctest --output-on-failure -j "${COMMGRAD_TEST_JOBS:-2}" "$@"
