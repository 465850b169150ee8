#pragma once
// The collectives of the shm backend on raw memory: what every rank does in
// the shared segment, step by step. ShmProcessGroup (shm_process_group.cpp)
// turns c10d calls with tensors into calls of this class on its worker
// threads. Internal to commgrad_backend.

#include "detail/shm_ab_blocks.h"
#include "detail/shm_segment.h"
#include "detail/shm_stores.h"

#include <c10/core/ScalarType.h>
#include <c10/util/FunctionRef.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace commgrad::backend::detail {

/// The collective a descriptor announces.
enum class OpKind : uint32_t {
  kNone = 0,
  kInvalid,  // a rank rejected its arguments
  kBarrier,
  kAllreduce,
  kReduce,
  kBroadcast,
  kAllgather,
  kGather,
  kScatter,
  kReduceScatter,
  kAlltoall,
};

/// Reductions, in the order of c10d::ReduceOp.
enum class RedOp : int32_t { kSum = 0, kAvg, kProduct, kMin, kMax, kBand, kBor, kBxor };

const char* red_op_name(RedOp op);
const char* op_kind_name(OpKind kind);

/// True when `reduce_into` supports (dtype, op); otherwise `why` says why not.
bool reduction_supported(c10::ScalarType dtype, RedOp op, std::string* why);

/// dst[i] (and dst2[i] when not null) = srcs[0][i] op srcs[1][i] op ... in
/// that order, i < count; half and bfloat16 are combined in float32 and
/// rounded once; AVG divides the sum by `divisor`. dst/dst2 may alias srcs
/// element for element (in-place).
void reduce_into(void* dst, void* dst2, const void* const* srcs, int nsrcs, int64_t count, c10::ScalarType dtype,
                 RedOp op, int divisor);

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/// Where slice q of a chunk of `count` elements begins when the chunk is cut
/// into n slices, one per rank, each a multiple of `align` elements but the
/// last (which may be short or empty): slice q is [slice_begin(q), slice_begin(q + 1)).
inline int64_t slice_begin(int64_t count, int q, int n, int64_t align) {
  return std::min<int64_t>(count, ceil_div(ceil_div(count, n), align) * align * q);
}

/// Per-call context: names and deadline for error messages.
struct Call {
  const char* op = "";  // the c10d name: "allreduce", "_allgather_base", ...
  std::chrono::milliseconds timeout{0};
  std::chrono::steady_clock::time_point deadline;
};

/// How long a waiting rank may spin before it sleeps on a futex. The spin
/// adapts between kMinSpinNs and max_spin_ns: it doubles when a wait ends
/// while spinning, and when a barrier wait had to yield or sleep but the last rank
/// arrived within max_spin_ns (ranks stamp their arrival), a longer spin
/// would have caught it: the spin grows to cover that. It halves when the
/// rank sleeps for longer (or, waiting for a single peer, sleeps at all). So
/// on a busy machine (the peer is not running, and spinning only keeps it off
/// the core) it falls to a token spin, and on a quiet one it stays long
/// enough to skip the futex round trip, and gets back there after a burst of
/// skew: one sleeping rank wakes about 10 us after its peer, which a token
/// spin cannot cover, so without the stamps the spin would stay down.
/// 0 disables spinning (ranks outnumber cores).
struct WaitPolicy {
  int64_t max_spin_ns = 0;
  /// When ranks outnumber cores, a waiting rank then calls sched_yield for
  /// up to this long (adaptive the same way) before it sleeps: a peer that
  /// shares its core runs at once, without two futex round trips.
  int64_t max_yield_ns = 0;
};

/// When the collectives read peers' memory directly (shm_single_copy.h).
struct SingleCopyPolicy {
  /// All-reduces of min_bytes to max_bytes (0: never); every rank of a group has the same.
  int64_t min_bytes = 0;
  int64_t max_bytes = 0;
  /// Pieces of all-to-alls of at least this many bytes (what one rank sends
  /// another; 0: never) are read from the sender directly.
  int64_t piece_bytes = 0;
  /// How long creating the group may wait for the peers' probes.
  std::chrono::milliseconds timeout{0};
};

/// The engine. Every rank of the group calls the same collectives in the
/// same order (one thread at a time); point-to-point calls may run
/// concurrently with them, one thread per peer and direction.
class Comm {
 public:
  /// Probes whether this rank may read its peers (see SingleCopyPolicy) and,
  /// when single copies are on, waits for every rank's probe.
  Comm(std::unique_ptr<Segment> segment, int rank, int size, std::string context, WaitPolicy policy,
       SingleCopyPolicy single_copy = {}, StoreMode stores = StoreMode::kCached);
  ~Comm();

