// The buffer pool: free lists of mmap'ed blocks keyed by size class, behind
// one mutex (an allocation or a release is a few hundred nanoseconds against
// the milliseconds of moving a megabyte). Blocks are rounded up to at most
// 1/8 above their size, so a step whose shapes vary a little still hits.

#include "commgrad/util/buffer_pool.h"
#include "commgrad/util/env.h"

#include "commgrad/detail/torch_compat.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <sys/mman.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

namespace commgrad {
namespace {

constexpr size_t kDefaultLimitMiB = 512;

// Sizes from kMinPooledBytes up round to a multiple of 1/8 of their highest
// power of two (at least a page).
size_t size_class(size_t n) {
  size_t top = 1;
  while (top <= n / 2) top <<= 1;
  const size_t grain = std::max<size_t>(top / 8, 4096);
  return (n + grain - 1) / grain * grain;
}

void* map_block(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(p != MAP_FAILED, "[commgrad] buffer pool: out of memory mapping ", bytes, " bytes");
  // Transparent huge pages where the system allows them on request: 512x
  // fewer page faults when a new block is first touched.
  madvise(p, bytes, MADV_HUGEPAGE);
  return p;
}

size_t limit_from_environment() {
  const auto mib = env::get_count("COMMGRAD_BUFFER_POOL_MB", "MiB");
  return static_cast<size_t>(mib.value_or(kDefaultLimitMiB)) << 20;
}

struct Block {
  void* ptr;
  size_t bytes;
};

class Pool {
 public:
  Pool() : limit_(limit_from_environment()) {}

  c10::DataPtr allocate(size_t n) {
    const size_t bytes = size_class(n);
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(bytes);
      if (it != free_.end() && !it->second.empty()) {
        ptr = it->second.back();
        it->second.pop_back();
        cached_ -= bytes;
        ++hits_;
      } else {
        ++misses_;
      }
      in_use_ += bytes;
    }
    if (ptr == nullptr) {
      try {
        ptr = map_block(bytes);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        in_use_ -= bytes;
        throw;
      }
    }
    return {ptr, new Block{ptr, bytes}, &Pool::release, c10::Device(c10::DeviceType::CPU)};
  }

  BufferPoolStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {cached_, in_use_, limit_, hits_, misses_};
  }

  void set_limit(size_t bytes) {
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      limit_ = bytes;
      evict_locked(0, limit_, evicted);
    }
    unmap(evicted);
  }

  void release_cached() {
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      evict_locked(0, 0, evicted);
    }
    unmap(evicted);
  }

 private:
  static void release(void* context) {
    auto* block = static_cast<Block*>(context);
    instance().give_back(*block);
    delete block;
  }

  void give_back(const Block& block) {
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      in_use_ -= block.bytes;
      if (block.bytes <= limit_) {
        // The block just freed is the likeliest to be asked for again: make room for it.
        evict_locked(block.bytes, limit_, evicted);
        free_[block.bytes].push_back(block.ptr);
        cached_ += block.bytes;
      } else {
        evicted.push_back(block);
      }
    }
    unmap(evicted);
  }

  // Moves cached blocks to `out` until `incoming` more bytes fit under `target`.
  void evict_locked(size_t incoming, size_t target, std::vector<Block>& out) {
    for (auto it = free_.begin(); it != free_.end() && cached_ + incoming > target;) {
      auto& list = it->second;
      while (!list.empty() && cached_ + incoming > target) {
        out.push_back({list.back(), it->first});
        list.pop_back();
        cached_ -= it->first;
      }
      it = list.empty() ? free_.erase(it) : std::next(it);
    }
  }

  static void unmap(const std::vector<Block>& blocks) {
    for (const Block& b : blocks) munmap(b.ptr, b.bytes);
  }

 public:
  static Pool& instance() {
    // Never destroyed: tensors may give blocks back during static destruction.
    static Pool* pool = new Pool();
    return *pool;
  }

 private:
  std::mutex mutex_;
  std::map<size_t, std::vector<void*>> free_;
  size_t cached_ = 0;
  size_t in_use_ = 0;
  size_t limit_;
  uint64_t hits_ = 0;
  uint64_t misses_ = 0;
};

// The c10 allocator behind pooled tensors, so that they stay resizable.
struct PoolAllocator final : detail::AllocatorBase {
  c10::DataPtr allocate_bytes(size_t n) const override {
    if (n < kMinPooledBytes) return c10::GetCPUAllocator()->allocate(n);
    return Pool::instance().allocate(n);
  }
};

PoolAllocator g_allocator;

}  // namespace

at::Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  TORCH_CHECK(options.layout() == at::kStrided, "[commgrad] pooled_empty: only strided tensors are pooled, got ",
              options);
  // Other devices have their own caching allocators (CUDA's).
  if (!options.device().is_cpu()) return at::empty(sizes, options.memory_format(at::MemoryFormat::Contiguous));
  const auto dtype = c10::typeMetaToScalarType(options.dtype());
  if (c10::multiply_integers(sizes) * c10::elementSize(dtype) < kMinPooledBytes) {
    return at::empty(sizes, options.memory_format(at::MemoryFormat::Contiguous));
  }
  return at::Tensor(at::detail::empty_generic(sizes, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::CPU), dtype,
                                              at::MemoryFormat::Contiguous));
}

at::Tensor pooled_copy(const at::Tensor& x, at::ScalarType dtype) {
  auto out = pooled_empty(x.sizes(), x.options().dtype(dtype));
  out.copy_(x);
  return out;
}

BufferPoolStats buffer_pool_stats() { return Pool::instance().stats(); }

void release_cached_buffers() { Pool::instance().release_cached(); }

void set_buffer_pool_limit(size_t bytes) { Pool::instance().set_limit(bytes); }

}  // namespace commgrad
