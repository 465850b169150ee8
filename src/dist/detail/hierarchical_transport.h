#pragma once
// The transport of a group that spans hosts (internal to commgrad_dist).
//
// all_reduce runs in three steps: a reduce onto the first rank of each host
// over shm, an all_reduce among those host leaders over Gloo, and a
// broadcast back over shm. Only (hosts - 1)/hosts of the data crosses the
// network once per leader instead of every rank's share, and the ranks of a
// host talk through memory. Every other collective, and point to point, runs
// on a flat Gloo transport of all the members (a data movement gains
// nothing from the detour). The three steps of each all_reduce run on one
// worker thread per group, in the order they were called, so every rank
// issues the steps on its sub-transports in the same order whatever order
// the caller waits in.

#include "commgrad/detail/torch_compat.h"

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace commgrad::detail {

/// The sub-transports of a hierarchical group, by role.
struct HierarchyParts {
  TransportPtr flat;     // Gloo over every member
  TransportPtr local;    // shm over the members on this host (group rank order)
  TransportPtr leaders;  // Gloo over the first member of each host; null on the other ranks
  int hosts = 1;         // number of hosts the group spans
  int local_size = 1;    // members on this host
};

class HierarchicalTransport : public TransportBase {
 public:
  HierarchicalTransport(int rank, int size, HierarchyParts parts);
  ~HierarchicalTransport() override;

  const std::string getBackendName() const override { return "hierarchical"; }

  /// The three-step all_reduce (in place, like every c10d all_reduce).
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;

  // On the flat transport.
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;

  const HierarchyParts& parts() const { return parts_; }

 private:
  void run();

  HierarchyParts parts_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace commgrad::detail
