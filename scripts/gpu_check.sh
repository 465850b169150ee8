#!/usr/bin/env bash
# The GPU check, for a machine with CUDA GPUs and any PyTorch 2.x: builds
# commgrad against that PyTorch's LibTorch with every core, then runs
#   1. the tests labelled `cuda` (tests/cuda),
#   2. the founding example on CUDA tensors (1 and 2 ranks),
#   3. megatron_ffn and ddp_train with --device cuda at 1 and 2 ranks: the
#      model on the GPU, checked against its CPU reference.
# NCCL needs one GPU per rank: on a machine with one GPU, NCCL runs as a
# world of one and the multi-rank runs move CUDA tensors over Gloo (shm for
# CPU tensors), the ranks sharing the GPU.
#
#   scripts/gpu_check.sh --pack   on a build machine: copy what a bare GPU
#                                 machine lacks (GoogleTest and Gloo's headers,
#                                 from Debian's packages) into .gpu-deps/
#   scripts/gpu_check.sh          on the GPU machine (with .gpu-deps/ there)
#
# COMMGRAD_PYTHON names the python whose torch to use (default python3);
# COMMGRAD_BUILD_DIR the build tree (default build-gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
deps=$PWD/.gpu-deps
multiarch=x86_64-linux-gnu

if [[ ${1:-} == --pack ]]; then
  rm -rf "$deps"
  mkdir -p "$deps/include" "$deps/lib/$multiarch/cmake"
  cp -r /usr/include/gtest /usr/include/gmock /usr/include/gloo "$deps/include/"
  cp /usr/lib/$multiarch/libgtest*.a /usr/lib/$multiarch/libgmock*.a "$deps/lib/$multiarch/"
  cp -r /usr/lib/$multiarch/cmake/GTest "$deps/lib/$multiarch/cmake/"
  echo "gpu_check: packed $(du -sh "$deps" | cut -f1) into .gpu-deps (carry it to the GPU machine)"
  exit 0
fi

start=$SECONDS
python=${COMMGRAD_PYTHON:-python3}
build_dir=${COMMGRAD_BUILD_DIR:-build-gpu}
torch_prefix=$("$python" -c 'import os, torch.utils; print(torch.utils.cmake_prefix_path + ";" + os.path.dirname(torch.__file__))')
echo "== gpu_check: $("$python" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count())')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

prefix_path=$torch_prefix
extra_flags=""
if [[ -d $deps ]]; then
  prefix_path="$prefix_path;$deps"
  extra_flags="-isystem $deps/include"
fi
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
mkdir -p "$build_dir"
cmake -S . -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCOMMGRAD_BUILD_BENCH=OFF \
  "-DCMAKE_PREFIX_PATH=$prefix_path" "-DCMAKE_CXX_FLAGS=$extra_flags" >"$build_dir/configure.log" 2>&1 ||
  { cat "$build_dir/configure.log"; exit 1; }
grep "commgrad " "$build_dir/configure.log" || true
cmake --build "$build_dir" -j "$(nproc)" --target commgrad-run tp_autograd_comm megatron_ffn ddp_train cuda_test
echo "== gpu_check: built in $((SECONDS - start)) s"

status=0
step() {
  echo "== gpu_check: $*"
  if ! "$@"; then
    echo "== gpu_check: FAILED: $*"
    status=1
  fi
}
run=$build_dir/bin/commgrad-run
step "$run" --version
step ctest --test-dir "$build_dir" -L cuda --output-on-failure --timeout 300
for n in 1 2; do
  step "$run" -n "$n" --timeout 120 "$build_dir/bin/tp_autograd_comm" --device cuda
  step "$run" -n "$n" --timeout 300 "$build_dir/bin/megatron_ffn" --device cuda
  step "$run" -n "$n" --timeout 300 "$build_dir/bin/ddp_train" --device cuda
done
echo "== gpu_check: $( ((status == 0)) && echo OK || echo FAILED) in $((SECONDS - start)) s"
exit $status
