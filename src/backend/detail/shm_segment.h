#pragma once
// The shared-memory segment of one shm process group: what lives where in
// it, how it is created, mapped and unlinked, and the futex words ranks
// sleep on. Internal to commgrad_backend.

#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace c10d {
class Store;
}

namespace commgrad::backend::detail {

/// Two cache lines: keeps the adjacent-line prefetcher from coupling
/// words that different ranks write.
constexpr size_t kLine = 128;
/// Buffer sets used round robin by consecutive pipeline steps (see shm_collectives.cpp).
constexpr int kSets = 3;
/// Bytes of the validation message a rank leaves for the others.
constexpr size_t kMessageBytes = 256;

static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free,
              "the shm backend needs address-free atomics");

/// A 32-bit futex word that counts events, and the number of threads
/// asleep on it (so that whoever rings it skips the syscall when nobody
/// sleeps). Those who place one give it a line of its own.
struct Bell {
  std::atomic<uint32_t> value;
  std::atomic<uint32_t> sleepers;
};

/// What a rank is about to do. Written before the first barrier of a
/// collective and compared by every rank after it (with the sizes that
/// follow it in the same cache lines, see Segment::aux).
struct OpDescriptor {
  uint32_t kind;   // OpKind
  int32_t dtype;   // c10::ScalarType
  int32_t reduce;  // RedOp, or -1
  int32_t root;    // root rank, or -1
  uint64_t seq;    // collective number on this group
  int64_t bytes;   // op-specific size (see shm_collectives.cpp)
};
static_assert(sizeof(OpDescriptor) == 32, "a descriptor is 32 bytes");

/// What a rank publishes in one buffer set, starting a line of its own: its
/// arrivals at the barriers of the steps that use the set, the descriptor
/// of a collective whose first step uses the set, and then 3 * size int64
/// values (aux: sizes, addresses). A peer that sees the arrival has in the
/// same line what it checks next.
struct SetBlock {
  std::atomic<uint32_t> generation;  // of the rank's last barrier in this set
  uint32_t unused;
  OpDescriptor desc;
};
static_assert(sizeof(SetBlock) == 40 && alignof(SetBlock) == 8, "aux follows the descriptor directly");

/// One rank's control block.
struct alignas(kLine) RankBlock {
  std::atomic<int32_t> pid;              // 0 until the rank has mapped the segment
  uint64_t pid_namespace;                // inode of its /proc/self/ns/pid: pids compare only within one
  std::atomic<int64_t> arrived_ns;       // when it arrived at the last one (steady clock, shared by the host)
  std::atomic<uint64_t> seq;             // collective it is running or ran last
  std::atomic<uint32_t> kind;            // ... and its kind
  uint64_t probe_address;                // where peers test that they may read it (shm_single_copy.h)
  std::atomic<uint32_t> can_read_peers;  // 1 when it may read every peer (set once, at creation)
  char message[kSets][kMessageBytes];    // why it rejected its arguments (descriptor kind kInvalid), per set
};

/// The start of the segment.
struct alignas(kLine) Header {
  uint64_t magic;
  uint32_t version;
  int32_t size;
  uint64_t chunk_bytes;             // per rank and buffer set
  uint64_t mailbox_bytes;           // ring bytes of each point-to-point mailbox
  int64_t single_copy_bytes;        // all-reduces of this size ... (0: never)
  int64_t single_copy_max_bytes;    // ... to this size read peers directly
  int64_t single_copy_piece_bytes;  // all-to-all pieces from this size are read directly (0: never)
  uint64_t total_bytes;
  alignas(kLine) Bell mapped;                        // every rank adds one once it has mapped the segment
  alignas(kLine) Bell barrier;                       // what ranks sleep on at a barrier (see shm_comm.cpp)
  alignas(kLine) std::atomic<uint32_t> abort_state;  // 0 running, 1 being written, 2 aborted
  int32_t abort_rank;
  char abort_reason[1024];
};

/// The control words of the mailbox from one rank to another: a byte ring
/// with monotonic positions.
struct alignas(kLine) MailboxHead {
  alignas(kLine) std::atomic<uint64_t> head;  // bytes written by the sender
  alignas(kLine) Bell data;                   // rung after head moves
  alignas(kLine) std::atomic<uint64_t> tail;  // bytes consumed by the receiver
  alignas(kLine) Bell space;                  // rung after tail moves
};

/// Where things are, computed identically by every rank from (size, chunk, mailbox).
struct Layout {
  int size = 1;
  uint64_t chunk_bytes = 0;
  uint64_t mailbox_bytes = 0;
  uint64_t ranks_offset = 0;    // RankBlock[size]
  uint64_t sets_offset = 0;     // [kSets][size] of SetBlock + int64[3 * size] (aux) ...
  uint64_t set_stride = 0;      // ... each padded to whole lines
  uint64_t slots_offset = 0;    // uint8[kSets][size][chunk_bytes]
  uint64_t mailbox_offset = 0;  // (MailboxHead + ring)[size][size]
  uint64_t mailbox_stride = 0;
  uint64_t total_bytes = 0;

