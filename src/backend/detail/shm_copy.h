#pragma once
// How a rank copies bytes to and from the shared segment: memcpy, but where
// memcpy runs an order of magnitude slow, and with streaming stores where
// asked (detail/shm_stores.h says when). Internal to commgrad_backend.

#include <cstdint>

namespace commgrad::backend::detail {

/// memcpy of `bytes` from `src` to `dst` (which do not overlap), but for one
/// case where glibc's runs an order of magnitude slow. Measured on AMD Zen 4
/// with glibc 2.36: a copy of 2.1 KiB to 1 MiB whose destination lies 1-15
/// bytes past its source, modulo 4096, ran at 3.5 GB/s against 55 (glibc
/// picks `rep movsb` there, which that CPU runs slowly at such a distance),
/// and at 16-63 bytes 20-25 % slow. A tensor that starts inside its storage
/// (a slice, a shard) meets it against the page-aligned slots at some page
/// offsets. Where the destination lies 1-63 bytes past the source an AVX2
/// loop copies instead (51-53 GB/s there); elsewhere, memcpy.
void copy_bytes(void* dst, const void* src, int64_t bytes);

/// Copies `bytes` from `src` to `dst` with non-temporal stores where the CPU
/// has them (x86), then fences, so that the data is visible to whoever sees a
/// later store (the barrier). Falls back to memcpy elsewhere.
void copy_streaming(void* dst, const void* src, int64_t bytes);

}  // namespace commgrad::backend::detail
