#pragma once
// Addresses and byte ranges as the shm backend compares and publishes them.
// Header-only: both are on the path of every call that may read a peer.

#include <cstdint>

namespace commgrad::backend::detail {

/// `p` as the integer a peer passes to process_vm_readv (it is published
/// in the segment's int64 fields).
inline int64_t address_of(const void* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); }

/// True when [a, a + a_bytes) and [b, b + b_bytes) share a byte; an empty
/// range overlaps nothing.
inline bool overlap(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a);
  const auto y = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + static_cast<uintptr_t>(b_bytes) &&
         y < x + static_cast<uintptr_t>(a_bytes);
}

}  // namespace commgrad::backend::detail