  int rank() const { return rank_; }
  int size() const { return size_; }
  const Segment& segment() const { return *segment_; }
  /// "rank 0/4 group 'world' (shm)".
  const std::string& context() const { return context_; }
  uint64_t sequence() const { return seq_; }
  /// True when all-reduces of `bytes` read the peers' tensors directly.
  bool single_copy(int64_t bytes) const {
    return single_copy_.min_bytes > 0 && bytes >= single_copy_.min_bytes && bytes <= single_copy_.max_bytes;
  }
  /// True when a piece of `bytes` that one rank sends another in an
  /// all-to-all is read from the sender directly. Both ends know the
  /// piece's size (they must agree on it), so both decide alike.
  bool reads_directly(int64_t bytes) const { return single_copy_.piece_bytes > 0 && bytes >= single_copy_.piece_bytes; }

  /// Whether the collective in progress runs variant B of an A/B: always
  /// false but in a build configured with COMMGRAD_SHM_AB_BLOCK (see
  /// detail/shm_ab_blocks.h), where code under comparison asks it.
  bool ab_runs_b() const { return ab_ != nullptr && ab_->runs_b(); }

  // Collectives. Sizes are in elements of `dtype` unless named *_bytes.
  void barrier(const Call& call);
  /// `in` and `out` may be the same buffer (in place) or not overlap at all.
  /// reduce() with root -1 is allreduce().
  void allreduce(const Call& call, const void* in, void* out, int64_t count, c10::ScalarType dtype, RedOp op);
  void reduce(const Call& call, const void* in, void* out, int64_t count, c10::ScalarType dtype, RedOp op, int root);
  void broadcast(const Call& call, void* data, int64_t bytes, c10::ScalarType dtype, int root);
  /// outs[q] receives out_bytes[q] from rank q; `outs` is null on non-roots of a gather.
  void allgather(const Call& call, const void* in, int64_t in_bytes, void* const* outs, const int64_t* out_bytes,
                 c10::ScalarType dtype, int root /* -1: every rank gathers */);
  /// The root sends ins[q] (in_bytes[q]) to rank q; `ins` is null on non-roots.
  void scatter(const Call& call, const void* const* ins, const int64_t* in_bytes, void* out, int64_t out_bytes,
               c10::ScalarType dtype, int root);
  /// out = reduction over ranks of their ins[rank()] (count elements each).
  void reduce_scatter(const Call& call, const void* const* ins, void* out, int64_t count, c10::ScalarType dtype,
                      RedOp op);
  /// Sends ins[q] (in_bytes[q]) to rank q and receives outs[q] (out_bytes[q]) from it.
  void alltoall(const Call& call, const void* const* ins, const int64_t* in_bytes, void* const* outs,
                const int64_t* out_bytes, c10::ScalarType dtype);
  /// Takes this rank's place in the next collective after its arguments
  /// were rejected locally, so that the other ranks fail at once with
  /// `message` instead of waiting out the timeout.
  void reject(const Call& call, OpKind kind, const std::string& message);

  // Point to point, through the mailbox of each ordered pair.
  void send(const Call& call, int dst, int tag, const void* data, int64_t bytes, c10::ScalarType dtype);
  void recv(const Call& call, int src, int tag, void* data, int64_t bytes, c10::ScalarType dtype);
  /// Receives the first message with `tag` that is waiting from any rank
  /// (lowest rank first) and returns its source; messages with other tags
  /// stay for later recvs. Polls, backing off to 1 ms sleeps: any-source
  /// receives are rare and have no bell of their own.
  int recv_any(const Call& call, int tag, void* data, int64_t bytes, c10::ScalarType dtype);
  /// True when a message of `bytes` fits into the mailbox to `dst` right now.
  bool send_fits(int dst, int64_t bytes) const;
  /// True when a whole message of `bytes` from `src` is already waiting.
  bool recv_ready(int src, int64_t bytes) const;

  /// Marks the segment aborted (first reason wins) and wakes every sleeper.
  void abort(const std::string& reason);
  /// Throws the abort reason when the segment was aborted.
  void check_not_aborted(const char* op) const;

 private:
  enum class WaitOn { kBarrier, kPeer };
  /// A rank's arrival at a barrier: the buffer set and the generation its word there shows.
  struct Arrival {
    int set = 0;
    uint32_t generation = 0;
  };
  /// The barrier a rank waits at (or waited at last) and whom it waits for
  /// there, for the timeout's and the dead-peer check's messages.
  struct Awaited {
    Arrival at;
    int rank = -1;  // the one rank awaited; -1: every rank
  };
  /// Whom an arrival wakes: sleepers once every rank has arrived (a
  /// barrier), or any sleeper at once (the root of a paced broadcast, whose
  /// readers wait for it alone).
  enum class Wake { kWhenAllArrived, kAnySleeper };

