// The shm collectives: every rank of a group, in one segment, step by step.
//
// Steps and buffer sets. A collective is a sequence of steps. In a step
// each rank writes what the others need into buffer set `step % 3` of the
// segment (its own slot of chunk_bytes, or, for a root, the whole set),
// arrives at the group barrier, and then reads what it needs. A set is
// read at most until the reader arrives at the barrier two steps later,
// and written again only three steps later, after that barrier: so no
// step ever waits for a reader to release a buffer, and consecutive steps
// (and consecutive collectives) pipeline with one barrier each.
//
// The barrier is one futex word in the header that every arrival
// increments; the arrival that completes generation g (value g * n) wakes
// the sleepers, if any. Waiting spins briefly (not at all when ranks
// outnumber cores), then sleeps on the futex in slices, checking on the
// way whether the group was aborted, whether a rank it waits for has died
// (its pid is in its control block) and whether the deadline passed.
//
// All-reduce, large: each chunk of chunk_bytes per rank is cut into n
// slices, one per rank. Iteration j copies this rank's chunk j, minus its
// own slice, into its slot; reduces its own slice of chunk j-1 over all
// ranks in rank order (its own contribution straight from its input) into
// its output and into its slot; arrives; then copies the other ranks'
// reduced slices of chunk j-1 into its output. Reduction work is spread
// over all ranks and every element is reduced once, by one rank, in a
// fixed order: results are bitwise identical everywhere. Per rank, a
// 2-rank all-reduce of B bytes copies B/2 in, reduces B/2 and copies B/2
// out. All-reduce, small (up to kSmallBytes): every rank copies its whole
// input in, arrives once, and reduces everything itself, in rank order, so
// the result is again identical on every rank; one barrier instead of two.
//
// Agreement. With the data of its first step each rank publishes a
// descriptor (op, dtype, reduction, root, sizes, collective number) and,
// for ops with per-rank sizes, its sizes. After the first barrier every
// rank checks all descriptors with the same function, so a mismatch (or
// a rank that rejected its arguments) fails every rank at the same step
// with the same message, and the group stays usable.
//
// Point to point uses one byte ring per ordered pair of ranks (a mailbox):
// a 32-byte header (tag, dtype, size) then the payload, written and read
// in pieces as space allows, with futex bells for data and space.

#include "detail/shm_comm.h"

#include "commgrad/detail/torch_compat.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <c10/util/StringUtil.h>

#include <sched.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

namespace commgrad::backend::detail {
namespace {

// Up to this many bytes an all-reduce uses the one-barrier algorithm.
constexpr int64_t kSmallBytes = 32 * 1024;
constexpr uint32_t kMessageMagic = 0x6d677363;  // "csgm"
// The least an adaptive spin falls to (see WaitPolicy).
constexpr int64_t kMinSpinNs = 2000;

struct MessageHeader {
  uint32_t magic;
  int32_t tag;
  int32_t dtype;
  int32_t reserved;
  int64_t bytes;
  int64_t unused;
};
static_assert(sizeof(MessageHeader) == 32, "message header is 32 bytes");

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t clamp_len(int64_t total, int64_t off, int64_t cap) { return std::max<int64_t>(0, std::min(cap, total - off)); }

void copy(void* dst, const void* src, int64_t bytes) {
  if (bytes > 0 && dst != src) std::memmove(dst, src, static_cast<size_t>(bytes));
}

std::string seconds(std::chrono::milliseconds ms) { return c10::str(ms.count() / 1000.0, "s"); }

// ~~~ reduction kernels ~~~
//
// Blocks of kBlock elements are accumulated in a local array (the
// accumulator type: float for half/bfloat16), source by source in order,
// then finished (AVG divides) and stored. The local array makes in-place
// use safe and keeps the inner loops simple enough to vectorise.

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

template <typename T, typename A, typename Combine, typename Finish>
void reduce_blocks(void* dst, void* dst2, const void* const* srcs, int nsrcs, int64_t count, Combine combine,
                   Finish finish) {
  constexpr int64_t kBlock = 512;
  A acc[kBlock];
  if (dst == nullptr) std::swap(dst, dst2);
  for (int64_t base = 0; base < count; base += kBlock) {
    const int64_t m = std::min(kBlock, count - base);
    const T* s0 = static_cast<const T*>(srcs[0]) + base;
    for (int64_t i = 0; i < m; ++i) acc[i] = static_cast<A>(s0[i]);
    for (int s = 1; s < nsrcs; ++s) {
      const T* sp = static_cast<const T*>(srcs[s]) + base;
      for (int64_t i = 0; i < m; ++i) acc[i] = combine(acc[i], static_cast<A>(sp[i]));
    }
    T* d = static_cast<T*>(dst) + base;
    for (int64_t i = 0; i < m; ++i) d[i] = static_cast<T>(finish(acc[i]));
    if (dst2 != nullptr) std::memcpy(static_cast<T*>(dst2) + base, d, static_cast<size_t>(m) * sizeof(T));
  }
}

template <typename T>
void reduce_typed(void* dst, void* dst2, const void* const* srcs, int nsrcs, int64_t count, RedOp op, int divisor) {
  using A = typename Acc<T>::type;
  switch (op) {
    case RedOp::kSum:
      return reduce_blocks<T, A>(dst, dst2, srcs, nsrcs, count, Add<A>{}, Keep<A>{});
    case RedOp::kAvg:
      return reduce_blocks<T, A>(dst, dst2, srcs, nsrcs, count, Add<A>{}, Divide<A>{divisor});
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
    case RedOp::kSum: return "SUM";
    case RedOp::kAvg: return "AVG";
    case RedOp::kProduct: return "PRODUCT";
    case RedOp::kMin: return "MIN";
    case RedOp::kMax: return "MAX";
    case RedOp::kBand: return "BAND";
    case RedOp::kBor: return "BOR";
    case RedOp::kBxor: return "BXOR";
  }
  return "?";
}

const char* op_kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::kNone: return "nothing";
    case OpKind::kInvalid: return "a rejected call";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kAllreduce: return "allreduce";
    case OpKind::kReduce: return "reduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kAllgather: return "allgather";
    case OpKind::kGather: return "gather";
    case OpKind::kScatter: return "scatter";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kAlltoall: return "alltoall";
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
      *why = c10::str("dtype ", dtype, " is not supported by shm reductions (float, double, half, bfloat16, "
                      "complex, int8/16/32/64, uint8, bool are)");
      return false;
  }
}