  static Layout compute(int size, uint64_t chunk_bytes, uint64_t mailbox_bytes);
};

/// What a Segment needs to know to create or join the mapping.
struct SegmentConfig {
  c10::intrusive_ptr<c10d::Store> store;  // prefixed for this group
  int rank = 0;
  int size = 1;
  uint64_t chunk_bytes = 0;
  uint64_t mailbox_bytes = 0;
  int64_t single_copy_bytes = 0;
  int64_t single_copy_max_bytes = 0;
  int64_t single_copy_piece_bytes = 0;
  std::chrono::milliseconds timeout{0};
  std::string context;  // "rank 0/4 group 'world' (shm)" for error messages
};

/// One rank's mapping of the group's segment.
///
/// Rank 0 creates it under a name with 128 random bits (mode 0600, space
/// reserved with posix_fallocate so that a full /dev/shm is an error here,
/// not a SIGBUS later) and publishes the name through the store; every rank
/// maps it and writes its pid; the last rank to map it unlinks the name, and
/// the constructor returns only once every rank has mapped it. So after
/// construction nothing is left in /dev/shm, whatever happens to the job.
/// Before it: a rank that cannot join (other settings, a missing segment)
/// unlinks the name itself and leaves its reason under the group's store
/// key "failed"; a waiting rank looks there, and at the liveness of the
/// ranks that have not mapped it yet (each publishes its pid first), every
/// 50 ms, and gives up at once, removing the name.
class Segment {
 public:
  explicit Segment(const SegmentConfig& config);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  const Layout& layout() const { return layout_; }
  const std::string& name() const { return name_; }

  Header& header() const { return *reinterpret_cast<Header*>(base_); }
  RankBlock& rank_block(int rank) const { return reinterpret_cast<RankBlock*>(base_ + layout_.ranks_offset)[rank]; }
  /// What `rank` publishes in buffer set `set` (see SetBlock).
  SetBlock& set_block(int set, int rank) const {
    return *reinterpret_cast<SetBlock*>(base_ + layout_.sets_offset +
                                        (static_cast<uint64_t>(set) * layout_.size + rank) * layout_.set_stride);
  }
  OpDescriptor& desc(int set, int rank) const { return set_block(set, rank).desc; }
  /// 3 * size int64 values a rank publishes with its descriptor (sizes, addresses).
  int64_t* aux(int set, int rank) const {
    return reinterpret_cast<int64_t*>(reinterpret_cast<uint8_t*>(&set_block(set, rank)) + sizeof(SetBlock));
  }
  /// The chunk_bytes a rank stages in buffer set `set`; the slots of one set are contiguous.
  uint8_t* slot(int set, int rank) const {
    return base_ + layout_.slots_offset + (static_cast<uint64_t>(set) * layout_.size + rank) * layout_.chunk_bytes;
  }
  MailboxHead& mailbox(int src, int dst) const { return *reinterpret_cast<MailboxHead*>(mailbox_base(src, dst)); }
  uint8_t* mailbox_ring(int src, int dst) const { return mailbox_base(src, dst) + sizeof(MailboxHead); }

 private:
  uint8_t* mailbox_base(int src, int dst) const {
    return base_ + layout_.mailbox_offset + (static_cast<uint64_t>(src) * layout_.size + dst) * layout_.mailbox_stride;
  }
  void create(const SegmentConfig& config);
  void open(const SegmentConfig& config);
  void wait_until_mapped(const SegmentConfig& config);
  void give_up(const SegmentConfig& config, const std::string& reason);
  void check_peers(const SegmentConfig& config);
  void abandon();

  Layout layout_;
  std::string name_;
  std::string keys_;  // "shm/<generation>/": this group's store keys
  uint8_t* base_ = nullptr;
};

/// futex(FUTEX_WAIT) on a word that other processes share; returns after a
/// wake-up, a change of the value, a signal or `timeout`.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout);
/// Wakes every thread of any process asleep on `word`.
void futex_wake_all(std::atomic<uint32_t>* word);

/// Counts one event on `bell` and wakes its sleepers, if any.
inline void ring(Bell& bell) {
  bell.value.fetch_add(1, std::memory_order_seq_cst);
  if (bell.sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&bell.value);
}

/// "/commgrad-shm-" followed by "<job id>-" when TORCHELASTIC_RUN_ID (set by
/// commgrad-run) is a plain word: every segment of a job shares the prefix,
/// so its launcher can remove what a killed rank 0 left behind.
std::string segment_name_prefix();

/// "rank 2" or "ranks 1, 3".
std::string describe_ranks(const std::vector<int>& ranks);

/// False when process `pid` is gone (or a zombie).
bool process_alive(int32_t pid);

/// The inode of this process's pid namespace (0 when unknown).
uint64_t pid_namespace();

}  // namespace commgrad::backend::detail
