#pragma once
// Which instructions this CPU has, for the kernels compiled twice (the
// baseline x86-64 build and an AVX2 one chosen at run time: the reductions,
// the copies). Header-only; internal to commgrad_backend.

#if defined(__x86_64__) && defined(__GNUC__)  // GCC and Clang
#define COMMGRAD_SHM_AVX2_DISPATCH 1

namespace commgrad::backend::detail {

/// True when the CPU runs AVX2 (asked once).
inline bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}

}  // namespace commgrad::backend::detail
#endif