  int next_set() { return static_cast<int>(step_++ % kSets); }
  OpDescriptor begin(const Call& call, OpKind kind, c10::ScalarType dtype, int32_t reduce, int root, int64_t bytes);
  void publish(int set, const OpDescriptor& desc);
  /// The barrier of a step that uses buffer set `set` (see shm_comm.cpp).
  void arrive_and_wait(const Call& call, int set) { wait_for_peers(call, arrive(set)); }
  /// The barrier's two halves, for a rank with work of its own between them
  /// (work that neither touches the set nor needs the peers): the peers see
  /// the arrival while that work runs.
  Arrival arrive(int set, Wake wake = Wake::kWhenAllArrived);
  /// Waits until every rank has arrived where `at` is (or further).
  void wait_for_peers(const Call& call, Arrival at) { wait_until_arrived(call, at, -1); }
  /// Waits until rank `rank` alone has arrived where `at` is (or further).
  void wait_for_rank(const Call& call, Arrival at, int rank) { wait_until_arrived(call, at, rank); }
  void wait_until_arrived(const Call& call, Arrival at, int rank);  // rank -1: every rank
  /// Whether rank `q`'s word in `set` shows barrier `generation` (or a later one).
  bool arrived(int q, int set, uint32_t generation) const;
  /// Whether every rank's word in `set` shows barrier `generation` (or a later one).
  bool all_arrived(int set, uint32_t generation) const;
  /// Compares every rank's descriptor in `set`; throws the same error on every rank on a mismatch.
  void check_agreement(const Call& call, int set, bool same_bytes);
  [[noreturn]] void fail(const Call& call, const std::string& message) const;

  template <class Ready>
  void wait(Ready&& ready, Bell& bell, const Call& call, WaitOn on, int peer);
  void wait_slow(c10::function_ref<bool()> ready, Bell& bell, const Call& call, WaitOn on, int peer);
  std::vector<int> pending_ranks(WaitOn on, int peer) const;
  int64_t last_arrival_ns() const;  // the latest arrival stamp of the ranks at a barrier
  // The spin after a wait that spinning `spin` ns from `start` did not catch (see WaitPolicy).
  int64_t spin_after_miss(int64_t spin, int64_t start, WaitOn on) const;
  void check_peers(const Call& call, WaitOn on, int peer);
  [[noreturn]] void throw_aborted(const char* op) const;

  void allreduce_small(const Call& call, const uint8_t* in, uint8_t* out, int64_t count, c10::ScalarType dtype,
                       RedOp op, int root);
  void allreduce_pipelined(const Call& call, const uint8_t* in, uint8_t* out, int64_t count, c10::ScalarType dtype,
                           RedOp op, int root);
  void allreduce_single_copy(const Call& call, const uint8_t* in, uint8_t* out, int64_t count, c10::ScalarType dtype,
                             RedOp op);
  // Copies `bytes` of a result out of the segment into the caller's tensor
  // (see shm_collectives.cpp: streaming stores for results of
  // kStreamResultBytes and more, `result_bytes` being the call's whole result).
  void copy_result(void* dst, const void* src, int64_t bytes, int64_t result_bytes) const;
  // Reads `bytes` at `address` of rank `peer` into `local`; aborts the group on failure.
  void read_peer(const Call& call, int peer, uint64_t address, void* local, int64_t bytes);
  // Takes on `policy` when every rank may read every other one.
  void agree_on_single_copy(const SingleCopyPolicy& policy);
  void stream_write(const Call& call, int dst, const uint8_t* data, int64_t bytes);
  void stream_read(const Call& call, int src, uint8_t* data, int64_t bytes);
  // Reads the rest of a message from `src` whose header `h` was consumed:
  // into `data` when it is what the recv expects, else dropped with an error.
  void read_body(const Call& call, int src, const void* header, int tag, void* data, int64_t bytes,
                 c10::ScalarType dtype);
  // Copies the header of the next message from `src` into `header` (32
  // bytes) without consuming it; false when none is there yet.
  bool peek_header(int src, void* header) const;

  std::unique_ptr<Segment> segment_;
  const int rank_;
  const int size_;
  const std::string context_;
  const WaitPolicy policy_;
  std::atomic<int64_t> spin_ns_;   // the adaptive spin (see WaitPolicy)
  std::atomic<int64_t> yield_ns_;  // the adaptive yield phase (see WaitPolicy)
  uint64_t seq_ = 0;               // collectives issued
  uint64_t step_ = 0;              // pipeline steps (buffer sets) used
  uint64_t generation_ = 0;        // barriers arrived at
  Awaited awaited_;                // for timeout messages
  SegmentStores stores_;           // this rank's writes into the segment
  std::vector<const void*> srcs_;  // scratch: one source per rank
  std::vector<uint8_t> scratch_;   // peers' pieces read by a single-copy reduction
  SingleCopyPolicy single_copy_;   // all 0: this group never reads peers directly
  // One per source: a recv and a recv_any never read one mailbox at once.
  std::unique_ptr<std::mutex[]> readers_;
  std::unique_ptr<AbBlocks> ab_;  // null but in an A/B build
};

}  // namespace commgrad::backend::detail
