// The reductions of the shm backend: dst = srcs[0] op srcs[1] op ... in
// rank order, element by element.
//
// Blocks of 512 elements are accumulated in a local array, source by source
// in order, then finished (AVG divides by the group size) and stored; the
// accumulator is float32 for half and bfloat16, so those are rounded once.
// The local array makes in-place use safe (the destination may be one of
// the sources) and keeps the inner loops simple enough to vectorise.
// Integer sums and products wrap (computed in unsigned arithmetic, so there
// is no undefined overflow), but an integer AVG sums in a wider type first; MAX and MIN propagate NaN as torch.maximum
// does; bool is one byte 0/1, where SUM and MAX are OR and PRODUCT and MIN
// are AND.

#include "detail/shm_comm.h"
#include "detail/shm_cpu.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

namespace commgrad::backend::detail {
namespace {

template <typename T>
struct Acc {
  using type = T;
};
template <>
struct Acc<c10::Half> {
  using type = float;
};
template <>
struct Acc<c10::BFloat16> {
  using type = float;
};

// AVG of integers sums in a type the sum of every rank cannot overflow (then
// divides, truncating as C does), so mean(100, 100) of int8 is 100, not -28.
template <typename T>
using AvgAcc = std::conditional_t<std::is_same_v<T, int64_t>, __int128,
                                  std::conditional_t<std::is_integral_v<T>, int64_t, typename Acc<T>::type>>;

// Integer arithmetic wraps (through unsigned types: no undefined overflow).
template <typename A>
struct Add {
  A operator()(A a, A b) const {
    if constexpr (std::is_integral_v<A>) {
      using U = std::make_unsigned_t<decltype(a + b)>;
      return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
    } else {
      return a + b;
    }
  }
};
template <typename A>
struct Mul {
  A operator()(A a, A b) const {
    if constexpr (std::is_integral_v<A>) {
      using U = std::make_unsigned_t<decltype(a * b)>;
      return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
    } else {
      return a * b;
    }
  }
};
// Max and min propagate NaN, as torch.maximum / torch.minimum do.
template <typename A>
struct Max {
  A operator()(A a, A b) const {
    if constexpr (std::is_floating_point_v<A>) {
      if (std::isnan(a) || std::isnan(b)) return a + b;
    }
    return a > b ? a : b;
  }
};
template <typename A>
struct Min {
  A operator()(A a, A b) const {
    if constexpr (std::is_floating_point_v<A>) {
      if (std::isnan(a) || std::isnan(b)) return a + b;
    }
    return a < b ? a : b;
  }
};
template <typename A>
struct And {
  A operator()(A a, A b) const { return static_cast<A>(a & b); }
};
template <typename A>
struct Or {
  A operator()(A a, A b) const { return static_cast<A>(a | b); }
};
template <typename A>
struct Xor {
  A operator()(A a, A b) const { return static_cast<A>(a ^ b); }
};
template <typename A>
struct Keep {
  A operator()(A a) const { return a; }
};
template <typename A>
struct Divide {
  int divisor;
  A operator()(A a) const { return static_cast<A>(a / static_cast<A>(divisor)); }
};
// The sum of an AVG in its wide accumulator (AvgAcc): it cannot overflow.
template <typename A>
struct WideAdd {
  A operator()(A a, A b) const { return a + b; }
};

#if defined(__GNUC__)
#define COMMGRAD_INLINE inline __attribute__((always_inline))
#else
#define COMMGRAD_INLINE inline
#endif

template <typename T, typename A, typename Combine, typename Finish>
COMMGRAD_INLINE void reduce_blocks_inline(void* dst, void* dst2, const void* const* srcs, int nsrcs, int64_t count,
                                          Combine combine, Finish finish) {
  constexpr int64_t kBlock = 512;
  A acc[kBlock];
  if (dst == nullptr) std::swap(dst, dst2);
  for (int64_t base = 0; base < count; base += kBlock) {
    const int64_t m = std::min(kBlock, count - base);
    // The first two sources combine in one pass (a copy into acc first
    // would be a pass of its own over memory another core may hold).
    const T* s0 = static_cast<const T*>(srcs[0]) + base;
    if (nsrcs == 1) {
      for (int64_t i = 0; i < m; ++i) acc[i] = static_cast<A>(s0[i]);
    } else {
      const T* s1 = static_cast<const T*>(srcs[1]) + base;
      for (int64_t i = 0; i < m; ++i) acc[i] = combine(static_cast<A>(s0[i]), static_cast<A>(s1[i]));
    }
    for (int s = 2; s < nsrcs; ++s) {
      const T* sp = static_cast<const T*>(srcs[s]) + base;
      for (int64_t i = 0; i < m; ++i) acc[i] = combine(acc[i], static_cast<A>(sp[i]));
    }
    T* d = static_cast<T*>(dst) + base;
    if (dst2 == nullptr) {
      for (int64_t i = 0; i < m; ++i) d[i] = static_cast<T>(finish(acc[i]));
    } else {
      T* d2 = static_cast<T*>(dst2) + base;
      for (int64_t i = 0; i < m; ++i) d2[i] = d[i] = static_cast<T>(finish(acc[i]));
    }
  }
}

// The same loops compiled for AVX2 where the CPU has it: twice the
// elements per instruction of the baseline x86-64 build, which is what
// keeps a reduction of data another core just wrote from trailing the copies.
#if COMMGRAD_SHM_AVX2_DISPATCH
template <typename T, typename A, typename Combine, typename Finish>
__attribute__((target("avx2"))) void reduce_blocks_avx2(void* dst, void* dst2, const void* const* srcs, int nsrcs,
                                                        int64_t count, Combine combine, Finish finish) {
  reduce_blocks_inline<T, A>(dst, dst2, srcs, nsrcs, count, combine, finish);
}
#endif

template <typename T, typename A, typename Combine, typename Finish>
void reduce_blocks(void* dst, void* dst2, const void* const* srcs, int nsrcs, int64_t count, Combine combine,
                   Finish finish) {
#if COMMGRAD_SHM_AVX2_DISPATCH
  if (cpu_has_avx2()) return reduce_blocks_avx2<T, A>(dst, dst2, srcs, nsrcs, count, combine, finish);
#endif
  reduce_blocks_inline<T, A>(dst, dst2, srcs, nsrcs, count, combine, finish);
}

template <typename T>
void reduce_typed(void* dst, void* dst2, const void* const* srcs, int nsrcs, int64_t count, RedOp op, int divisor) {
  using A = typename Acc<T>::type;
  switch (op) {
    case RedOp::kSum:
      return reduce_blocks<T, A>(dst, dst2, srcs, nsrcs, count, Add<A>{}, Keep<A>{});
    case RedOp::kAvg:
      if constexpr (std::is_integral_v<T>) {
        using W = AvgAcc<T>;
        return reduce_blocks<T, W>(dst, dst2, srcs, nsrcs, count, WideAdd<W>{}, Divide<W>{divisor});
      } else {
        return reduce_blocks<T, A>(dst, dst2, srcs, nsrcs, count, Add<A>{}, Divide<A>{divisor});
      }
    case RedOp::kProduct:
      return reduce_blocks<T, A>(dst, dst2, srcs, nsrcs, count, Mul<A>{}, Keep<A>{});
    case RedOp::kMax:
      return reduce_blocks<T, A>(dst, dst2, srcs, nsrcs, count, Max<A>{}, Keep<A>{});
    case RedOp::kMin:
      return reduce_blocks<T, A>(dst, dst2, srcs, nsrcs, count, Min<A>{}, Keep<A>{});
    default:
      break;
  }
  if constexpr (std::is_integral_v<A>) {
    switch (op) {
      case RedOp::kBand:
        return reduce_blocks<T, A>(dst, dst2, srcs, nsrcs, count, And<A>{}, Keep<A>{});
      case RedOp::kBor:
        return reduce_blocks<T, A>(dst, dst2, srcs, nsrcs, count, Or<A>{}, Keep<A>{});
      case RedOp::kBxor:
        return reduce_blocks<T, A>(dst, dst2, srcs, nsrcs, count, Xor<A>{}, Keep<A>{});
      default:
        break;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "shm: unsupported reduction ", red_op_name(op));
}

// bool is stored as one byte 0/1: sum and max are OR, product and min are AND.
void reduce_bool(void* dst, void* dst2, const void* const* srcs, int nsrcs, int64_t count, RedOp op) {
  switch (op) {
    case RedOp::kSum:
    case RedOp::kMax:
    case RedOp::kBor:
      return reduce_blocks<uint8_t, uint8_t>(dst, dst2, srcs, nsrcs, count, Or<uint8_t>{}, Keep<uint8_t>{});
    case RedOp::kProduct:
    case RedOp::kMin:
    case RedOp::kBand:
      return reduce_blocks<uint8_t, uint8_t>(dst, dst2, srcs, nsrcs, count, And<uint8_t>{}, Keep<uint8_t>{});
    case RedOp::kBxor:
      return reduce_blocks<uint8_t, uint8_t>(dst, dst2, srcs, nsrcs, count, Xor<uint8_t>{}, Keep<uint8_t>{});
    default:
      TORCH_INTERNAL_ASSERT(false, "shm: unsupported bool reduction ", red_op_name(op));
  }
}

}  // namespace

const char* red_op_name(RedOp op) {
  switch (op) {
    case RedOp::kSum:
      return "SUM";
    case RedOp::kAvg:
      return "AVG";
    case RedOp::kProduct:
      return "PRODUCT";
    case RedOp::kMin:
      return "MIN";
    case RedOp::kMax:
      return "MAX";
    case RedOp::kBand:
      return "BAND";
    case RedOp::kBor:
      return "BOR";
    case RedOp::kBxor:
      return "BXOR";
  }
  return "?";
}

const char* op_kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::kNone:
      return "nothing";
    case OpKind::kInvalid:
      return "a rejected call";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kAllreduce:
      return "allreduce";
    case OpKind::kReduce:
      return "reduce";
    case OpKind::kBroadcast:
      return "broadcast";
    case OpKind::kAllgather:
      return "allgather";
    case OpKind::kGather:
      return "gather";
    case OpKind::kScatter:
      return "scatter";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kAlltoall:
      return "alltoall";
  }
  return "?";
}