void reduce_into(void* dst, void* dst2, const void* const* srcs, int nsrcs, int64_t count, c10::ScalarType dtype,
                 RedOp op, int divisor) {
  if (count <= 0) return;
  using c10::ScalarType;
  switch (dtype) {
    case ScalarType::Float: return reduce_typed<float>(dst, dst2, srcs, nsrcs, count, op, divisor);
    case ScalarType::Double: return reduce_typed<double>(dst, dst2, srcs, nsrcs, count, op, divisor);
    case ScalarType::Half: return reduce_typed<c10::Half>(dst, dst2, srcs, nsrcs, count, op, divisor);
    case ScalarType::BFloat16: return reduce_typed<c10::BFloat16>(dst, dst2, srcs, nsrcs, count, op, divisor);
    case ScalarType::ComplexFloat: return reduce_typed<float>(dst, dst2, srcs, nsrcs, 2 * count, op, divisor);
    case ScalarType::ComplexDouble: return reduce_typed<double>(dst, dst2, srcs, nsrcs, 2 * count, op, divisor);
    case ScalarType::Char: return reduce_typed<int8_t>(dst, dst2, srcs, nsrcs, count, op, divisor);
    case ScalarType::Short: return reduce_typed<int16_t>(dst, dst2, srcs, nsrcs, count, op, divisor);
    case ScalarType::Int: return reduce_typed<int32_t>(dst, dst2, srcs, nsrcs, count, op, divisor);
    case ScalarType::Long: return reduce_typed<int64_t>(dst, dst2, srcs, nsrcs, count, op, divisor);
    case ScalarType::Byte: return reduce_typed<uint8_t>(dst, dst2, srcs, nsrcs, count, op, divisor);
    case ScalarType::Bool: return reduce_bool(dst, dst2, srcs, nsrcs, count, op);
    default: TORCH_INTERNAL_ASSERT(false, "shm: no reduction for ", dtype);
  }
}

// ~~~ Comm: setup, waiting, agreement ~~~

Comm::Comm(std::unique_ptr<Segment> segment, int rank, int size, std::string context, WaitPolicy policy)
    : segment_(std::move(segment)),
      rank_(rank),
      size_(size),
      context_(std::move(context)),
      policy_(policy),
      spin_ns_(policy.max_spin_ns),
      yield_ns_(policy.max_yield_ns),
      srcs_(static_cast<size_t>(size)) {}

Comm::~Comm() = default;

void Comm::fail(const Call& call, const std::string& message) const {
  TORCH_CHECK(false, "[commgrad] ", call.op, " ", context_, ": ", message);
}

OpDescriptor Comm::begin(const Call& call, OpKind kind, c10::ScalarType dtype, int32_t reduce, int root,
                         int64_t bytes) {
  check_not_aborted(call.op);
  OpDescriptor d;
  d.kind = static_cast<uint32_t>(kind);
  d.dtype = static_cast<int32_t>(dtype);
  d.reduce = reduce;
  d.root = root;
  d.seq = seq_++;
  d.bytes = bytes;
  d.message[0] = '\0';
  RankBlock& me = segment_->rank_block(rank_);
  me.seq.store(d.seq, std::memory_order_relaxed);
  me.kind.store(d.kind, std::memory_order_relaxed);
  return d;
}

