#!/usr/bin/env bash
# PyTorch's whole distributed suite (CPU tests) on commgrad at 2 and 3 ranks,
# checked against the contract in compare.py. About 25-60 minutes per world
# size on 2 cores (each test starts its ranks as new processes). The suite
# skips the same tests for commgrad as for Gloo (commgrad runs under Gloo's
# name), so only what runs is compared. Usage (with the package installed):
#   python/tests/torch_suite/run_all.sh [OUT_DIR] [WORLD_SIZES...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-$here/../../../.venv/bin/python}
out=${1:-$(mktemp -d)}
shift || true
sizes=("${@:-2 3}")
status=0
for n in ${sizes[*]}; do
  "$python" "$here/run_suite.py" --backend commgrad --world-size "$n" --json "$out/commgrad$n.json" > "$out/commgrad$n.log" 2>&1
  "$python" "$here/compare.py" "$out/commgrad$n.json" --world-size "$n" || status=1
done
echo "results and logs in $out"
exit $status