bool reduction_supported(c10::ScalarType dtype, RedOp op, std::string* why) {
  using c10::ScalarType;
  const bool bitwise = op == RedOp::kBand || op == RedOp::kBor || op == RedOp::kBxor;
  switch (dtype) {
    case ScalarType::Float:
    case ScalarType::Double:
    case ScalarType::Half:
    case ScalarType::BFloat16:
      if (bitwise) *why = c10::str(red_op_name(op), " needs an integer or bool tensor, got ", dtype);
      return !bitwise;
    case ScalarType::ComplexFloat:
    case ScalarType::ComplexDouble:
      if (op != RedOp::kSum && op != RedOp::kAvg) {
        *why = c10::str(red_op_name(op), " is not defined for complex tensors (", dtype, "); use SUM or AVG");
        return false;
      }
      return true;
    case ScalarType::Char:
    case ScalarType::Short:
    case ScalarType::Int:
    case ScalarType::Long:
    case ScalarType::Byte:
      return true;
    case ScalarType::Bool:
      if (op == RedOp::kAvg) *why = "AVG is not defined for bool tensors";
      return op != RedOp::kAvg;
    default:
      *why = c10::str("dtype ", dtype,
                      " is not supported by shm reductions (float, double, half, bfloat16, "
                      "complex, int8/16/32/64, uint8, bool are)");
      return false;
  }
}