void Comm::publish(int set, const OpDescriptor& desc) {
  OpDescriptor& slot = segment_->rank_block(rank_).desc[set];
  const bool invalid = desc.kind == static_cast<uint32_t>(OpKind::kInvalid);
  std::memcpy(&slot, &desc, invalid ? sizeof(OpDescriptor) : offsetof(OpDescriptor, message));
}

namespace {

std::string describe(const OpDescriptor& d) {
  const auto kind = static_cast<OpKind>(d.kind);
  std::string s = c10::str(op_kind_name(kind), " #", d.seq);
  if (kind == OpKind::kBarrier || kind == OpKind::kInvalid || kind == OpKind::kNone) return s;
  s += c10::str(" (", static_cast<c10::ScalarType>(d.dtype));
  if (kind != OpKind::kAlltoall) s += c10::str(", ", d.bytes, " bytes");
  if (d.reduce >= 0) s += c10::str(", ", red_op_name(static_cast<RedOp>(d.reduce)));
  if (d.root >= 0) s += c10::str(", root ", d.root);
  return s + ")";
}

}  // namespace

void Comm::check_agreement(const Call& call, int set, bool same_bytes) {
  if (size_ == 1) return;
  for (int q = 0; q < size_; ++q) {
    const OpDescriptor& d = segment_->rank_block(q).desc[set];
    if (d.kind == static_cast<uint32_t>(OpKind::kInvalid)) {
      char message[kMessageBytes];
      std::memcpy(message, d.message, kMessageBytes);
      message[kMessageBytes - 1] = '\0';
      fail(call, c10::str("rank ", q, " rejected its arguments to collective #", d.seq, ": ", message));
    }
  }
  const OpDescriptor& ref = segment_->rank_block(0).desc[set];
  std::vector<int> differ;
  for (int q = 1; q < size_; ++q) {
    const OpDescriptor& d = segment_->rank_block(q).desc[set];
    if (d.kind != ref.kind || d.seq != ref.seq || d.dtype != ref.dtype || d.reduce != ref.reduce ||
        d.root != ref.root || (same_bytes && d.bytes != ref.bytes)) {
      differ.push_back(q);
    }
  }
  if (differ.empty()) return;
  std::string detail = c10::str("rank 0: ", describe(ref));
  for (int q : differ) detail += c10::str("; rank ", q, ": ", describe(segment_->rank_block(q).desc[set]));
  fail(call, c10::str("the ranks called different collectives: ", detail));
}

template <class Ready>
void Comm::wait(Ready&& ready, Bell& bell, const Call& call, WaitOn on, int peer) {
  if (ready()) return;
  const int64_t spin = spin_ns_.load(std::memory_order_relaxed);
  if (spin > 0) {
    const int64_t start = now_ns();
    do {
      for (int i = 0; i < 64; ++i) {
        if (ready()) {
          spin_ns_.store(std::min(policy_.max_spin_ns, 2 * spin), std::memory_order_relaxed);
          return;
        }
        cpu_relax();
      }
    } while (now_ns() - start < spin);
    spin_ns_.store(std::max(kMinSpinNs, spin / 2), std::memory_order_relaxed);
  }
  const int64_t yield = yield_ns_.load(std::memory_order_relaxed);
  if (yield > 0) {
    const int64_t start = now_ns();
    do {
      sched_yield();
      if (ready()) {
        yield_ns_.store(std::min(policy_.max_yield_ns, 2 * yield), std::memory_order_relaxed);
        return;
      }
    } while (now_ns() - start < yield);
    yield_ns_.store(std::max(kMinSpinNs, yield / 2), std::memory_order_relaxed);
  }
  wait_slow(ready, bell, call, on, peer);
}

void Comm::arrive_and_wait(const Call& call) {
  Bell& bell = segment_->header().arrivals;
  ++generation_;
  const auto target = static_cast<uint32_t>(generation_ * static_cast<uint64_t>(size_));
  segment_->rank_block(rank_).generation.store(static_cast<uint32_t>(generation_), std::memory_order_relaxed);
  const uint32_t arrived = bell.value.fetch_add(1, std::memory_order_seq_cst) + 1;
  if (arrived == target) {
    if (bell.sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&bell.value);
    return;
  }
  wait([&] { return static_cast<int32_t>(bell.value.load(std::memory_order_acquire) - target) >= 0; }, bell, call,
       WaitOn::kBarrier, -1);
}

