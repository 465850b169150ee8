#pragma once
// A process-wide cache of large host buffers for the results and temporaries
// of collectives.
//
// Why: a differentiable collective returns a fresh tensor, and a training
// loop asks for the same sizes step after step. glibc serves allocations of
// 32 MiB and more with a fresh mmap and returns them to the kernel on free,
// so every call pays one page fault per 4 KiB on first touch (on a virtual
// machine that can cost more than the transfer itself). The pool keeps freed
// blocks and hands them out again, like PyTorch's CUDA caching allocator.
//
// Blocks of at least kMinPooledBytes come from the pool; smaller tensors use
// LibTorch's CPU allocator. Tensors from the pool are ordinary resizable CPU
// tensors; their memory goes back to the pool when the last reference dies,
// on whatever thread that happens. The cache is bounded (COMMGRAD_BUFFER_POOL_MB,
// default 512; 0 turns caching off) and can be emptied at any time.

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include <cstddef>
#include <cstdint>

namespace commgrad {

/// Blocks below this many bytes are not pooled.
constexpr size_t kMinPooledBytes = size_t{1} << 20;

/// A contiguous, uninitialised tensor of `sizes` and `options` (strided),
/// like at::empty; large CPU storage comes from the buffer pool, other
/// devices use their own caching allocators.
at::Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options);

/// A contiguous copy of `x` in `dtype` (one pass: copy and cast), from the pool.
at::Tensor pooled_copy(const at::Tensor& x, at::ScalarType dtype);
inline at::Tensor pooled_copy(const at::Tensor& x) { return pooled_copy(x, x.scalar_type()); }

struct BufferPoolStats {
  size_t cached_bytes = 0;  ///< free blocks held for reuse
  size_t in_use_bytes = 0;  ///< pooled blocks owned by live tensors
  size_t limit_bytes = 0;   ///< most cached_bytes the pool keeps
  uint64_t hits = 0;        ///< allocations served from the cache
  uint64_t misses = 0;      ///< allocations that mapped new memory
};

/// A snapshot of the pool's counters.
BufferPoolStats buffer_pool_stats();

/// Returns every cached block to the system (blocks in use are not touched).
void release_cached_buffers();

/// Sets the most bytes the pool caches (0: cache nothing); frees what is over.
void set_buffer_pool_limit(size_t bytes);

}  // namespace commgrad
