// The transport of a group that spans hosts (see the header): the steps of
// the hierarchical all_reduce, all_gather and reduce_scatter.
//
// Names: H hosts, L members on this host, n members in all, c elements in one
// member's part. Hosts are numbered in the order of their first member; a
// host's ranks need not be consecutive in the group.
//
// all_reduce (in place): shm reduce onto the leader, Gloo all_reduce among
// the H leaders, shm broadcast from the leader. A leader sends about
// 2 (H-1)/H of the buffer (Gloo's ring), once per host instead of once per rank.
//
// all_gather: shm gather of the host's parts onto the leader, into its host's
// block of a buffer of H blocks of `widest_` parts each (a host of fewer
// ranks leaves the rest of its block unused: c10d's Gloo all_gather needs
// equal parts, and padding costs only the difference); Gloo all_gather of the
// blocks among the leaders; shm broadcast of the H blocks inside each host;
// then every member copies each rank's part out of its slot. Where the hosts
// hold consecutive ranks in equal numbers (the usual launch) and the outputs
// lie back to back in memory (as ops::raw's do), the buffer is the output
// itself and nothing is copied. A leader sends (H-1) x its host's block.
//
// reduce_scatter: shm reduce of the whole input onto the leader (out of
// place: the input is only read); the leaders exchange host blocks with one
// Gloo alltoall_base (host g's block holds the parts of g's members, reordered
// host by host where the hosts' ranks interleave) and each reduces the H
// copies of its own block locally; shm scatter of the block's parts from the
// leader. A leader sends the n - L parts of the other hosts once: (H-1)/H of
// the buffer for equal hosts, half of what an all_reduce of the whole buffer
// followed by a slice would move, and Gloo has no reduce_scatter with parts of
// different sizes to do better (LibTorch 1.13's Gloo has none at all).
// float16/bfloat16 are reduced in float32 inside a host (shm), rounded, and
// summed across hosts in float32 again (ATen's sum), so they round twice.
//
// AVG is SUM, then a division by n: an average of the hosts' averages is
// wrong where hosts hold different numbers of ranks. Every step runs on the
// worker thread, in call order (see the header); the data-moving Gloo steps
// carry bytes, so every dtype crosses.

#include "commgrad/backend/hierarchical_transport.h"

#include "commgrad/util/buffer_pool.h"

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <exception>
#include <numeric>

namespace commgrad::backend {
namespace {

// A Work finished by the worker thread, with a Future (DDP's comm hooks
// and torch.distributed's async handles use it) that holds the tensors.
class StepsWork : public c10d::Work {
 public:
  StepsWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
      : c10d::Work(rank, type),
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

// A flat byte view of contiguous `t` (what the Gloo steps move).
at::Tensor bytes(const at::Tensor& t) { return t.reshape({-1}).view(at::kByte); }

// Divides an AVG's sum by the group's size (integer AVG truncates, as on shm).
void average(at::Tensor& t, int size) {
  if (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type())) {
    t.div_(size);
  } else {
    t.div_(size, "trunc");
  }
}

// An integer AVG sums in int64 (a sum of int8s overflows int8), then divides.
bool widens_for_average(const at::Tensor& t) {
  return at::isIntegralType(t.scalar_type(), /*includeBool=*/false) && t.scalar_type() != at::kLong;
}

// `parts` as one flat tensor when they are contiguous, of one dtype and lie
// back to back in one storage (a view: nothing copied); undefined otherwise.
at::Tensor back_to_back(const std::vector<at::Tensor>& parts) {
  const auto& first = parts.front();
  const int64_t step = first.numel();
  for (size_t q = 0; q < parts.size(); ++q) {
    const auto& t = parts[q];
    if (!t.is_contiguous() || t.scalar_type() != first.scalar_type() || !t.is_alias_of(first) || t.numel() != step ||
        t.storage_offset() != first.storage_offset() + static_cast<int64_t>(q) * step) {
      return {};
    }
  }
  return first.as_strided({step * static_cast<int64_t>(parts.size())}, {1});
}

// The reductions the hierarchical reduce_scatter combines (combine()); the
// others (bitwise, PREMUL_SUM) go to the flat transport, as before it had one.
bool combinable(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::AVG:
    case c10d::ReduceOp::MAX:
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::PRODUCT:
      return true;
    default:
      return false;
  }
}

// Reduces [H, ...] `copies` over dim 0 with `op` into a pooled tensor.
at::Tensor combine(const at::Tensor& copies, const c10d::ReduceOp& op) {
  auto out = pooled_empty(copies.sizes().slice(1), copies.options());
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return at::sum_out(out, copies, 0);
    case c10d::ReduceOp::MAX:
      return at::amax_out(out, copies, 0);
    case c10d::ReduceOp::MIN:
      return at::amin_out(out, copies, 0);
    case c10d::ReduceOp::PRODUCT:
      return at::prod_out(out, copies, 0);
    default:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "combine: only combinable() reductions reach the steps");
}

}  // namespace

