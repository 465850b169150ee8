#!/usr/bin/env bash
# Formats every C++ file git tracks with .clang-format, or with --check
# lists the files that are not formatted and exits 1 (the test command runs
# the check). Needs clang-format (scripts/deps.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.cpp' '*.h' '*.cu' '*.c')
if [[ ${1:-} == --check ]]; then
  bad=()
  for f in "${files[@]}"; do
    clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
  done
  if ((${#bad[@]} > 0)); then
    echo "format: ${#bad[@]} file(s) differ from .clang-format (scripts/format.sh fixes them):" >&2
    printf '  %s\n' "${bad[@]}" >&2
    exit 1
  fi
  echo "format: all ${#files[@]} C++ files follow .clang-format"
else
  clang-format -i "${files[@]}"
fi
