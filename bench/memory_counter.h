#pragma once
// Bytes of CPU tensor storage alive in this process, counted exactly.
//
// count_cpu_allocations() puts an at::Allocator in front of LibTorch's CPU
// allocator (c10::SetCPUAllocator): every CPU storage allocated from then on
// is counted when it is made and when it is freed, whichever thread does
// it. The difference of live_cpu_bytes() around a forward is what the
// forward left alive: the activations autograd holds for backward plus
// the output (views share their storage and count once). Storage allocated
// before the call (parameters made earlier) is never counted, so measure
// differences only. Allocations outside tensors (oneDNN scratch, the
// transports' buffers) are not seen.

#include <cstdint>

namespace commgrad::bench {

/// Installs the counting allocator (the first call; later calls do nothing).
void count_cpu_allocations();
/// Bytes of CPU storage allocated since count_cpu_allocations() and not yet freed.
int64_t live_cpu_bytes();
/// The highest live_cpu_bytes() since the last reset_peak_cpu_bytes().
int64_t peak_cpu_bytes();
/// Makes the peak the current live bytes.
void reset_peak_cpu_bytes();

}  // namespace commgrad::bench
