#pragma once
// How a rank writes into the shared segment: ordinary (cached) stores, or
// streaming (non-temporal) ones that go to memory without first taking the
// cache line. Internal to commgrad_backend.
//
// Why both. A slot written in step k is read by a peer in step k and written
// again three steps later, while the peer's cache still holds it. Where the
// two cores share a last-level cache the writer takes the line back cheaply
// and ordinary stores are fastest (the reader then finds the data in that
// cache). Where they do not (two L3s, two sockets; on a VM, a host that
// moves the vCPUs there) every store must first fetch the line from the
// other cache: measured at 2 ranks, the writes into the segment of a 4 MiB
// all-gather ran at 17-19 GB/s in the one placement and 2.2-3.2 GB/s in the
// other, and the call took 150 against 1000-1450 us. Streaming stores skip
// that fetch (1000 -> 220 us there) but make the reader fetch from memory
// (150 -> 290 us where the cache is shared). So by default a rank times its
// large ordinary writes and streams while they run slow.

#include "detail/shm_copy.h"

#include <cstdint>

namespace commgrad::backend::detail {

/// Which stores a rank uses for large writes into the segment.
enum class StoreMode : int {
  kCached = 0,     // ordinary stores only
  kStreaming = 1,  // non-temporal stores for every large write
  kAdaptive = 2,   // non-temporal while timed ordinary writes run slow
};

/// Whether a rank streams a write into the segment: kAdaptive's state
/// machine, fed with the durations of its ordinary large writes.
class StoreChoice {
 public:
  explicit StoreChoice(StoreMode mode = StoreMode::kCached) : mode_(mode) {}

  StoreMode mode() const { return mode_; }
  /// Whether a write of `bytes` streams; counts it against the streamed run.
  bool stream(int64_t bytes);
  /// Whether an ordinary write of `bytes` is to be timed (and observed).
  bool times(int64_t bytes) const { return mode_ == StoreMode::kAdaptive && bytes >= kLargeBytes; }
  /// An ordinary write of `bytes` took `ns`.
  void observe(int64_t bytes, int64_t ns);

  /// Writes from this size on are large: streamed (kStreaming, or kAdaptive
  /// while slow) or timed (kAdaptive otherwise).
  static constexpr int64_t kLargeBytes = 64 * 1024;
  /// Ordinary writes slower than this (bytes per ns = GB/s) count as slow:
  /// below what a copy from memory runs at (14-15 GB/s alone here, about
  /// half with both ranks copying), above what stores that fetch every line
  /// from the other cache reach (2.2-3.2 GB/s).
  static constexpr double kSlowBytesPerNs = 4.0;
  /// Consecutive slow writes that switch to streaming (a single copy is
  /// sometimes slow for other reasons: an interrupt, a page's first touch),
  /// and the large writes that then stream before ordinary ones are timed again.
  static constexpr int kSlowToStream = 3;
  static constexpr int kStreamedWrites = 64;

 private:
  StoreMode mode_;
  int slow_ = 0;             // consecutive slow ordinary writes
  int64_t stream_left_ = 0;  // large writes left to stream
};

/// One rank's writes into the segment. Not thread-safe (one per Comm; the
/// collectives run one at a time).
class SegmentStores {
 public:
  explicit SegmentStores(StoreMode mode = StoreMode::kCached) : choice_(mode) {}

  StoreMode mode() const { return choice_.mode(); }
  /// `src` into `dst` (in the segment; they do not overlap).
  void copy(void* dst, const void* src, int64_t bytes);
  /// `src` into `dst` (in the segment) and into `own` (private), 16 KiB at a
  /// time so that the second copy of each block reads it from L1.
  void copy_twice(uint8_t* dst, uint8_t* own, const uint8_t* src, int64_t bytes);

 private:
  // Runs write(stream) for a write of `bytes` as choice_ says, timing it
  // when choice_ wants to know.
  template <class Write>
  void write(int64_t bytes, Write&& write);

  StoreChoice choice_;
};

}  // namespace commgrad::backend::detail
