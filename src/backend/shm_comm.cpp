// The shm engine's machinery: waiting, agreement, aborting, and point to point.
//
// The barrier. Each rank counts the barriers it arrives at (generations)
// and stores the count in its own word of the step's buffer set
// (SetBlock); it then waits until every peer's word of that set shows the
// same generation. No rank writes another's line on the way, so an arrival
// costs each waiting peer one line, and that line also holds the
// descriptor and sizes the peer checks next (a counter that every rank
// increments moves between the cores once per arrival, and a descriptor
// in a line of its own is one more fetch). Waiting spins briefly (when
// ranks outnumber cores it yields instead; both adapt, see WaitPolicy),
// then sleeps on the group's barrier bell in slices, checking on the way
// whether the group was aborted, whether a rank it waits for has died (its
// pid is in its control block) and whether the deadline passed. An arrival
// that finds sleepers and every peer arrived rings the bell: one wake-up
// per barrier, by the last to arrive, and none when nobody sleeps.
//
// Agreement. With the data of its first step each rank publishes a
// descriptor (op, dtype, reduction, root, sizes, collective number) and,
// for ops with per-rank sizes, its sizes. After the first barrier every
// rank checks all descriptors with the same function, so a mismatch (or
// a rank that rejected its arguments) fails every rank at the same step
// with the same message, and the group stays usable.
//
// Failures. A dead peer or a timeout aborts the group: the reason goes into
// the segment's header and every sleeper is woken, so every rank fails at
// once with the same cause, naming the rank; later calls fail with it too.
//
// Point to point uses one byte ring per ordered pair of ranks (a mailbox):
// a 32-byte header (tag, dtype, size) then the payload, written and read
// in pieces as space allows, with futex bells for data and space.

#include "detail/shm_comm.h"
#include "detail/shm_copy.h"

#include "commgrad/detail/torch_compat.h"
#include "commgrad/util/error.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <sched.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>

namespace commgrad::backend::detail {
namespace {

// A developer build's A/B block (see detail/shm_ab_blocks.h); 0: off.
#ifdef COMMGRAD_SHM_AB_BLOCK
constexpr int64_t kAbBlock = COMMGRAD_SHM_AB_BLOCK;
#else
constexpr int64_t kAbBlock = 0;
#endif

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

std::string seconds(std::chrono::milliseconds ms) { return c10::str(ms.count() / 1000.0, "s"); }

}  // namespace

Comm::Comm(std::unique_ptr<Segment> segment, int rank, int size, std::string context, WaitPolicy policy,
           SingleCopyPolicy single_copy, StoreMode stores)
    : segment_(std::move(segment)),
      rank_(rank),
      size_(size),
      context_(std::move(context)),
      policy_(policy),
      spin_ns_(policy.max_spin_ns),
      yield_ns_(policy.max_yield_ns),
      stores_(stores),
      srcs_(static_cast<size_t>(size)),
      readers_(new std::mutex[static_cast<size_t>(size)]) {
  if (size > 1 && (single_copy.min_bytes > 0 || single_copy.piece_bytes > 0)) agree_on_single_copy(single_copy);
  if constexpr (kAbBlock > 0) ab_ = std::make_unique<AbBlocks>(kAbBlock);
}

Comm::~Comm() {
  if (ab_) std::fprintf(stderr, "%s\n", ab_->report(context_).c_str());
}

void Comm::fail(const Call& call, const std::string& message) const {
  // The ranks disagree: nothing was sent, and the group stays usable.
  COMMGRAD_THROW(::commgrad::ErrorKind::kMismatch, ::commgrad::make_site(call.op, context_), message);
}

OpDescriptor Comm::begin(const Call& call, OpKind kind, c10::ScalarType dtype, int32_t reduce, int root,
                         int64_t bytes) {
  check_not_aborted(call.op);
  OpDescriptor d;
  d.kind = static_cast<uint32_t>(kind);
  d.dtype = static_cast<int32_t>(dtype);
  d.reduce = reduce;
  d.root = root;
  if constexpr (kAbBlock > 0) ab_->begin(seq_, now_ns());
  d.seq = seq_++;
  d.bytes = bytes;
  RankBlock& me = segment_->rank_block(rank_);
  me.seq.store(d.seq, std::memory_order_relaxed);
  me.kind.store(d.kind, std::memory_order_relaxed);
  return d;
}

void Comm::publish(int set, const OpDescriptor& desc) { segment_->desc(set, rank_) = desc; }

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
    const OpDescriptor& d = segment_->desc(set, q);
    if (d.kind == static_cast<uint32_t>(OpKind::kInvalid)) {
      char message[kMessageBytes];
      std::memcpy(message, segment_->rank_block(q).message[set], kMessageBytes);
      message[kMessageBytes - 1] = '\0';
      fail(call, c10::str("rank ", q, " rejected its arguments to collective #", d.seq, ": ", message));
    }
  }
  const OpDescriptor& ref = segment_->desc(set, 0);
  std::vector<int> differ;
  for (int q = 1; q < size_; ++q) {
    const OpDescriptor& d = segment_->desc(set, q);
    if (d.kind != ref.kind || d.seq != ref.seq || d.dtype != ref.dtype || d.reduce != ref.reduce ||
        d.root != ref.root || (same_bytes && d.bytes != ref.bytes)) {
      differ.push_back(q);
    }
  }
  if (differ.empty()) return;
  std::string detail = c10::str("rank 0: ", describe(ref));
  for (int q : differ) detail += c10::str("; rank ", q, ": ", describe(segment_->desc(set, q)));
  fail(call, c10::str("the ranks called different collectives: ", detail));
}