void reduce_into(void* dst, void* dst2, const void* const* srcs, int nsrcs, int64_t count, c10::ScalarType dtype,
                 RedOp op, int divisor) {
  if (count <= 0) return;
  using c10::ScalarType;
  switch (dtype) {
    case ScalarType::Float:
      return reduce_typed<float>(dst, dst2, srcs, nsrcs, count, op, divisor);
    case ScalarType::Double:
      return reduce_typed<double>(dst, dst2, srcs, nsrcs, count, op, divisor);
    case ScalarType::Half:
      return reduce_typed<c10::Half>(dst, dst2, srcs, nsrcs, count, op, divisor);
    case ScalarType::BFloat16:
      return reduce_typed<c10::BFloat16>(dst, dst2, srcs, nsrcs, count, op, divisor);
    case ScalarType::ComplexFloat:
      return reduce_typed<float>(dst, dst2, srcs, nsrcs, 2 * count, op, divisor);
    case ScalarType::ComplexDouble:
      return reduce_typed<double>(dst, dst2, srcs, nsrcs, 2 * count, op, divisor);
    case ScalarType::Char:
      return reduce_typed<int8_t>(dst, dst2, srcs, nsrcs, count, op, divisor);
    case ScalarType::Short:
      return reduce_typed<int16_t>(dst, dst2, srcs, nsrcs, count, op, divisor);
    case ScalarType::Int:
      return reduce_typed<int32_t>(dst, dst2, srcs, nsrcs, count, op, divisor);
    case ScalarType::Long:
      return reduce_typed<int64_t>(dst, dst2, srcs, nsrcs, count, op, divisor);
    case ScalarType::Byte:
      return reduce_typed<uint8_t>(dst, dst2, srcs, nsrcs, count, op, divisor);
    case ScalarType::Bool:
      return reduce_bool(dst, dst2, srcs, nsrcs, count, op);
    default:
      TORCH_INTERNAL_ASSERT(false, "shm: no reduction for ", dtype);
  }
}

}  // namespace commgrad::backend::detail
