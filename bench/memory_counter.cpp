// The counting CPU allocator of memory_counter.h.
//
// Each allocation is forwarded to the allocator that was in place (LibTorch's
// default CPU allocator, whose DataPtrs are plain pointers freed by its raw
// deleter); the size of each live pointer is kept in a table, and the
// DataPtr handed out is the same plain pointer with this file's deleter,
// which subtracts the size and calls the original deleter. The pointer
// stays its own context, as at::Allocator::raw_allocate() requires (some
// kernels take their workspace through it). at::Allocator::allocate() is
// const in LibTorch 1.13 and not const in 2.x: the class defines both, and
// the one the base declares overrides it (the other is an unused overload).

#include "memory_counter.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace commgrad::bench {
namespace {

std::atomic<int64_t> live{0};
std::atomic<int64_t> peak{0};
c10::DeleterFnPtr base_delete = nullptr;

// Live pointer -> bytes. Never destroyed: storages are freed after main returns too.
struct Table {
  std::mutex mutex;
  std::unordered_map<void*, int64_t> sizes;
};
Table& table() {
  static auto* t = new Table;
  return *t;
}

void counted_delete(void* ptr) {
  {
    Table& t = table();
    std::lock_guard<std::mutex> lock(t.mutex);
    const auto it = t.sizes.find(ptr);
    if (it != t.sizes.end()) {
      live.fetch_sub(it->second);
      t.sizes.erase(it);
    }
  }
  base_delete(ptr);
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) const { return counted(n); }
  c10::DataPtr allocate(size_t n) { return counted(n); }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const {
    if (count > 0) std::memcpy(dest, src, count);
  }

 private:
  c10::DataPtr counted(size_t n) const {
    c10::DataPtr original = base_->allocate(n);
    void* data = original.get();
    if (data == nullptr || original.get_context() != data) return original;  // not a plain pointer: uncounted
    const c10::Device device = original.device();
    original.release_context();  // ours now: freed by counted_delete
    const int64_t bytes = static_cast<int64_t>(n);
    {
      Table& t = table();
      std::lock_guard<std::mutex> lock(t.mutex);
      t.sizes[data] = bytes;
    }
    const int64_t now = live.fetch_add(bytes) + bytes;
    int64_t seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
    return c10::DataPtr(data, data, &counted_delete, device);
  }

  c10::Allocator* base_;
};

}  // namespace

void count_cpu_allocations() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Never destroyed: storages it counted may outlive any scope.
    c10::Allocator* base = c10::GetCPUAllocator();
    base_delete = base->raw_deleter();
    if (base_delete == nullptr) return;  // nothing to free a pointer with: count nothing
    auto* counting = new CountingAllocator(base);
    c10::SetCPUAllocator(counting, /*priority=*/100);
  });
}

int64_t live_cpu_bytes() { return live.load(); }

int64_t peak_cpu_bytes() { return peak.load(); }

void reset_peak_cpu_bytes() { peak.store(live.load()); }

}  // namespace commgrad::bench