template <class Ready>
void Comm::wait(Ready&& ready, Bell& bell, const Call& call, WaitOn on, int peer) {
  if (ready()) return;
  const int64_t spin = spin_ns_.load(std::memory_order_relaxed);
  const int64_t start = spin > 0 ? now_ns() : 0;
  if (spin > 0) {
    do {
      for (int i = 0; i < 64; ++i) {
        if (ready()) {
          spin_ns_.store(std::min(policy_.max_spin_ns, 2 * spin), std::memory_order_relaxed);
          return;
        }
        cpu_relax();
      }
    } while (now_ns() - start < spin);
  }
  const int64_t yield = yield_ns_.load(std::memory_order_relaxed);
  if (yield > 0) {
    const int64_t yield_start = now_ns();
    do {
      sched_yield();
      if (ready()) {
        yield_ns_.store(std::min(policy_.max_yield_ns, 2 * yield), std::memory_order_relaxed);
        if (spin > 0) spin_ns_.store(spin_after_miss(spin, start, on), std::memory_order_relaxed);
        return;
      }
    } while (now_ns() - yield_start < yield);
    yield_ns_.store(std::max(kMinSpinNs, yield / 2), std::memory_order_relaxed);
  }
  wait_slow(ready, bell, call, on, peer);
  if (spin > 0) spin_ns_.store(spin_after_miss(spin, start, on), std::memory_order_relaxed);
}

int64_t Comm::spin_after_miss(int64_t spin, int64_t start, WaitOn on) const {
  // How long after the wait began the last rank arrived (barriers only).
  const int64_t late = on == WaitOn::kBarrier ? last_arrival_ns() - start : -1;
  if (late > 0 && late <= policy_.max_spin_ns)
    return std::min(policy_.max_spin_ns, std::max(2 * spin, late + late / 4));
  return std::max(kMinSpinNs, spin / 2);
}

int64_t Comm::last_arrival_ns() const {
  int64_t last = 0;
  for (int q = 0; q < size_; ++q) {
    last = std::max(last, segment_->rank_block(q).arrived_ns.load(std::memory_order_relaxed));
  }
  return last;
}

