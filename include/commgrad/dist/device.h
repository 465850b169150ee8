#pragma once
// The device of a rank. Where CUDA devices exist, rank r of a host uses
// cuda:(LOCAL_RANK mod devices) — torchrun's convention — and
// init_process_group() makes it the current CUDA device; elsewhere, cpu.

#include <c10/core/Device.h>

namespace commgrad {

/// CUDA devices this process sees (0 on a CPU-only LibTorch or machine).
int cuda_device_count();

/// This rank's device: cuda:(local_rank() mod cuda_device_count()) where
/// CUDA devices exist, else cpu. Needs init_process_group().
///
/// Example:
///   auto x = torch::ones({4}, torch::TensorOptions().device(commgrad::device()));
c10::Device device();

namespace detail {
/// Makes cuda:(local_rank mod devices) the current CUDA device (init_process_group does).
void select_cuda_device(int local_rank);
}  // namespace detail

}  // namespace commgrad
