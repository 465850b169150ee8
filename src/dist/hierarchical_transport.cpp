// The transport of a group that spans hosts (see the header).

#include "detail/hierarchical_transport.h"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <exception>

namespace commgrad::detail {
namespace {

// A Work finished by the worker thread, with a Future (DDP's comm hooks
// and torch.distributed's async handles use it) that holds the tensors.
class StepsWork : public c10d::Work {
 public:
  StepsWork(int rank, std::vector<at::Tensor> outputs)
      : c10d::Work(rank, c10d::OpType::ALLREDUCE),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}
  void complete(std::exception_ptr error) {
    finish(error);
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
  }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
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
  auto work = c10::make_intrusive<StepsWork>(getRank(), tensors);
  std::vector<at::Tensor> io = tensors;  // the same tensors (shared storage), kept alive by the job
  // AVG is SUM, then a division by the group's size: an average of the hosts'
  // averages is wrong where hosts hold different numbers of ranks.
  const bool average = opts.reduceOp.op_ == c10d::ReduceOp::AVG;
  c10d::AllreduceOptions leader_opts = opts;
  if (average) leader_opts.reduceOp.op_ = c10d::ReduceOp::SUM;
  auto job = [this, work, io, leader_opts, average, size = getSize()]() mutable {
    const auto& opts = leader_opts;
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
      if (average) {
        for (auto& t : io) {
          if (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type())) {
            t.div_(size);
          } else {
            t.div_(size, "trunc");  // integer AVG truncates, as on shm
          }
        }
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

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                      const c10d::AllgatherOptions& opts) {
  return parts_.flat->_allgather_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                     std::vector<std::vector<at::Tensor>>& inputs,
                                                                     const c10d::ReduceScatterOptions& opts) {
  return parts_.flat->reduce_scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                           const c10d::ReduceScatterOptions& opts) {
  return parts_.flat->_reduce_scatter_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::alltoall(std::vector<at::Tensor>& outputs,
                                                               std::vector<at::Tensor>& inputs,
                                                               const c10d::AllToAllOptions& opts) {
  return parts_.flat->alltoall(outputs, inputs, opts);
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