HierarchicalTransport::HierarchicalTransport(int rank, int size, HierarchyParts parts)
    : TransportBase(rank, size), parts_(std::move(parts)) {
  for (const auto& m : parts_.members) widest_ = std::max(widest_, static_cast<int>(m.size()));
  slot_.assign(size, 0);
  std::vector<int64_t> order;
  for (size_t h = 0; h < parts_.members.size(); ++h) {
    const auto& m = parts_.members[h];
    for (size_t j = 0; j < m.size(); ++j) slot_[m[j]] = static_cast<int64_t>(h) * widest_ + static_cast<int64_t>(j);
    order.insert(order.end(), m.begin(), m.end());
  }
  std::vector<int64_t> ranks(size);
  std::iota(ranks.begin(), ranks.end(), int64_t{0});
  slots_are_ranks_ = slot_ == ranks && parts_.hosts * widest_ == size;  // no padding either
  hosts_in_rank_order_ = order == ranks;
  host_order_ = at::tensor(order, at::kLong);
  worker_ = std::thread([this] { run(); });
}

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

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::submit(c10d::OpType type, std::vector<at::Tensor> outputs,
                                                             std::function<void()> steps) {
  auto work = c10::make_intrusive<StepsWork>(getRank(), type, std::move(outputs));
  auto job = [work, steps = std::move(steps)]() {
    try {
      steps();
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

// ~~~ all_reduce ~~~

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::allreduce(std::vector<at::Tensor>& tensors,
                                                                const c10d::AllreduceOptions& opts) {
  std::vector<at::Tensor> io = tensors;  // the same tensors (shared storage), kept alive by the job
  const bool avg = opts.reduceOp.op_ == c10d::ReduceOp::AVG;
  c10d::AllreduceOptions sum_opts = opts;
  if (avg) sum_opts.reduceOp.op_ = c10d::ReduceOp::SUM;
  return submit(c10d::OpType::ALLREDUCE, tensors, [this, io, sum_opts, avg, size = getSize()]() mutable {
    std::vector<at::Tensor> sums = io;
    for (auto& t : sums) {
      if (avg && widens_for_average(t)) t = t.to(at::kLong);
    }
    if (parts_.local) {
      c10d::ReduceOptions reduce;
      reduce.reduceOp = sum_opts.reduceOp;
      reduce.rootRank = 0;
      parts_.local->reduce(sums, reduce)->wait();
    }
    if (parts_.leaders) parts_.leaders->allreduce(sums, sum_opts)->wait();
    if (parts_.local) {
      c10d::BroadcastOptions broadcast;
      broadcast.rootRank = 0;
      parts_.local->broadcast(sums, broadcast)->wait();
    }
    if (!avg) return;
    for (size_t i = 0; i < sums.size(); ++i) {
      average(sums[i], size);
      if (!sums[i].is_same(io[i])) io[i].copy_(sums[i]);
    }
  });
}

// ~~~ all_gather ~~~

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                                std::vector<at::Tensor>& inputs,
                                                                const c10d::AllgatherOptions& opts) {
  bool equal_parts = outputs.size() == 1 && inputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize();
  for (size_t q = 0; equal_parts && q < outputs[0].size(); ++q) {
    equal_parts = outputs[0][q].numel() == inputs[0].numel() && outputs[0][q].scalar_type() == inputs[0].scalar_type();
  }
  if (!equal_parts) return parts_.flat->allgather(outputs, inputs, opts);  // Gloo checks (or pads) the rest
  return gather_steps(outputs[0], inputs[0], {});
}

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                      const c10d::AllgatherOptions& opts) {
  if (output.numel() != input.numel() * getSize() || output.scalar_type() != input.scalar_type()) {
    return parts_.flat->_allgather_base(output, input, opts);
  }
  at::Tensor flat = output.is_contiguous() ? output : pooled_empty(output.sizes(), output.options());
  const auto parts = flat.view({-1}).chunk(getSize());
  return gather_steps(parts, input, flat.is_same(output) ? at::Tensor() : output);
}

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::gather_steps(std::vector<at::Tensor> outputs,
                                                                   const at::Tensor& input, at::Tensor copy_back) {
  const int64_t c = input.numel();
  const at::Tensor in = input.contiguous().view({-1});
  std::vector<at::Tensor> results = copy_back.defined() ? std::vector<at::Tensor>{copy_back} : outputs;
  if (c == 0) return submit(c10d::OpType::ALLGATHER, results, [] {});
  at::Tensor staging = slots_are_ranks_ ? back_to_back(outputs) : at::Tensor();
  const bool in_place = staging.defined();  // the outputs themselves hold the blocks
  if (!in_place) staging = pooled_empty({static_cast<int64_t>(parts_.hosts) * widest_ * c}, in.options());
  return submit(c10d::OpType::ALLGATHER, results, [this, outputs, in, staging, in_place, c, copy_back]() {
    const auto blocks = staging.view({parts_.hosts, widest_ * c});
    const auto mine = blocks[parts_.host];
    if (parts_.local) {
      std::vector<std::vector<at::Tensor>> gathered;
      if (parts_.leaders) {
        gathered.emplace_back();
        for (int j = 0; j < parts_.local_size; ++j) gathered[0].push_back(mine.narrow(0, j * c, c));
      }
      std::vector<at::Tensor> inputs{in};
      c10d::GatherOptions gather;
      gather.rootRank = 0;
      parts_.local->gather(gathered, inputs, gather)->wait();
    } else if (mine.data_ptr() != in.data_ptr()) {
      mine.narrow(0, 0, c).copy_(in);
    }
    if (parts_.leaders) {
      std::vector<std::vector<at::Tensor>> all(1);
      for (int h = 0; h < parts_.hosts; ++h) all[0].push_back(bytes(blocks[h]));
      std::vector<at::Tensor> own{bytes(mine)};
      parts_.leaders->allgather(all, own)->wait();
    }
    if (parts_.local) {
      std::vector<at::Tensor> whole{staging};
      c10d::BroadcastOptions broadcast;
      broadcast.rootRank = 0;
      parts_.local->broadcast(whole, broadcast)->wait();
    }
    if (!in_place) {
      for (size_t r = 0; r < outputs.size(); ++r) {
        outputs[r].copy_(staging.narrow(0, slot_[r] * c, c).view(outputs[r].sizes()));
      }
    }
    if (copy_back.defined()) copy_back.copy_(back_to_back(outputs).view(copy_back.sizes()));
  });
}

// ~~~ reduce_scatter ~~~

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                     std::vector<std::vector<at::Tensor>>& inputs,
                                                                     const c10d::ReduceScatterOptions& opts) {
  bool equal_parts = outputs.size() == 1 && inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize() &&
                     combinable(opts.reduceOp);
  for (size_t q = 0; equal_parts && q < inputs[0].size(); ++q) {
    equal_parts = inputs[0][q].numel() == outputs[0].numel() && inputs[0][q].scalar_type() == outputs[0].scalar_type();
  }
  if (!equal_parts) return parts_.flat->reduce_scatter(outputs, inputs, opts);
  at::Tensor whole = back_to_back(inputs[0]);
  if (!whole.defined()) {
    std::vector<at::Tensor> flat;
    for (const auto& t : inputs[0]) flat.push_back(t.reshape({-1}));
    whole = pooled_empty({outputs[0].numel() * getSize()}, outputs[0].options());
    at::cat_out(whole, flat);
  }
  return scatter_steps(outputs[0], whole, opts.reduceOp);
}

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                           const c10d::ReduceScatterOptions& opts) {
  if (input.numel() != output.numel() * getSize() || input.scalar_type() != output.scalar_type() ||
      !combinable(opts.reduceOp)) {
    return parts_.flat->_reduce_scatter_base(output, input, opts);
  }
  return scatter_steps(output, input, opts.reduceOp);
}

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::scatter_steps(const at::Tensor& output, const at::Tensor& input,
                                                                    c10d::ReduceOp op) {
  const bool avg = op.op_ == c10d::ReduceOp::AVG;
  if (avg) op.op_ = c10d::ReduceOp::SUM;
  const int64_t c = output.numel();
  const int n = getSize();
  const bool widen = avg && widens_for_average(input);
  const at::Tensor in = widen ? input.reshape({-1}).to(at::kLong) : input.contiguous().view({-1});
  at::Tensor out = output.is_contiguous() && !widen
                       ? output
                       : pooled_empty(output.sizes(), output.options().dtype(in.scalar_type()));
  return submit(c10d::OpType::REDUCE_SCATTER, {output}, [this, output, in, out, op, avg, c, n]() mutable {
    if (c == 0) return;
    // 1. The host's sum of the whole input on the leader. A non-leader's
    // output is left as it is, so it passes its input (shm allows in == out).
    at::Tensor reduced = in;
    if (parts_.local) {
      if (parts_.leaders) reduced = pooled_empty(in.sizes(), in.options());
      c10d::ReduceOptions reduce;
      reduce.reduceOp = op;
      reduce.rootRank = 0;
      parts_.local->reduce_out(in, reduced, reduce)->wait();
    }
    // 2. The leaders exchange host blocks and reduce the H copies of their own.
    at::Tensor block;  // [L, c]: this host's members' parts, reduced over every host
    if (parts_.leaders) {
      auto rows = reduced.view({n, c});
      at::Tensor send = rows;
      if (!hosts_in_rank_order_) {
        send = pooled_empty(rows.sizes(), rows.options());
        at::index_select_out(send, rows, 0, host_order_);
      }
      auto received = pooled_empty({parts_.hosts, parts_.local_size * c}, in.options());
      const int64_t width = static_cast<int64_t>(c10::elementSize(in.scalar_type())) * c;
      std::vector<int64_t> in_splits;
      for (const auto& m : parts_.members) in_splits.push_back(static_cast<int64_t>(m.size()) * width);
      std::vector<int64_t> out_splits(parts_.hosts, parts_.local_size * width);
      at::Tensor received_bytes = bytes(received), send_bytes = bytes(send);
      parts_.leaders->alltoall_base(received_bytes, send_bytes, out_splits, in_splits)->wait();
      block = combine(received.view({parts_.hosts, parts_.local_size, c}), op);
    }
    // 3. Each member's part from the leader.
    if (parts_.local) {
      std::vector<std::vector<at::Tensor>> parts;
      if (parts_.leaders) {
        parts.emplace_back();
        for (int j = 0; j < parts_.local_size; ++j) parts[0].push_back(block[j]);
      }
      std::vector<at::Tensor> mine{out.view({-1})};
      c10d::ScatterOptions scatter;
      scatter.rootRank = 0;
      parts_.local->scatter(mine, parts, scatter)->wait();
    } else {
      out.view({-1}).copy_(block[0]);
    }
    if (avg) average(out, n);
    if (!out.is_same(output)) output.copy_(out);
  });
}

// ~~~ on the flat transport ~~~

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::broadcast(std::vector<at::Tensor>& tensors,
                                                                const c10d::BroadcastOptions& opts) {
  return parts_.flat->broadcast(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::reduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::ReduceOptions& opts) {
  return parts_.flat->reduce(tensors, opts);
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

c10::intrusive_ptr<c10d::Work> HierarchicalTransport::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return parts_.flat->recvAnysource(tensors, tag);
}

}  // namespace commgrad::backend
