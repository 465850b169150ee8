#pragma once
// `hierarchical`: the transport of a group that spans hosts (dist/ creates
// it for such groups: commgrad::connect_group, dist/transport.cpp).
//
// all_reduce, all_gather and reduce_scatter run in three steps: inside each
// host over shm onto the host's first rank (its leader), among the leaders
// over Gloo, and inside each host from the leader over shm (the steps of each
// op: hierarchical_transport.cpp). Only the leaders' traffic crosses the
// network, whole host blocks at a time, and the ranks of a host talk through
// memory. Every other collective, and point to point, runs on a flat Gloo
// transport of all the members (a broadcast or an all_to_all gains nothing
// from the detour). The steps of each op run on one worker thread per group,
// in the order the ops were called, so every rank issues the steps on its
// sub-transports in the same order whatever order the caller waits in.

#include "commgrad/backend/shm_process_group.h"
#include "commgrad/detail/torch_compat.h"

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace commgrad::backend {

using commgrad::detail::TransportBase;
using commgrad::detail::TransportPtr;

/// The sub-transports of a hierarchical group, by role, and where the
/// members live.
struct HierarchyParts {
  TransportPtr flat;                          // Gloo over every member
  c10::intrusive_ptr<ShmProcessGroup> local;  // shm over the members on this host; null when alone
  TransportPtr leaders;  // Gloo over the first member of each host (host order); null on the other ranks
  int hosts = 1;         // number of hosts the group spans
  int local_size = 1;    // members on this host
  int host = 0;          // this rank's host
  /// Group ranks on each host, ascending; hosts in the order of their first
  /// member. A host's ranks need not be consecutive (0 and 2 on one, 1 and 3
  /// on the other).
  std::vector<std::vector<int>> members;
  std::string group_name;  // for error messages
};

class HierarchicalTransport : public TransportBase {
 public:
  HierarchicalTransport(int rank, int size, HierarchyParts parts);
  ~HierarchicalTransport() override;

  const std::string getBackendName() const override { return "hierarchical"; }

  /// The three-step all_reduce (in place, like every c10d all_reduce).
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  /// The three-step all_gather of equal parts (one input, one output per
  /// member); any other shape goes to the flat transport.
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  /// The three-step reduce_scatter of equal parts (SUM, AVG, MAX, MIN,
  /// PRODUCT; any dtype shm reduces); other shapes and reductions go to the
  /// flat transport.
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;

  // On the flat transport.
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  const HierarchyParts& parts() const { return parts_; }

 private:
  void run();
  // Queues `steps` on the worker thread; the Work completes when they return or throw.
  c10::intrusive_ptr<c10d::Work> submit(c10d::OpType type, std::vector<at::Tensor> outputs,
                                        std::function<void()> steps);
  // all_gather of `input` into `outputs` (one per member, each input's size).
  c10::intrusive_ptr<c10d::Work> gather_steps(std::vector<at::Tensor> outputs, const at::Tensor& input,
                                              at::Tensor copy_back);
  // reduce_scatter of flat `input` (members' parts in group rank order) into `output`.
  c10::intrusive_ptr<c10d::Work> scatter_steps(const at::Tensor& output, const at::Tensor& input, c10d::ReduceOp op);

  HierarchyParts parts_;
  int widest_ = 1;                    // members on the largest host
  std::vector<int64_t> slot_;         // by group rank: host * widest_ + place on its host
  bool slots_are_ranks_ = false;      // slot_[r] == r and no slot unused (hosts of consecutive ranks, equal in size)
  at::Tensor host_order_;             // group ranks host by host (int64), for reordering parts
  bool hosts_in_rank_order_ = false;  // host_order_ is 0..n-1
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace commgrad::backend
