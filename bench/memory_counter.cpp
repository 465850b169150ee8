// The counting CPU allocator of memory_counter.h.
//
// Each allocation is forwarded to the allocator that was in place (LibTorch's
// default CPU allocator); the DataPtr handed out carries a context that owns
// the original DataPtr and remembers the size, and its deleter subtracts
// the size before the original is freed. at::Allocator::allocate() is const
// in LibTorch 1.13 and not const in 2.x: the class defines both, and the one
// the base declares overrides it (the other is an unused overload).

#include "memory_counter.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace commgrad::bench {
namespace {

std::atomic<int64_t> live{0};
std::atomic<int64_t> peak{0};

struct Counted {
  c10::DataPtr original;
  int64_t bytes = 0;
};

void release(void* context) {
  auto* c = static_cast<Counted*>(context);
  live.fetch_sub(c->bytes);
  delete c;  // frees the original allocation
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) const { return counted(n); }
  c10::DataPtr allocate(size_t n) { return counted(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const {
    if (count > 0) std::memcpy(dest, src, count);
  }

 private:
  c10::DataPtr counted(size_t n) const {
    c10::DataPtr original = base_->allocate(n);
    void* data = original.get();
    const c10::Device device = original.device();
    auto* context = new Counted{std::move(original), static_cast<int64_t>(n)};
    const int64_t now = live.fetch_add(context->bytes) + context->bytes;
    int64_t seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
    return c10::DataPtr(data, context, &release, device);
  }

  c10::Allocator* base_;
};

}  // namespace

void count_cpu_allocations() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Never destroyed: storages it counted may outlive any scope.
    auto* counting = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(counting, /*priority=*/100);
  });
}

int64_t live_cpu_bytes() { return live.load(); }

int64_t peak_cpu_bytes() { return peak.load(); }

void reset_peak_cpu_bytes() { peak.store(live.load()); }

}  // namespace commgrad::bench