void Comm::wait_slow(c10::function_ref<bool()> ready, Bell& bell, const Call& call, WaitOn on, int peer) {
  using Clock = std::chrono::steady_clock;
  const Header& h = segment_->header();
  auto next_check = Clock::now() + std::chrono::milliseconds(20);
  while (true) {
    const uint32_t seen = bell.value.load(std::memory_order_seq_cst);
    if (ready()) return;
    if (h.abort_state.load(std::memory_order_acquire) != 0) throw_aborted(call.op);
    const auto now = Clock::now();
    if (now >= next_check) {
      check_peers(call, on, peer);
      next_check = now + std::chrono::milliseconds(100);
    }
    if (now >= call.deadline) {
      const std::vector<int> pending = pending_ranks(on, peer);
      std::string where;
      for (int q : pending) {
        const RankBlock& b = segment_->rank_block(q);
        const auto kind = static_cast<OpKind>(b.kind.load(std::memory_order_relaxed));
        where += where.empty() ? "" : "; ";
        where += kind == OpKind::kNone ? c10::str("rank ", q, " has not entered any collective")
                                       : c10::str("rank ", q, " last entered ", op_kind_name(kind), " #",
                                                  b.seq.load(std::memory_order_relaxed));
      }
      const std::string what =
          on == WaitOn::kBarrier
              ? c10::str("timed out after ", seconds(call.timeout), " in collective #", seq_ - 1, " waiting for ",
                         describe_ranks(pending), " (", where, ")")
              : c10::str("timed out after ", seconds(call.timeout), " waiting for rank ", peer, " (", where, ")");
      if (on == WaitOn::kBarrier) abort(c10::str("rank ", rank_, " ", what));
      commgrad::detail::throw_timeout_error(c10::str("[commgrad] ", call.op, " ", context_, ": ", what));
    }
    bell.sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (!ready() && h.abort_state.load(std::memory_order_acquire) == 0) {
      futex_wait(&bell.value, seen,
                 std::min<std::chrono::nanoseconds>(call.deadline - now, std::chrono::milliseconds(50)));
    }
    bell.sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

std::vector<int> Comm::pending_ranks(WaitOn on, int peer) const {
  if (on == WaitOn::kPeer) return {peer};
  std::vector<int> out;
  const auto mine = static_cast<uint32_t>(generation_);
  for (int q = 0; q < size_; ++q) {
    const uint32_t g = segment_->rank_block(q).generation.load(std::memory_order_relaxed);
    if (static_cast<int32_t>(g - mine) < 0) out.push_back(q);
  }
  return out;
}

void Comm::check_peers(const Call& call, WaitOn on, int peer) {
  for (int q : pending_ranks(on, peer)) {
    const int32_t pid = segment_->rank_block(q).pid.load(std::memory_order_relaxed);
    if (process_alive(pid)) continue;
    // seq_ belongs to the collectives' thread: point-to-point waits do not name it.
    const std::string what =
        on == WaitOn::kBarrier
            ? c10::str("rank ", q, " (pid ", pid, ") died; this rank was waiting for it in ", call.op,
                       " (collective #", seq_ - 1, ")")
            : c10::str("rank ", q, " (pid ", pid, ") died; this rank was waiting for it in ", call.op);
    abort(c10::str(what, ", found by rank ", rank_));
    commgrad::detail::throw_dist_error(c10::str("[commgrad] ", call.op, " ", context_, ": ", what));
  }
}

void Comm::abort(const std::string& reason) {
  Header& h = segment_->header();
  uint32_t expected = 0;
  if (h.abort_state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    h.abort_rank = rank_;
    std::strncpy(h.abort_reason, reason.c_str(), sizeof(h.abort_reason) - 1);
    h.abort_reason[sizeof(h.abort_reason) - 1] = '\0';
    h.abort_state.store(2, std::memory_order_release);
  }
  futex_wake_all(&h.arrivals.value);
  if (size_ > 1) {
    for (int s = 0; s < size_; ++s) {
      for (int d = 0; d < size_; ++d) {
        futex_wake_all(&segment_->mailbox(s, d).data.value);
        futex_wake_all(&segment_->mailbox(s, d).space.value);
      }
    }
  }
}

void Comm::check_not_aborted(const char* op) const {
  if (segment_->header().abort_state.load(std::memory_order_acquire) != 0) throw_aborted(op);
}

void Comm::throw_aborted(const char* op) const {
  const Header& h = segment_->header();
  for (int i = 0; i < 100000 && h.abort_state.load(std::memory_order_acquire) != 2; ++i) cpu_relax();
  std::string reason = "unknown reason";
  if (h.abort_state.load(std::memory_order_acquire) == 2) reason.assign(h.abort_reason);
  commgrad::detail::throw_dist_error(
      c10::str("[commgrad] ", op, " ", context_, ": the group was aborted and cannot be used: ", reason));
}

// ~~~ collectives ~~~

void Comm::barrier(const Call& call) {
  const OpDescriptor d = begin(call, OpKind::kBarrier, c10::ScalarType::Undefined, -1, -1, 0);
  const int set = next_set();
  publish(set, d);
  arrive_and_wait(call);
  check_agreement(call, set, true);
}

void Comm::reject(const Call& call, OpKind kind, const std::string& message) {
  OpDescriptor d = begin(call, OpKind::kInvalid, c10::ScalarType::Undefined, -1, -1, 0);
  const std::string text = c10::str(op_kind_name(kind), ": ", message);
  std::strncpy(d.message, text.c_str(), kMessageBytes - 1);
  d.message[kMessageBytes - 1] = '\0';
  const int set = next_set();
  publish(set, d);
  arrive_and_wait(call);
}

void Comm::allreduce(const Call& call, void* data, int64_t count, c10::ScalarType dtype, RedOp op) {
  const int64_t bytes = count * static_cast<int64_t>(c10::elementSize(dtype));
  auto* d = static_cast<uint8_t*>(data);
  if (bytes <= std::min<int64_t>(kSmallBytes, segment_->layout().chunk_bytes)) {
    allreduce_small(call, d, count, dtype, op, -1);
  } else {
    allreduce_pipelined(call, d, count, dtype, op, -1);
  }
}

void Comm::reduce(const Call& call, void* data, int64_t count, c10::ScalarType dtype, RedOp op, int root) {
  const int64_t bytes = count * static_cast<int64_t>(c10::elementSize(dtype));
  auto* d = static_cast<uint8_t*>(data);
  if (bytes <= std::min<int64_t>(kSmallBytes, segment_->layout().chunk_bytes)) {
    allreduce_small(call, d, count, dtype, op, root);
  } else {
    allreduce_pipelined(call, d, count, dtype, op, root);
  }
}

void Comm::allreduce_small(const Call& call, uint8_t* data, int64_t count, c10::ScalarType dtype, RedOp op,
                           int root) {
  const int64_t bytes = count * static_cast<int64_t>(c10::elementSize(dtype));
  const OpDescriptor d = begin(call, root < 0 ? OpKind::kAllreduce : OpKind::kReduce, dtype,
                               static_cast<int32_t>(op), root, bytes);
  const int set = next_set();
  publish(set, d);
  if (size_ > 1 && rank_ != root) copy(segment_->slot(set, rank_), data, bytes);
  arrive_and_wait(call);
  check_agreement(call, set, true);
  if (root >= 0 && rank_ != root) return;
  for (int q = 0; q < size_; ++q) srcs_[q] = q == rank_ ? data : segment_->slot(set, q);
  reduce_into(data, nullptr, srcs_.data(), size_, count, dtype, op, size_);
}

void Comm::allreduce_pipelined(const Call& call, uint8_t* data, int64_t count, c10::ScalarType dtype, RedOp op,
                               int root) {
  const auto es = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t chunk = static_cast<int64_t>(segment_->layout().chunk_bytes) / es;  // elements per step
  const int64_t nchunks = ceil_div(count, chunk);
  const int64_t align = std::max<int64_t>(1, 64 / es);
  const bool gets_result = root < 0 || root == rank_;
  // Slice q of a chunk of c elements: [begin(c, q), begin(c, q + 1)).
  auto begin_of = [&](int64_t c, int q) {
    const int64_t per = ceil_div(ceil_div(c, size_), align) * align;
    return std::min<int64_t>(c, per * q);
  };
  const OpDescriptor d = begin(call, root < 0 ? OpKind::kAllreduce : OpKind::kReduce, dtype,
                               static_cast<int32_t>(op), root, count * es);
  int prev_set = 0;
  int64_t prev_off = 0;
  int64_t prev_c = 0;
  for (int64_t j = 0; j <= nchunks; ++j) {
    const int set = next_set();
    if (j == 0) publish(set, d);
    const int64_t off = j * chunk;
    const int64_t c = j < nchunks ? std::min(chunk, count - off) : 0;
    if (c > 0) {
      // Everything but this rank's own slice: the others reduce it.
      const int64_t b = begin_of(c, rank_);
      const int64_t e = begin_of(c, rank_ + 1);
      uint8_t* s = segment_->slot(set, rank_);
      copy(s, data + off * es, b * es);
      copy(s + e * es, data + (off + e) * es, (c - e) * es);
    }
    if (j > 0) {
      const int64_t b = begin_of(prev_c, rank_);
      const int64_t e = begin_of(prev_c, rank_ + 1);
      if (e > b) {
        for (int q = 0; q < size_; ++q) {
          srcs_[q] = (q == rank_ ? data + prev_off * es : segment_->slot(prev_set, q)) + b * es;
        }
        void* to_shm = (root < 0 || root != rank_) ? segment_->slot(prev_set, rank_) + b * es : nullptr;
        void* to_out = gets_result ? data + (prev_off + b) * es : nullptr;
        reduce_into(to_shm, to_out, srcs_.data(), size_, e - b, dtype, op, size_);
      }
    }
    arrive_and_wait(call);
    if (j == 0) check_agreement(call, set, true);
    if (j > 0 && gets_result) {
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        const int64_t b = begin_of(prev_c, q);
        const int64_t e = begin_of(prev_c, q + 1);
        copy(data + (prev_off + b) * es, segment_->slot(prev_set, q) + b * es, (e - b) * es);
      }
    }
    prev_set = set;
    prev_off = off;
    prev_c = c;
  }
}

void Comm::broadcast(const Call& call, void* data, int64_t bytes, c10::ScalarType dtype, int root) {
  auto* p = static_cast<uint8_t*>(data);
  const OpDescriptor d = begin(call, OpKind::kBroadcast, dtype, -1, root, bytes);
  const int64_t cap = static_cast<int64_t>(segment_->layout().chunk_bytes) * size_;  // the whole set
  const int64_t nsteps = std::max<int64_t>(1, ceil_div(bytes, cap));
  for (int64_t k = 0; k < nsteps; ++k) {
    const int set = next_set();
    if (k == 0) publish(set, d);
    const int64_t len = clamp_len(bytes, k * cap, cap);
    if (rank_ == root && size_ > 1) copy(segment_->slot(set, 0), p + k * cap, len);
    arrive_and_wait(call);
    if (k == 0) check_agreement(call, set, true);
    if (rank_ != root) copy(p + k * cap, segment_->slot(set, 0), len);
  }
}

void Comm::allgather(const Call& call, const void* in, int64_t in_bytes, void* const* outs, const int64_t* out_bytes,
                     c10::ScalarType dtype, int root) {
  const auto* src = static_cast<const uint8_t*>(in);
  const bool receives = root < 0 || root == rank_;
  const OpDescriptor d = begin(call, root < 0 ? OpKind::kAllgather : OpKind::kGather, dtype, -1, root, in_bytes);
  const int64_t cap = static_cast<int64_t>(segment_->layout().chunk_bytes);
  int64_t nsteps = 1;  // known after the first barrier
  for (int64_t k = 0; k < nsteps; ++k) {
    const int set = next_set();
    if (k == 0) {
      int64_t* aux = segment_->aux(set, rank_);
      for (int q = 0; q < size_; ++q) aux[q] = receives ? out_bytes[q] : -1;
      publish(set, d);
    }
    const int64_t off = k * cap;
    if (size_ > 1 && rank_ != root) copy(segment_->slot(set, rank_), src + off, clamp_len(in_bytes, off, cap));
    arrive_and_wait(call);
    if (k == 0) {
      check_agreement(call, set, false);
      int64_t most = 0;
      for (int q = 0; q < size_; ++q) {
        const int64_t sends = segment_->rank_block(q).desc[set].bytes;
        most = std::max(most, sends);
        for (int x = 0; x < size_; ++x) {
          const int64_t expects = segment_->aux(set, x)[q];
          if (expects >= 0 && expects != sends) {
            fail(call, c10::str("rank ", x, " expects ", expects, " bytes from rank ", q, ", which sends ", sends,
                                " bytes (output sizes must match every rank's input)"));
          }
        }
      }
      nsteps = std::max<int64_t>(1, ceil_div(most, cap));
      if (receives) copy(static_cast<uint8_t*>(outs[rank_]), src, in_bytes);
    }
    if (!receives) continue;
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      copy(static_cast<uint8_t*>(outs[q]) + off, segment_->slot(set, q), clamp_len(out_bytes[q], off, cap));
    }
  }
}

