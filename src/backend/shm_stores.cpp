// Writes into the shared segment: ordinary or streaming stores (see
// detail/shm_stores.h for why and when).

#include "detail/shm_stores.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace commgrad::backend::detail {

void copy_streaming(void* dst, const void* src, int64_t bytes) {
  if (bytes <= 0) return;
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
#if defined(__SSE2__)
  // Ordinary stores up to the first 16-byte boundary of dst, whole lines of
  // streaming stores, ordinary stores for the tail.
  const auto misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(d) & 15);
  int64_t i = std::min<int64_t>(bytes, misalign == 0 ? 0 : 16 - misalign);
  std::memcpy(d, s, static_cast<size_t>(i));
  for (; i + 64 <= bytes; i += 64) {
    const auto* from = reinterpret_cast<const __m128i*>(s + i);
    auto* to = reinterpret_cast<__m128i*>(d + i);
    const __m128i a = _mm_loadu_si128(from);
    const __m128i b = _mm_loadu_si128(from + 1);
    const __m128i c = _mm_loadu_si128(from + 2);
    const __m128i e = _mm_loadu_si128(from + 3);
    _mm_stream_si128(to, a);
    _mm_stream_si128(to + 1, b);
    _mm_stream_si128(to + 2, c);
    _mm_stream_si128(to + 3, e);
  }
  std::memcpy(d + i, s + i, static_cast<size_t>(bytes - i));
  _mm_sfence();  // streaming stores are weakly ordered: done before the barrier
#else
  std::memcpy(d, s, static_cast<size_t>(bytes));
#endif
}

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
      std::memcpy(dst, src, static_cast<size_t>(bytes));
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
        std::memcpy(dst + at, src + at, static_cast<size_t>(len));
      }
      std::memcpy(own + at, src + at, static_cast<size_t>(len));
    }
  });
}

}  // namespace commgrad::backend::detail
