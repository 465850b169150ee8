# Sourced by the scripts: which LibTorch line, and where its build lives.
#   COMMGRAD_TORCH=pypi    (default) LibTorch from PyPI's torch wheel in .venv
#   COMMGRAD_TORCH=system  Debian's libtorch-dev (1.13)
COMMGRAD_TORCH=${COMMGRAD_TORCH:-pypi}
case $COMMGRAD_TORCH in
  pypi | system) ;;
  *) echo "COMMGRAD_TORCH must be 'pypi' or 'system', got '$COMMGRAD_TORCH'" >&2; exit 2 ;;
esac
COMMGRAD_VENV=${COMMGRAD_VENV:-$PWD/.venv}
if [[ $COMMGRAD_TORCH == pypi ]]; then
  default_build_dir=build
else
  default_build_dir=build-system
fi
build_dir=${COMMGRAD_BUILD_DIR:-$default_build_dir}

# The CMake prefix path of the line's LibTorch (empty for the system one,
# which CMake finds by itself): the wheel's share/cmake for TorchConfig, and
# the torch package itself so that its lib/ is searched before the system's
# (another LibTorch may be installed there).
torch_prefix() {
  if [[ $COMMGRAD_TORCH == pypi ]]; then
    "$COMMGRAD_VENV/bin/python" -c \
      'import os, torch.utils; print(torch.utils.cmake_prefix_path + ";" + os.path.dirname(torch.__file__))' 2>/dev/null
  fi
}