bool Comm::arrived(int q, int set, uint32_t generation) const {
  // seq_cst loads (plain loads on x86): an arrival and a sleeper each store
  // (their word, the sleeper count) before they load the other's, so at
  // least one of every pair sees the other's store.
  const uint32_t g = segment_->set_block(set, q).generation.load(std::memory_order_seq_cst);
  return static_cast<int32_t>(g - generation) >= 0;
}

bool Comm::all_arrived(int set, uint32_t generation) const {
  for (int q = 0; q < size_; ++q) {
    if (!arrived(q, set, generation)) return false;
  }
  return true;
}

Comm::Arrival Comm::arrive(int set, Wake wake) {
  ++generation_;
  const Arrival at{set, static_cast<uint32_t>(generation_)};
  if (spin_ns_.load(std::memory_order_relaxed) > 0) {
    segment_->rank_block(rank_).arrived_ns.store(now_ns(), std::memory_order_relaxed);
  }
  // seq_cst store, then loads: a rank that counted itself a sleeper before
  // it looked at this word again is seen here, or it sees the word; and of
  // two ranks arriving at once, at least one sees the other.
  segment_->set_block(set, rank_).generation.store(at.generation, std::memory_order_seq_cst);
  Bell& bell = segment_->header().barrier;
  if (bell.sleepers.load(std::memory_order_seq_cst) != 0 &&
      (wake == Wake::kAnySleeper || all_arrived(set, at.generation))) {
    ring(bell);
  }
  return at;
}

void Comm::wait_until_arrived(const Call& call, Arrival at, int rank) {
  awaited_ = Awaited{at, rank};
  Bell& bell = segment_->header().barrier;
  if (rank < 0) {
    wait([&] { return all_arrived(at.set, at.generation); }, bell, call, WaitOn::kBarrier, -1);
  } else {
    wait([&] { return arrived(rank, at.set, at.generation); }, bell, call, WaitOn::kBarrier, -1);
  }
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
              ? c10::str("Timed out after ", seconds(call.timeout), " in collective #", seq_ - 1, " waiting for ",
                         describe_ranks(pending), " (", where, ")")
              : c10::str("Timed out after ", seconds(call.timeout), " waiting for rank ", peer, " (", where, ")");
      if (on == WaitOn::kBarrier) abort(c10::str("rank ", rank_, ": ", what));
      COMMGRAD_THROW(::commgrad::ErrorKind::kTimeout, ::commgrad::make_site(call.op, context_), what);
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
  for (int q = 0; q < size_; ++q) {
    const bool awaited = awaited_.rank < 0 || q == awaited_.rank;
    if (awaited && !arrived(q, awaited_.at.set, awaited_.at.generation)) out.push_back(q);
  }
  return out;
}

