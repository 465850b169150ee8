// Writes into the shared segment: ordinary or streaming stores (see
// detail/shm_stores.h for why and when).

#include "detail/shm_stores.h"

#include <algorithm>
#include <chrono>

namespace commgrad::backend::detail {

bool StoreChoice::stream(int64_t bytes) {
  if (bytes < kLargeBytes || mode_ == StoreMode::kCached) return false;
  if (mode_ == StoreMode::kStreaming) return true;
  if (stream_left_ == 0) return false;
  --stream_left_;
  return true;
}

void StoreChoice::observe(int64_t bytes, int64_t ns) {
  if (static_cast<double>(bytes) >= kSlowBytesPerNs * static_cast<double>(ns)) {
    slow_ = 0;
  } else if (++slow_ >= kSlowToStream) {
    slow_ = 0;
    stream_left_ = kStreamedWrites;
  }
}

template <class Write>
void SegmentStores::write(int64_t bytes, Write&& write) {
  if (choice_.stream(bytes)) return write(true);
  if (!choice_.times(bytes)) return write(false);
  const auto start = std::chrono::steady_clock::now();
  write(false);
  choice_.observe(
      bytes, std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
}

void SegmentStores::copy(void* dst, const void* src, int64_t bytes) {
  if (bytes <= 0) return;
  write(bytes, [&](bool stream) {
    if (stream) {
      copy_streaming(dst, src, bytes);
    } else {
      copy_bytes(dst, src, bytes);
    }
  });
}

void SegmentStores::copy_twice(uint8_t* dst, uint8_t* own, const uint8_t* src, int64_t bytes) {
  constexpr int64_t kBlock = 16 * 1024;
  write(bytes, [&](bool stream) {
    for (int64_t at = 0; at < bytes; at += kBlock) {
      const int64_t len = std::min(kBlock, bytes - at);
      if (stream) {
        copy_streaming(dst + at, src + at, len);
      } else {
        copy_bytes(dst + at, src + at, len);
      }
      copy_bytes(own + at, src + at, len);
    }
  });
}

}  // namespace commgrad::backend::detail
