#pragma once
// `shm`: a c10d process group for the ranks of one host, carried by one
// shared-memory segment per group instead of TCP loopback.

#include "commgrad/backend/shm_options.h"
#include "commgrad/detail/torch_compat.h"

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace commgrad::backend {

namespace detail {
class Comm;
class Executor;
}  // namespace detail

/// A c10d process group (c10d::ProcessGroup in LibTorch 1.13, c10d::Backend
/// in 2.x) for CPU tensors of ranks that share a host. Collectives reduce
/// directly in shared memory, every rank its own slice, in a fixed rank
/// order: results are bitwise identical on every rank.
///
/// Supported: allreduce (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR),
/// allreduce_coalesced, reduce, broadcast, allgather (also with different
/// sizes per rank), _allgather_base, gather, scatter, reduce_scatter,
/// _reduce_scatter_base, alltoall_base (equal or uneven splits), alltoall,
/// barrier, send, recv, recvAnysource. Reductions take float, double, half and bfloat16
/// (combined in float32, rounded once), complex (SUM/AVG), int8/16/32/64,
/// uint8 and bool; data movement takes any dtype. Integer AVG sums without
/// overflow, then truncates.
/// One tensor per call; non-contiguous tensors are staged through a
/// contiguous copy.
///
/// Arguments are checked before anything is shared. A rank whose arguments
/// are rejected still takes its place in the collective, so the other ranks
/// fail at once with its reason; ranks that call different collectives all
/// fail at the same point with a message listing what each called, and the
/// group stays usable. A peer that dies, or does not arrive within the
/// timeout, fails every waiting rank with an error naming it; the group is
/// then aborted and every later call fails.
///
/// Messages between two ranks arrive in the order they were sent: a recv
/// must match the next message from its source (tag, dtype and size are
/// checked).
///
/// Example:
///   auto store = c10::make_intrusive<c10d::HashStore>();   // or a TCPStore
///   auto pg = c10::make_intrusive<commgrad::backend::ShmProcessGroup>(store, rank, size);
///   std::vector<at::Tensor> t{at::ones({4})};
///   pg->allreduce(t)->wait();                                // t == [size, size, size, size]
class ShmProcessGroup : public commgrad::detail::TransportBase {
 public:
  /// Creates (rank 0) or maps (others) the group's segment through `store`;
  /// returns once every rank has mapped it and its name is unlinked.
  ShmProcessGroup(const commgrad::detail::StorePtr& store, int rank, int size, ShmOptions options = {});
  ~ShmProcessGroup() override;

  const std::string getBackendName() const override { return "shm"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  /// Out-of-place all-reduce: `output` = the reduction of every rank's
  /// `input`, which is only read (no staging copy: the differentiable
  /// all_reduce uses it). Both contiguous, same dtype and number of elements,
  /// not overlapping.
  c10::intrusive_ptr<c10d::Work> allreduce_out(const at::Tensor& input, const at::Tensor& output,
                                               const c10d::AllreduceOptions& opts = c10d::AllreduceOptions());
  /// Out-of-place reduce: on the root `output` = the reduction of every
  /// rank's `input`; elsewhere `output` is left as it is. Same rules as
  /// allreduce_out (the differentiable reduce uses it).
  c10::intrusive_ptr<c10d::Work> reduce_out(const at::Tensor& input, const at::Tensor& output,
                                            const c10d::ReduceOptions& opts = c10d::ReduceOptions());
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;
  /// Receives the first message with `tag` from any rank; the Work's
  /// sourceRank() says which (torch.distributed's recv without a source).
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  /// The options in force (defaults resolved: chunk_bytes, mailbox_bytes, spin_us).
  const ShmOptions& options() const { return options_; }
  /// The segment's name in /dev/shm; already unlinked once the constructor returns.
  std::string segment_name() const;
  /// Bytes of the segment mapped by each rank.
  int64_t segment_bytes() const;
  /// "rank 0/4 group 'world' (shm)".
  std::string describe() const;
  /// True when all-reduces of `bytes` read the peers' tensors directly: in
  /// options().single_copy_bytes() to single_copy_max_bytes(), and every
  /// rank could read every other one when the group was created (else the
  /// group stages every size through the segment).
  bool uses_single_copy(int64_t bytes) const;
  /// True when all-to-alls read a piece of `bytes` (what one rank sends
  /// another) straight from the sender: from
  /// options().single_copy_piece_bytes(), under the same condition.
  bool reads_pieces_directly(int64_t bytes) const;

 private:
  class Checks;  // a collective's argument checks (src/backend/detail/shm_checks.h)
  // Runs `run(Comm&, const Call&)` as this group's next collective (shm_process_group.cpp).
  template <class Run>
  c10::intrusive_ptr<c10d::Work> submit_collective(const char* op, c10d::OpType type, c10::ArrayRef<at::Tensor> outputs,
                                                   int64_t bytes, std::chrono::milliseconds timeout, Run&& run);
  [[noreturn]] void reject(const char* op, int kind, const std::string& message);
  // allreduce_out (root -1) and reduce_out: checks, then one Comm::reduce.
  c10::intrusive_ptr<c10d::Work> submit_reduce_out(const Checks& check, const at::Tensor& input,
                                                   const at::Tensor& output, const c10d::ReduceOp& reduce_op,
                                                   std::chrono::milliseconds timeout, int root);
  // send and recv (shm_process_group_p2p.cpp).
  detail::Executor& peer_executor(bool sending, int peer);
  // The one tensor of a send or recv with `peer` (its `role`), checked.
  const at::Tensor& p2p_tensor(const char* op, const std::vector<at::Tensor>& tensors, int peer,
                               const char* role) const;
  std::chrono::milliseconds timeout_of(std::chrono::milliseconds requested) const;

  ShmOptions options_;
  std::unique_ptr<detail::Comm> comm_;
  std::unique_ptr<detail::Executor> collectives_;
  std::mutex peers_mutex_;
  std::vector<std::unique_ptr<detail::Executor>> senders_;    // by destination, created on first use
  std::vector<std::unique_ptr<detail::Executor>> receivers_;  // by source
  std::unique_ptr<detail::Executor> any_source_receiver_;     // created on first use
};

}  // namespace commgrad::backend
