#pragma once
// The "commgrad" backend of torch.distributed: a c10d::Backend that carries
// a PyTorch process group's CPU tensors on commgrad's transport for that group.

#include <commgrad/dist/process_group.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <string>
#include <vector>

namespace commgrad::python {

/// A c10d::Backend for PyTorch's ProcessGroup. Created once per group (and
/// device) from the store, rank, size and timeout c10d hands a backend's
/// creator function; the ranks exchange host identities through that store
/// (commgrad::connect_group), so the transport is decided per group: shm when
/// every rank of the group is on this host, else commgrad's hierarchical
/// transport or Gloo (never worse than Gloo).
///
/// Every op PyTorch calls on a CPU backend goes to that transport, which
/// checks its arguments and names op, rank, group and shapes in its errors
/// (this class adds the same context to a transport error that lacks it).
/// On top of the transport it adds ReduceOp.PREMUL_SUM (the inputs scaled by
/// the factor, then SUM), the coalesced forms of all_gather_into_tensor and
/// reduce_scatter_tensor (DTensor and FSDP2 call them; issued one by one),
/// recv from any source, sparse all_reduce, monitored_barrier,
/// gather into one tensor, all_gather of different sizes per rank where the
/// transport is Gloo (padded), sequence numbers and setTimeout.
///
/// Example (what `import commgrad` registers; Python):
///   dist.init_process_group("commgrad")          # or "cpu:commgrad,cuda:nccl"
///   dist.all_reduce(torch.ones(4))               # [n, n, n, n] on n ranks
class TorchBackend final : public c10d::Backend {
 public:
  /// Connects this rank's transport of a group of `size` ranks meeting in
  /// `store` (prefixed for this group by c10d). `group_name` is c10d's group
  /// name, used in every error message.
  TorchBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
               const std::string& group_name);

  const std::string getBackendName() const override { return "commgrad"; }
  /// "rank 0/4 group '0' (shm)": the group and the transport carrying it.
  std::string describe() const { return group_.describe(); }
  /// The transport carrying the group: "shm", "gloo" or "hierarchical".
  const std::string& transport_name() const { return group_.backend_name(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
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
  /// Issued as one _allgather_base per pair; one Work for them all.
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  /// Issued as one allgather per input; one Work for them all.
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  /// gather into one tensor on the root: dim 0 of `output` (contiguous) holds the ranks' inputs.
  c10::intrusive_ptr<c10d::Work> gather_into_tensor(at::Tensor& output, at::Tensor& input,
                                                    const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
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
  /// Issued as one _reduce_scatter_base per pair; one Work for them all.
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
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
  /// recv from any rank; the Work's sourceRank() says which (as Gloo's).
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  /// A sum of sparse COO tensors, as Gloo's: the ranks' indices and values
  /// are all-gathered (three collectives) and summed here; coalesced result.
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  /// Gloo's monitored barrier, through the group's store (so it never
  /// touches the transport's messages): rank 0 waits for each rank in turn
  /// and names the first that did not arrive within the timeout (every one
  /// with `wait_all_ranks`), then releases them; a rank that is not released
  /// says it reached the barrier and rank 0 did not answer.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks = false) override;

  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return sequence_; }
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }

 private:
  // Runs one call on the transport: counts it, gives a transport error that
  // does not say where it happened commgrad's context, and settles a
  // blocking call (`async_op` false) here (see settled()).
  template <class Call>
  c10::intrusive_ptr<c10d::Work> run(const char* op, bool async_op, Call&& call);
  // The Work to return: `work` for an asynchronous call; for a blocking one
  // it waits for `work` and returns none (torch.distributed then has nothing
  // to wrap, wait on and free).
  static c10::intrusive_ptr<c10d::Work> settled(c10::intrusive_ptr<c10d::Work> work, bool async_op);
  // The Work of a call that finished here, holding `outputs` (settled()).
  static c10::intrusive_ptr<c10d::Work> finished(std::vector<at::Tensor> outputs, c10d::OpType type, bool async_op);
  std::chrono::milliseconds timeout_or(std::chrono::milliseconds requested) const;
  static bool uneven(const std::vector<at::Tensor>& outputs);
  c10::intrusive_ptr<c10d::Work> integer_average(at::Tensor& tensor, const c10d::AllreduceOptions& opts);
  c10::intrusive_ptr<c10d::Work> allgather_padded(std::vector<at::Tensor>& outputs, at::Tensor& input,
                                                  const c10d::AllgatherOptions& opts);
  // Posts part(i) for every i < n, even after one throws (a rejected part
  // still takes its place on shm, so every rank stays in step), and returns
  // one Work for them all; rethrows the first rejection once the posted
  // parts are done.
  template <class Part>
  c10::intrusive_ptr<c10d::Work> post_each(size_t n, bool async_op, std::vector<at::Tensor> outputs, Part&& part);
  // Rank 0's side of monitoredBarrier: the ranks that did not arrive in time.
  std::vector<int> late_ranks(std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds timeout,
                              bool wait_all_ranks);

  c10::intrusive_ptr<c10d::Store> store_;  // c10d's, prefixed for this group
  Group group_;
  std::vector<int64_t> arrivals_taken_;   // rank 0: each rank's monitored-barrier arrivals taken
  int64_t released_ = 0;                  // other ranks: monitored-barrier releases seen
  std::atomic<uint64_t> sequence_{0};     // DDP issues from autograd threads
  std::chrono::milliseconds timeout_{0};  // 0: the group's own
};

}  // namespace commgrad::python
