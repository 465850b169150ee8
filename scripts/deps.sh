#!/usr/bin/env bash
# Installs what commgrad needs, only when something is missing (idempotent:
# a second run installs nothing and prints nothing).
#   COMMGRAD_TORCH=pypi    (default) PyPI's torch wheel (scripts/torch-requirements.txt)
#                          into the project's virtual environment .venv, and
#                          the Python build and test tools (scripts/python-requirements.txt)
#   COMMGRAD_TORCH=system  Debian's libtorch-dev 1.13 and libgloo-dev
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev
  procps                            # pgrep/ps, used by the launcher tests
  clang-format                      # scripts/format.sh --check, run by the test command
  libgloo-dev                       # c10d's ProcessGroupGloo.hpp includes Gloo's headers (no wheel ships them)
  nlohmann-json3-dev zlib1g-dev     # checkpoints: the JSON index, crc32 checksums
)
# The PyPI line's virtual environment (any python3 that makes one will do).
if [[ $COMMGRAD_TORCH == pypi ]] && ! python3 -m venv --help >/dev/null 2>&1; then
  packages+=(python3 python3-venv)
fi
if [[ $COMMGRAD_TORCH == system ]]; then
  packages+=(
    libtorch-dev                    # LibTorch 1.13 (CPU, Gloo)
    libopenblas0-pthread            # the active BLAS: reference BLAS makes matmul ~20x slower
  )
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
sudo_cmd=()
[[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
if ((${#missing[@]})); then
  echo "deps: installing ${missing[*]}"
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [[ $COMMGRAD_TORCH == system ]]; then
  # Make OpenBLAS the BLAS that LibTorch's libblas.so.3 resolves to.
  blas_alt=libblas.so.3-x86_64-linux-gnu
  openblas=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
  if [[ -e $openblas ]] && [[ $(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3) != "$(readlink -f $openblas)" ]]; then
    echo "deps: selecting OpenBLAS as libblas.so.3"
    "${sudo_cmd[@]}" update-alternatives --set "$blas_alt" "$openblas"
  fi
  exit 0
fi

# The PyPI line: the pinned torch in the project's virtual environment.
wanted=$(sed -n 's/^torch==//p' scripts/torch-requirements.txt)
have=$("$COMMGRAD_VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [[ $have != "$wanted" ]]; then
  echo "deps: installing torch $wanted into ${COMMGRAD_VENV#"$PWD"/} (about 3 GB the first time)"
  [[ -x $COMMGRAD_VENV/bin/python ]] || python3 -m venv "$COMMGRAD_VENV"
  "$COMMGRAD_VENV/bin/python" -m pip install -q --disable-pip-version-check --progress-bar off \
    -r scripts/torch-requirements.txt
fi
# The Python package's build backend and what the tests use from Python, pinned.
if ! "$COMMGRAD_VENV/bin/python" - scripts/python-requirements.txt <<'PY' 2>/dev/null; then
import sys
from importlib.metadata import version
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, wanted = line.split("==")
        if version(name) != wanted:
            sys.exit(1)
PY
  echo "deps: installing the Python build and test tools (scripts/python-requirements.txt)"
  "$COMMGRAD_VENV/bin/python" -m pip install -q --disable-pip-version-check --progress-bar off \
    -r scripts/python-requirements.txt
fi