void Comm::scatter(const Call& call, const void* const* ins, const int64_t* in_bytes, void* out, int64_t out_bytes,
                   c10::ScalarType dtype, int root) {
  auto* dst = static_cast<uint8_t*>(out);
  const OpDescriptor d = begin(call, OpKind::kScatter, dtype, -1, root, out_bytes);
  const int64_t cap = static_cast<int64_t>(segment_->layout().chunk_bytes);
  int64_t nsteps = 1;
  for (int64_t k = 0; k < nsteps; ++k) {
    const int set = next_set();
    if (k == 0) {
      int64_t* aux = segment_->aux(set, rank_);
      for (int q = 0; q < size_; ++q) aux[q] = rank_ == root ? in_bytes[q] : -1;
      publish(set, d);
    }
    const int64_t off = k * cap;
    if (rank_ == root) {
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        copy(segment_->slot(set, q), static_cast<const uint8_t*>(ins[q]) + off, clamp_len(in_bytes[q], off, cap));
      }
    }
    arrive_and_wait(call);
    if (k == 0) {
      check_agreement(call, set, false);
      int64_t most = 0;
      for (int q = 0; q < size_; ++q) {
        const int64_t expects = segment_->rank_block(q).desc[set].bytes;
        const int64_t sends = segment_->aux(set, root)[q];
        most = std::max(most, sends);
        if (expects != sends) {
          fail(call, c10::str("root ", root, " sends ", sends, " bytes to rank ", q, ", which expects ", expects,
                              " bytes"));
        }
      }
      nsteps = std::max<int64_t>(1, ceil_div(most, cap));
      if (rank_ == root) copy(dst, ins[rank_], out_bytes);
    }
    if (rank_ != root) copy(dst + off, segment_->slot(set, rank_), clamp_len(out_bytes, off, cap));
  }
}

