#pragma once
// The settings of a `shm` group (ShmProcessGroup, in shm_process_group.h,
// which includes this header).

#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <string>

namespace commgrad::backend {

/// Settings of a ShmProcessGroup. Every rank of a group must use the same
/// chunk_bytes and mailbox_bytes (the segment's layout depends on them).
///
/// Example:
///   auto options = commgrad::backend::ShmOptions().timeout(std::chrono::seconds(60)).group_name("tp0");
struct ShmOptions {
  /// How long a collective may wait for its peers before it fails, naming them.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(30);
  /// Bytes each rank stages per pipeline step; larger tensors are pipelined
  /// in chunks. 0: $COMMGRAD_SHM_CHUNK_BYTES, else 256 KiB. The segment holds
  /// 3 x size x chunk_bytes of buffers.
  TORCH_ARG(int64_t, chunk_bytes) = 0;
  /// Ring bytes of each point-to-point mailbox (one per ordered pair of
  /// ranks). 0: 16 MiB shared out over the pairs, 4 KiB to 1 MiB each.
  TORCH_ARG(int64_t, mailbox_bytes) = 0;
  /// Collectives on tensors of at least this many bytes run on the group's
  /// worker thread and return at once (overlap with compute); smaller ones,
  /// when nothing is queued before them, run on the calling thread and
  /// return completed (no thread hand-off: microseconds matter there).
  /// -1: $COMMGRAD_SHM_ASYNC_BYTES, else 1 MiB.
  TORCH_ARG(int64_t, async_bytes) = -1;
  /// Whether the worker thread starts a queued collective at once (eager:
  /// it overlaps the caller's compute) or leaves a lone queued collective to
  /// whoever waits for it, starting it only when more work is queued behind
  /// it, someone polls or asks for its Future, or after 10 ms (lazy: no
  /// thread hand-off and no context switch mid-collective). -1: eager when
  /// every rank of the group can have a core for its worker (2 x size <= the
  /// CPUs this process may use), else lazy, unless $COMMGRAD_SHM_EAGER_WORKER
  /// is 0 or 1; 0 lazy; 1 eager.
  TORCH_ARG(int, eager_worker) = -1;
  /// Longest spin, in microseconds, before a waiting rank sleeps on a futex
  /// (the spin adapts below it: it shrinks while peers keep arriving late).
  /// -1: $COMMGRAD_SHM_SPIN_US, else 200 when the group's ranks fit on this
  /// process's CPUs, else 0 (ranks outnumber cores: never spin). It must
  /// exceed the time a rank takes to wake from the futex (docs/shm.md).
  TORCH_ARG(int, spin_us) = -1;
  /// All-reduces from single_copy_bytes to single_copy_max_bytes read the
  /// peers' tensors directly (process_vm_readv, as OpenMPI's "cma"): one
  /// copy per byte instead of two through the segment. Used only when every
  /// rank may read every other one (same user, ptrace allowed; probed when
  /// the group is created), else the segment carries everything. -1:
  /// $COMMGRAD_SHM_SINGLE_COPY_BYTES, else 0 (never): on freshly written
  /// tensors the staged all-reduce, with streaming_stores at its default,
  /// was faster at every size measured. Every rank of a group must use the
  /// same values.
  TORCH_ARG(int64_t, single_copy_bytes) = -1;
  /// -1: $COMMGRAD_SHM_SINGLE_COPY_MAX_BYTES, else 16 MiB.
  TORCH_ARG(int64_t, single_copy_max_bytes) = -1;
  /// All-to-alls: a piece that one rank sends another, of at least this
  /// many bytes, is read by the receiver straight from the sender's tensor
  /// (one copy instead of two through the segment, and no step barriers),
  /// under the same condition as above (every rank may read every other).
  /// -1: $COMMGRAD_SHM_SINGLE_COPY_PIECE_BYTES, else 0 (never): with
  /// freshly written tensors the staged all-to-all, with streaming_stores
  /// at its default, was as fast or faster at every size measured. Every
  /// rank of a group must use the same value.
  TORCH_ARG(int64_t, single_copy_piece_bytes) = -1;
  /// How a rank writes its large pieces (64 KiB and more) into the shared
  /// segment: 0 ordinary stores; 1 streaming (non-temporal) stores, which
  /// skip fetching a line the reading peer's cache still holds (fast when
  /// the ranks' cores share no cache, slower when they do: the reader then
  /// fetches from memory); 2 ordinary stores, timed, and streaming ones
  /// while they run slow (below 4 GB/s three times in a row; ordinary
  /// writes are timed again after 64 streamed ones). With 1 and 2, the
  /// result of a broadcast or all-gather of 16 MiB and more also goes from
  /// the segment into the caller's tensor with streaming stores (it leaves
  /// the caches anyway); 0 keeps every store ordinary. Each rank decides for
  /// itself; the results are the same bits either way. -1:
  /// $COMMGRAD_SHM_STREAMING_STORES, else 2.
  TORCH_ARG(int, streaming_stores) = -1;
  /// Name used in error messages ("world", "tp0", ...).
  TORCH_ARG(std::string, group_name) = "";
};

}  // namespace commgrad::backend
