// The transport of a group that spans hosts (see the header).

#include "detail/hierarchical_transport.h"

#include <exception>

namespace commgrad::detail {
namespace {

// A Work finished by the worker thread.
class StepsWork : public c10d::Work {
 public:
  explicit StepsWork(int rank) : c10d::Work(rank, c10d::OpType::ALLREDUCE) {}
  void complete(std::exception_ptr error) { finish(std::move(error)); }
};

}  // namespace

HierarchicalTransport::HierarchicalTransport(int rank, int size, HierarchyParts parts)
    : TransportBase(rank, size), parts_(std::move(parts)), worker_([this] { run(); }) {}

HierarchicalTransport::~HierarchicalTransport() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  ready_.notify_all();
  worker_.join();
}

void HierarchicalTransport::run() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, nothing left
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::allreduce(std::vector<at::Tensor>& tensors,
                                                                const c10d::AllreduceOptions& opts) {
  auto work = c10::make_intrusive<StepsWork>(getRank());
  std::vector<at::Tensor> io = tensors;  // the same tensors (shared storage), kept alive by the job
  auto job = [this, work, io, opts]() mutable {
    try {
      if (parts_.local_size > 1) {
        c10d::ReduceOptions reduce;
        reduce.reduceOp = opts.reduceOp;
        reduce.rootRank = 0;
        parts_.local->reduce(io, reduce)->wait();
      }
      if (parts_.leaders) parts_.leaders->allreduce(io, opts)->wait();
      if (parts_.local_size > 1) {
        c10d::BroadcastOptions broadcast;
        broadcast.rootRank = 0;
        parts_.local->broadcast(io, broadcast)->wait();
      }
      work->complete(nullptr);
    } catch (...) {
      work->complete(std::current_exception());
    }
  };
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(std::move(job));
  }
  ready_.notify_one();
  return work;
}

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::broadcast(std::vector<at::Tensor>& tensors,
                                                                const c10d::BroadcastOptions& opts) {
  return parts_.flat->broadcast(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::reduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::ReduceOptions& opts) {
  return parts_.flat->reduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                                std::vector<at::Tensor>& inputs,
                                                                const c10d::AllgatherOptions& opts) {
  return parts_.flat->allgather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::GatherOptions& opts) {
  return parts_.flat->gather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::scatter(std::vector<at::Tensor>& outputs,
                                                              std::vector<std::vector<at::Tensor>>& inputs,
                                                              const c10d::ScatterOptions& opts) {
  return parts_.flat->scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                    std::vector<int64_t>& output_split_sizes,
                                                                    std::vector<int64_t>& input_split_sizes,
                                                                    const c10d::AllToAllOptions& opts) {
  return parts_.flat->alltoall_base(output, input, output_split_sizes, input_split_sizes, opts);
}

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::barrier(const c10d::BarrierOptions& opts) {
  return parts_.flat->barrier(opts);
}

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  return parts_.flat->send(tensors, dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  return parts_.flat->recv(tensors, src_rank, tag);
}

}  // namespace commgrad::detail