void Comm::reduce_scatter(const Call& call, const void* const* ins, void* out, int64_t count, c10::ScalarType dtype,
                          RedOp op) {
  const auto es = static_cast<int64_t>(c10::elementSize(dtype));
  auto* dst = static_cast<uint8_t*>(out);
  // Each slot holds one piece per destination rank.
  const int64_t piece = static_cast<int64_t>(segment_->layout().chunk_bytes) / size_ / 64 * 64;
  const int64_t per = piece / es;
  const OpDescriptor d = begin(call, OpKind::kReduceScatter, dtype, static_cast<int32_t>(op), -1, count * es);
  const int64_t nsteps = std::max<int64_t>(1, ceil_div(count, per));
  for (int64_t k = 0; k < nsteps; ++k) {
    const int set = next_set();
    if (k == 0) publish(set, d);
    const int64_t off = k * per;
    const int64_t c = clamp_len(count, off, per);
    uint8_t* mine = segment_->slot(set, rank_);
    for (int q = 0; q < size_; ++q) {
      if (q != rank_) copy(mine + q * piece, static_cast<const uint8_t*>(ins[q]) + off * es, c * es);
    }
    arrive_and_wait(call);
    if (k == 0) check_agreement(call, set, true);
    if (c == 0) continue;
    for (int x = 0; x < size_; ++x) {
      srcs_[x] = x == rank_ ? static_cast<const uint8_t*>(ins[rank_]) + off * es
                            : segment_->slot(set, x) + rank_ * piece;
    }
    reduce_into(dst + off * es, nullptr, srcs_.data(), size_, c, dtype, op, size_);
  }
}

