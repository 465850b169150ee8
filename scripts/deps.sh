#!/usr/bin/env bash
# Installs what commgrad needs from Debian's packages, only when something is
# missing (idempotent: a second run installs nothing and prints nothing).
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev libgloo-dev          # LibTorch 1.13 (CPU, Gloo); c10d headers need Gloo's
  libopenblas0-pthread              # the active BLAS: reference BLAS makes matmul ~20x slower
  libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev
  procps                            # pgrep/ps, used by the launcher tests
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  echo "deps: installing ${missing[*]}"
  sudo_cmd=()
  [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Make OpenBLAS the BLAS that LibTorch's libblas.so.3 resolves to.
blas_alt=libblas.so.3-x86_64-linux-gnu
openblas=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
if [[ -e $openblas ]] && [[ $(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3) != "$(readlink -f $openblas)" ]]; then
  echo "deps: selecting OpenBLAS as libblas.so.3"
  sudo_cmd=()
  [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" update-alternatives --set "$blas_alt" "$openblas"
fi
