// Copies to and from the shared segment (see detail/shm_copy.h).

#include "detail/shm_copy.h"
#include "detail/shm_cpu.h"

#include <algorithm>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if COMMGRAD_SHM_AVX2_DISPATCH
#include <immintrin.h>
#endif

namespace commgrad::backend::detail {
namespace {

// Whether `dst` lies 1-63 bytes past `src`, modulo the 4 KiB page: the
// distances at which memcpy's `rep movsb` runs slow (detail/shm_copy.h).
bool lies_just_past(const void* dst, const void* src) {
  const uintptr_t distance = (reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(src)) & 4095;
  return distance >= 1 && distance < 64;
}

#if COMMGRAD_SHM_AVX2_DISPATCH
__attribute__((target("avx2"))) void copy_avx2(uint8_t* d, const uint8_t* s, int64_t bytes) {
  int64_t i = 0;
  for (; i + 64 <= bytes; i += 64) {  // a line at a time (the loop measured)
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
  }
  std::memcpy(d + i, s + i, static_cast<size_t>(bytes - i));  // under 64 bytes: no rep movsb
}
#endif

}  // namespace

void copy_bytes(void* dst, const void* src, int64_t bytes) {
  if (bytes <= 0) return;
#if COMMGRAD_SHM_AVX2_DISPATCH
  // Below 2 KiB memcpy uses vector moves, not rep movsb.
  if (bytes >= 2048 && lies_just_past(dst, src) && cpu_has_avx2()) {
    return copy_avx2(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), bytes);
  }
#endif
  std::memcpy(dst, src, static_cast<size_t>(bytes));
}

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

}  // namespace commgrad::backend::detail
