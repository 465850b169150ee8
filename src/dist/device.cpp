// The rank's device. The current CUDA device is set through c10's device
// guard registry, which LibTorch's CUDA library fills when it is loaded, so
// this file needs no CUDA headers and compiles on CPU-only LibTorch too.

#include "commgrad/dist/device.h"

#include "commgrad/dist/process_group.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

namespace commgrad {
namespace {

// cuda:(local_rank mod devices), or cpu without CUDA devices.
c10::Device device_of(int local_rank) {
  const int devices = cuda_device_count();
  if (devices == 0) return c10::Device(c10::DeviceType::CPU);
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(local_rank % devices));
}

}  // namespace

int cuda_device_count() { return static_cast<int>(torch::cuda::device_count()); }

c10::Device device() { return device_of(local_rank()); }

namespace detail {

void select_cuda_device(int local_rank) {
  const c10::Device d = device_of(local_rank);
  if (d.is_cuda()) c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->setDevice(d);
}

}  // namespace detail
}  // namespace commgrad