void Comm::check_peers(const Call& call, WaitOn on, int peer) {
  for (int q : pending_ranks(on, peer)) {
    const RankBlock& block = segment_->rank_block(q);
    const int32_t pid = block.pid.load(std::memory_order_acquire);
    // A pid from another pid namespace (another container) means nothing
    // here: such a peer is only caught by the timeout.
    if (block.pid_namespace != segment_->rank_block(rank_).pid_namespace || process_alive(pid)) continue;
    // The caller (ops::raw) names the collective's number in its group; a
    // second, transport-level counter here would only confuse.
    const std::string what = c10::str("rank ", q, " (pid ", pid, ") died; this rank was waiting for it in ", call.op);
    abort(c10::str(what, ", found by rank ", rank_));
    COMMGRAD_THROW(::commgrad::ErrorKind::kPeerFailed, ::commgrad::make_site(call.op, context_), what);
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
  futex_wake_all(&h.barrier.value);
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
  COMMGRAD_THROW(::commgrad::ErrorKind::kPeerFailed, ::commgrad::make_site(op, context_),
                 "the group was aborted and cannot be used: ", reason);
}

// ~~~ the simplest collectives ~~~

void Comm::barrier(const Call& call) {
  const OpDescriptor d = begin(call, OpKind::kBarrier, c10::ScalarType::Undefined, -1, -1, 0);
  const int set = next_set();
  publish(set, d);
  arrive_and_wait(call, set);
  check_agreement(call, set, true);
}

void Comm::reject(const Call& call, OpKind kind, const std::string& message) {
  const OpDescriptor d = begin(call, OpKind::kInvalid, c10::ScalarType::Undefined, -1, -1, 0);
  const std::string text = c10::str(op_kind_name(kind), ": ", message);
  const int set = next_set();
  char* slot = segment_->rank_block(rank_).message[set];
  std::strncpy(slot, text.c_str(), kMessageBytes - 1);
  slot[kMessageBytes - 1] = '\0';
  publish(set, d);
  arrive_and_wait(call, set);
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

namespace {

// The bytes [pos, pos + n) of a ring of `cap` bytes, in at most two pieces
// (the second after the wrap): f(offset in the ring, offset in the run, length).
template <class F>
void for_ring_pieces(uint64_t pos, uint64_t n, uint64_t cap, F&& f) {
  const uint64_t at = pos % cap;
  const uint64_t first = std::min(n, cap - at);
  f(at, 0, first);
  if (n > first) f(0, first, n - first);
}

}  // namespace

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
    for_ring_pieces(head, n, cap, [&](uint64_t at, uint64_t off, uint64_t len) {
      copy_bytes(ring_data + at, data + done + off, static_cast<int64_t>(len));
    });
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
    if (data != nullptr) {
      for_ring_pieces(tail, n, cap, [&](uint64_t at, uint64_t off, uint64_t len) {
        copy_bytes(data + done + off, ring_data + at, static_cast<int64_t>(len));
      });
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
  std::lock_guard<std::mutex> reading(readers_[src]);
  MessageHeader h{};
  stream_read(call, src, reinterpret_cast<uint8_t*>(&h), sizeof(h));
  read_body(call, src, &h, tag, data, bytes, dtype);
}

void Comm::read_body(const Call& call, int src, const void* header, int tag, void* data, int64_t bytes,
                     c10::ScalarType dtype) {
  const auto& h = *static_cast<const MessageHeader*>(header);
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

bool Comm::peek_header(int src, void* header) const {
  const MailboxHead& mb = segment_->mailbox(src, rank_);
  const uint64_t tail = mb.tail.load(std::memory_order_relaxed);
  if (mb.head.load(std::memory_order_acquire) - tail < sizeof(MessageHeader)) return false;
  const uint8_t* ring_data = segment_->mailbox_ring(src, rank_);
  const uint64_t cap = segment_->layout().mailbox_bytes;
  auto* out = static_cast<uint8_t*>(header);
  for (uint64_t i = 0; i < sizeof(MessageHeader); ++i) out[i] = ring_data[(tail + i) % cap];
  return true;
}

int Comm::recv_any(const Call& call, int tag, void* data, int64_t bytes, c10::ScalarType dtype) {
  auto pause = std::chrono::microseconds(0);
  while (true) {
    check_not_aborted(call.op);
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      std::unique_lock<std::mutex> reading(readers_[q], std::try_to_lock);
      MessageHeader h{};
      if (!reading.owns_lock() || !peek_header(q, &h) || (h.magic == kMessageMagic && h.tag != tag)) continue;
      stream_read(call, q, reinterpret_cast<uint8_t*>(&h), sizeof(h));
      read_body(call, q, &h, tag, data, bytes, dtype);
      return q;
    }
    if (std::chrono::steady_clock::now() >= call.deadline) {
      COMMGRAD_THROW(::commgrad::ErrorKind::kTimeout, ::commgrad::make_site(call.op, context_), "Timed out after ",
                     seconds(call.timeout), " waiting for a message with tag ", tag, " from any rank");
    }
    if (pause.count() == 0) {
      sched_yield();
      pause = std::chrono::microseconds(20);
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(1));
    }
  }
}

}  // namespace commgrad::backend::detail