void Comm::alltoall(const Call& call, const void* const* ins, const int64_t* in_bytes, void* const* outs,
                    const int64_t* out_bytes, c10::ScalarType dtype) {
  const int64_t piece = static_cast<int64_t>(segment_->layout().chunk_bytes) / size_ / 64 * 64;
  const OpDescriptor d = begin(call, OpKind::kAlltoall, dtype, -1, -1, 0);
  int64_t nsteps = 1;
  for (int64_t k = 0; k < nsteps; ++k) {
    const int set = next_set();
    if (k == 0) {
      int64_t* aux = segment_->aux(set, rank_);
      for (int q = 0; q < size_; ++q) {
        aux[q] = in_bytes[q];
        aux[size_ + q] = out_bytes[q];
      }
      publish(set, d);
    }
    const int64_t off = k * piece;
    uint8_t* mine = segment_->slot(set, rank_);
    for (int q = 0; q < size_; ++q) {
      if (q != rank_) copy(mine + q * piece, static_cast<const uint8_t*>(ins[q]) + off, clamp_len(in_bytes[q], off, piece));
    }
    arrive_and_wait(call);
    if (k == 0) {
      check_agreement(call, set, true);
      int64_t most = 0;
      for (int x = 0; x < size_; ++x) {
        for (int q = 0; q < size_; ++q) {
          const int64_t sends = segment_->aux(set, x)[q];
          const int64_t expects = segment_->aux(set, q)[size_ + x];
          if (sends != expects) {
            fail(call, c10::str("rank ", x, " sends ", sends, " bytes to rank ", q, ", which expects ", expects,
                                " bytes from it (input and output split sizes must match across ranks)"));
          }
          if (x != q) most = std::max(most, sends);
        }
      }
      nsteps = std::max<int64_t>(1, ceil_div(most, piece));
      copy(outs[rank_], ins[rank_], in_bytes[rank_]);
    }
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      copy(static_cast<uint8_t*>(outs[q]) + off, segment_->slot(set, q) + rank_ * piece,
           clamp_len(out_bytes[q], off, piece));
    }
  }
}

// ~~~ point to point ~~~

bool Comm::send_fits(int dst, int64_t bytes) const {
  const MailboxHead& mb = segment_->mailbox(rank_, dst);
  const uint64_t used = mb.head.load(std::memory_order_relaxed) - mb.tail.load(std::memory_order_acquire);
  return static_cast<int64_t>(segment_->layout().mailbox_bytes - used) >=
         static_cast<int64_t>(sizeof(MessageHeader)) + bytes;
}

bool Comm::recv_ready(int src, int64_t bytes) const {
  const MailboxHead& mb = segment_->mailbox(src, rank_);
  const uint64_t avail = mb.head.load(std::memory_order_acquire) - mb.tail.load(std::memory_order_relaxed);
  return static_cast<int64_t>(avail) >= static_cast<int64_t>(sizeof(MessageHeader)) + bytes;
}

void Comm::stream_write(const Call& call, int dst, const uint8_t* data, int64_t bytes) {
  MailboxHead& mb = segment_->mailbox(rank_, dst);
  uint8_t* ring_data = segment_->mailbox_ring(rank_, dst);
  const uint64_t cap = segment_->layout().mailbox_bytes;
  uint64_t head = mb.head.load(std::memory_order_relaxed);  // only this thread moves it
  int64_t done = 0;
  while (done < bytes) {
    const uint64_t used = head - mb.tail.load(std::memory_order_acquire);
    if (used == cap) {
      wait([&] { return head - mb.tail.load(std::memory_order_acquire) < cap; }, mb.space, call, WaitOn::kPeer, dst);
      continue;
    }
    const uint64_t n = std::min<uint64_t>(cap - used, static_cast<uint64_t>(bytes - done));
    const uint64_t pos = head % cap;
    const uint64_t first = std::min(n, cap - pos);
    std::memcpy(ring_data + pos, data + done, first);
    if (n > first) std::memcpy(ring_data, data + done + first, n - first);
    head += n;
    done += static_cast<int64_t>(n);
    mb.head.store(head, std::memory_order_release);
    ring(mb.data);
  }
}

void Comm::stream_read(const Call& call, int src, uint8_t* data, int64_t bytes) {
  MailboxHead& mb = segment_->mailbox(src, rank_);
  const uint8_t* ring_data = segment_->mailbox_ring(src, rank_);
  const uint64_t cap = segment_->layout().mailbox_bytes;
  uint64_t tail = mb.tail.load(std::memory_order_relaxed);  // only this thread moves it
  int64_t done = 0;
  while (done < bytes) {
    const uint64_t avail = mb.head.load(std::memory_order_acquire) - tail;
    if (avail == 0) {
      wait([&] { return mb.head.load(std::memory_order_acquire) != tail; }, mb.data, call, WaitOn::kPeer, src);
      continue;
    }
    const uint64_t n = std::min<uint64_t>(avail, static_cast<uint64_t>(bytes - done));
    const uint64_t pos = tail % cap;
    const uint64_t first = std::min(n, cap - pos);
    if (data != nullptr) {
      std::memcpy(data + done, ring_data + pos, first);
      if (n > first) std::memcpy(data + done + first, ring_data, n - first);
    }
    tail += n;
    done += static_cast<int64_t>(n);
    mb.tail.store(tail, std::memory_order_release);
    ring(mb.space);
  }
}

void Comm::send(const Call& call, int dst, int tag, const void* data, int64_t bytes, c10::ScalarType dtype) {
  check_not_aborted(call.op);
  const MessageHeader h{kMessageMagic, tag, static_cast<int32_t>(dtype), 0, bytes, 0};
  stream_write(call, dst, reinterpret_cast<const uint8_t*>(&h), sizeof(h));
  stream_write(call, dst, static_cast<const uint8_t*>(data), bytes);
}

void Comm::recv(const Call& call, int src, int tag, void* data, int64_t bytes, c10::ScalarType dtype) {
  check_not_aborted(call.op);
  MessageHeader h{};
  stream_read(call, src, reinterpret_cast<uint8_t*>(&h), sizeof(h));
  if (h.magic != kMessageMagic) {
    abort(c10::str("the mailbox from rank ", src, " to rank ", rank_, " is corrupted"));
    throw_aborted(call.op);
  }
  if (h.tag != tag || h.bytes != bytes || h.dtype != static_cast<int32_t>(dtype)) {
    stream_read(call, src, nullptr, h.bytes);  // drop it: the next message stays readable
    fail(call, c10::str("the next message from rank ", src, " has tag ", h.tag, ", ", h.bytes, " bytes of ",
                        static_cast<c10::ScalarType>(h.dtype), "; this recv expects tag ", tag, ", ", bytes,
                        " bytes of ", dtype, " (messages between two ranks arrive in the order they were sent)"));
  }
  stream_read(call, src, static_cast<uint8_t*>(data), bytes);
}

}  // namespace commgrad::backend::detail
