// TorchBackend: c10d's face of a commgrad group for torch.distributed.
//
// The creator function `import commgrad` registers gets c10d's prefixed store
// for one group; connect_group() exchanges host identities there and connects
// shm (one host), hierarchical or Gloo (several hosts). Each op is then one
// call on that transport, which already implements every collective c10d has
// for CPU tensors (shm_process_group.h; Gloo's and the hierarchical ones for
// groups across hosts). What this file adds is small: PREMUL_SUM as a local
// scaling before SUM (NCCL's op, which FSDP uses to average; the scaling costs
// one pass over the data, less than the transport's own), a timeout set by
// setTimeout() for calls that name none, a sequence number, and commgrad's
// error context on transport errors that lack it (Gloo's own messages).

#include "torch_backend.h"

#include "coalesced_work.h"

#include <commgrad/detail/torch_compat.h>
#include <commgrad/dist/check.h>
#include <commgrad/util/error.h>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <exception>
#include <thread>

namespace commgrad::python {
namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// ReduceOp.PREMUL_SUM: NCCL's op (torch.distributed._make_nccl_premul_sum), a
// factor that is a scalar or a one-element tensor.
bool is_premul_sum(const c10d::ReduceOp& op) { return op.op_ == c10d::ReduceOp::PREMUL_SUM; }

// Multiplies `t` in place by the PREMUL_SUM factor of `op`.
void premultiply(at::Tensor& t, const c10d::ReduceOp& op) {
  auto* factor = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK(factor != nullptr, "[commgrad] PREMUL_SUM without a factor");
  if (factor->tensor_factor.defined()) {
    t.mul_(factor->tensor_factor.to(t.device()));
  } else {
    t.mul_(factor->double_factor);
  }
}

c10d::ReduceOp sum_op() { return c10d::ReduceOp(c10d::ReduceOp::SUM); }

}  // namespace

TorchBackend::TorchBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                           std::chrono::milliseconds timeout, const std::string& group_name)
    : c10d::Backend(rank, size),
      store_(store),
      group_(connect_group(store, rank, size, ConnectOptions().timeout(timeout).name(group_name))) {}

std::chrono::milliseconds TorchBackend::timeout_or(std::chrono::milliseconds requested) const {
  if (requested != c10d::kUnsetTimeout || timeout_.count() <= 0) return requested;
  return timeout_;
}

// A blocking call (asyncOp false: a torch.distributed function called
// without async_op=True) is waited for here, and returns no Work, which is
// what torch.distributed's functions expect of a backend that "has synced at
// C++ level". That saves, per call, a Work that Python would wrap, wait on and
// free (freeing it releases its tensors, which takes the GIL back). Not while
// torch keeps the Works of blocking calls for wait_tensor
// (allow_inflight_collective_as_graph_input).
WorkPtr TorchBackend::settled(WorkPtr work, bool async_op) {
  if (async_op || c10d::allow_inflight_collective_as_graph_input()) return work;
  work->wait();
  return {};
}

WorkPtr TorchBackend::finished(std::vector<at::Tensor> outputs, c10d::OpType type, bool async_op) {
  return settled(c10::make_intrusive<CoalescedWork>(std::vector<WorkPtr>{}, std::move(outputs), type), async_op);
}

template <class Call>
WorkPtr TorchBackend::run(const char* op, bool async_op, Call&& call) {
  ++sequence_;
  try {
    return settled(call(group_.transport()), async_op);
  } catch (const commgrad::Error&) {
    throw;  // names its op and group already
  } catch (const c10::Error& e) {
    COMMGRAD_THROW(commgrad::ErrorKind::kInvalidArgument, commgrad::error_site(op, group_), e.what_without_backtrace());
  }
}

template <class Part>
WorkPtr TorchBackend::post_each(size_t n, bool async_op, std::vector<at::Tensor> outputs, Part&& part) {
  std::vector<WorkPtr> works;
  std::exception_ptr rejected;
  for (size_t i = 0; i < n; ++i) {
    try {
      works.push_back(part(i));
    } catch (...) {
      if (!rejected) rejected = std::current_exception();
    }
  }
  if (rejected) {
    for (auto& w : works) {
      try {
        w->wait();
      } catch (...) {  // the parts of a failed call fail too; the first rejection says why
      }
    }
    std::rethrow_exception(rejected);
  }
  return settled(c10::make_intrusive<CoalescedWork>(std::move(works), std::move(outputs), c10d::OpType::COALESCED),
                 async_op);
}

// ~~~ reductions ~~~

WorkPtr TorchBackend::allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  if (!tensors.empty() && tensors[0].layout() == at::kSparse) return allreduce_sparse(tensors, opts);
  auto o = opts;
  o.timeout = timeout_or(opts.timeout);
  if (group_.backend_name() == "gloo" && opts.reduceOp.op_ == c10d::ReduceOp::AVG && tensors.size() == 1 &&
      at::isIntegralType(tensors[0].scalar_type(), /*includeBool=*/false)) {
    return integer_average(tensors[0], o);
  }
  if (is_premul_sum(opts.reduceOp)) {
    for (auto& t : tensors) premultiply(t, opts.reduceOp);  // in place: allreduce overwrites them anyway
    o.reduceOp = sum_op();
  }
  return run("all_reduce", o.asyncOp, [&](c10d::Backend& t) { return t.allreduce(tensors, o); });
}

// Gloo has no integer AVG (and no int16 sums): a SUM in int64, then the
// truncating division shm does.
WorkPtr TorchBackend::integer_average(at::Tensor& tensor, const c10d::AllreduceOptions& opts) {
  std::vector<at::Tensor> wide{tensor.to(at::kLong)};
  auto sum = opts;
  sum.reduceOp = sum_op();
  run("all_reduce", true, [&](c10d::Backend& t) { return t.allreduce(wide, sum); })->wait();
  tensor.copy_(wide[0].div(getSize(), "trunc"));
  return finished({tensor}, c10d::OpType::ALLREDUCE, opts.asyncOp);
}

WorkPtr TorchBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                          const c10d::AllreduceCoalescedOptions& opts) {
  auto o = opts;
  o.timeout = timeout_or(opts.timeout);
  if (is_premul_sum(opts.reduceOp)) {
    for (auto& t : tensors) premultiply(t, opts.reduceOp);
    o.reduceOp = sum_op();
  }
  return run("all_reduce_coalesced", o.asyncOp, [&](c10d::Backend& t) { return t.allreduce_coalesced(tensors, o); });
}

WorkPtr TorchBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  auto o = opts;
  o.timeout = timeout_or(opts.timeout);
  TORCH_CHECK(!is_premul_sum(opts.reduceOp), "[commgrad] reduce ", group_.describe(),
              ": ReduceOp.PREMUL_SUM is offered for all_reduce and reduce_scatter only");
  return run("reduce", o.asyncOp, [&](c10d::Backend& t) { return t.reduce(tensors, o); });
}

WorkPtr TorchBackend::reduce_scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                     const c10d::ReduceScatterOptions& opts) {
  auto o = opts;
  o.timeout = timeout_or(opts.timeout);
  if (is_premul_sum(opts.reduceOp)) {
    for (auto& list : inputs) {
      for (auto& t : list) {
        t = t.clone();  // the inputs are only read
        premultiply(t, opts.reduceOp);
      }
    }
    o.reduceOp = sum_op();
  }
  return run("reduce_scatter", o.asyncOp, [&](c10d::Backend& t) { return t.reduce_scatter(outputs, inputs, o); });
}

WorkPtr TorchBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                           const c10d::ReduceScatterOptions& opts) {
  auto o = opts;
  o.timeout = timeout_or(opts.timeout);
  at::Tensor in = input.contiguous();
  if (is_premul_sum(opts.reduceOp)) {
    in = input.clone();  // the input is only read
    premultiply(in, opts.reduceOp);
    o.reduceOp = sum_op();
  }
  return run("reduce_scatter_tensor", o.asyncOp,
             [&](c10d::Backend& t) { return t._reduce_scatter_base(output, in, o); });
}

WorkPtr TorchBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                      const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "[commgrad] reduce_scatter_tensor_coalesced ", group_.describe(), ": ",
              outputs.size(), " outputs for ", inputs.size(), " inputs");
  auto parts = opts;
  parts.asyncOp = true;  // one Work for them all
  return post_each(inputs.size(), opts.asyncOp, outputs,
                   [&](size_t i) { return _reduce_scatter_base(outputs[i], inputs[i], parts); });
}

// ~~~ data movement ~~~

WorkPtr TorchBackend::broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
  auto o = opts;
  o.timeout = timeout_or(opts.timeout);
  return run("broadcast", o.asyncOp, [&](c10d::Backend& t) { return t.broadcast(tensors, o); });
}

WorkPtr TorchBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                const c10d::AllgatherOptions& opts) {
  auto o = opts;
  o.timeout = timeout_or(opts.timeout);
  if (group_.backend_name() != "shm" && outputs.size() == 1 && inputs.size() == 1 && uneven(outputs[0])) {
    return allgather_padded(outputs[0], inputs[0], o);
  }
  return run("all_gather", o.asyncOp, [&](c10d::Backend& t) { return t.allgather(outputs, inputs, o); });
}

bool TorchBackend::uneven(const std::vector<at::Tensor>& outputs) {
  for (const auto& t : outputs) {
    if (t.numel() != outputs.front().numel()) return true;
  }
  return false;
}

// shm gathers tensors of different sizes natively; Gloo does not. Every rank
// knows every rank's size (its outputs have them), so each pads its input to
// the largest, one flat all-gather moves them, and the parts are copied out
// once it is done (this call waits for it).
WorkPtr TorchBackend::allgather_padded(std::vector<at::Tensor>& outputs, at::Tensor& input,
                                       const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(static_cast<int>(outputs.size()) == getSize(), "[commgrad] all_gather ", group_.describe(), ": ",
              outputs.size(), " output tensors for a group of ", getSize());
  TORCH_CHECK(input.numel() == outputs[getRank()].numel(), "[commgrad] all_gather ", group_.describe(), ": input ",
              input.sizes(), " does not match this rank's output ", outputs[getRank()].sizes());
  int64_t most = 0;
  for (const auto& t : outputs) most = std::max(most, t.numel());
  auto padded = at::zeros({most}, input.options());
  padded.narrow(0, 0, input.numel()).copy_(input.reshape({-1}));
  auto gathered = at::empty({getSize() * most}, input.options());
  run("all_gather", true, [&](c10d::Backend& t) { return t._allgather_base(gathered, padded, opts); })->wait();
  for (int r = 0; r < getSize(); ++r) {
    outputs[r].copy_(gathered.narrow(0, r * most, outputs[r].numel()).view(outputs[r].sizes()));
  }
  return finished(outputs, c10d::OpType::ALLGATHER, opts.asyncOp);
}

WorkPtr TorchBackend::_allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  auto o = opts;
  o.timeout = timeout_or(opts.timeout);
  // Flat views: Gloo takes a stacked output ([n, *input.shape]) for n
  // tensors of the input's shape and rejects it.
  at::Tensor out = output.is_contiguous() ? output.view({-1}) : output;
  at::Tensor in = input.contiguous().view({-1});
  return run("all_gather_into_tensor", o.asyncOp, [&](c10d::Backend& t) { return t._allgather_base(out, in, o); });
}

WorkPtr TorchBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                      const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "[commgrad] all_gather_into_tensor_coalesced ", group_.describe(), ": ",
              outputs.size(), " outputs for ", inputs.size(), " inputs");
  auto parts = opts;
  parts.asyncOp = true;  // one Work for them all
  return post_each(inputs.size(), opts.asyncOp, outputs,
                   [&](size_t i) { return _allgather_base(outputs[i], inputs[i], parts); });
}

// torch's contract: output_lists[r][i] receives input i of rank r (one list
// per rank, each as long as the inputs). Issued as one all_gather per input.
WorkPtr TorchBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& output_lists,
                                          std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(static_cast<int>(output_lists.size()) == getSize(), "[commgrad] all_gather_coalesced ", group_.describe(),
              ": ", output_lists.size(), " output lists for a group of ", getSize(),
              " (one list per rank, each with a tensor per input)");
  std::vector<at::Tensor> flat;
  for (size_t r = 0; r < output_lists.size(); ++r) {
    TORCH_CHECK(output_lists[r].size() == inputs.size(), "[commgrad] all_gather_coalesced ", group_.describe(),
                ": the output list of rank ", r, " holds ", output_lists[r].size(), " tensors for ", inputs.size(),
                " inputs");
    flat.insert(flat.end(), output_lists[r].begin(), output_lists[r].end());
  }
  auto parts = opts;
  parts.asyncOp = true;  // one Work for them all
  return post_each(inputs.size(), opts.asyncOp, std::move(flat), [&](size_t i) {
    std::vector<std::vector<at::Tensor>> outs(1);
    for (auto& list : output_lists) outs[0].push_back(list[i]);
    std::vector<at::Tensor> in{inputs[i]};
    return allgather(outs, in, parts);
  });
}

WorkPtr TorchBackend::gather_into_tensor(at::Tensor& output, at::Tensor& input, const c10d::GatherOptions& opts) {
  std::vector<std::vector<at::Tensor>> outputs(1);
  if (getRank() == opts.rootRank) {
    TORCH_CHECK(output.is_contiguous() && output.numel() == input.numel() * getSize(), "[commgrad] gather_into_tensor ",
                group_.describe(), ": the output must be contiguous and hold ", getSize(), " x ", input.numel(),
                " elements, got ", output.sizes(), (output.is_contiguous() ? "" : " (not contiguous)"), " for input ",
                input.sizes());
    const auto parts = output.reshape({getSize(), -1});
    for (int r = 0; r < getSize(); ++r) outputs[0].push_back(parts[r].view(input.sizes()));
  } else {
    outputs.clear();
  }
  std::vector<at::Tensor> inputs{input};
  return gather(outputs, inputs, opts);
}

WorkPtr TorchBackend::gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                             const c10d::GatherOptions& opts) {
  auto o = opts;
  o.timeout = timeout_or(opts.timeout);
  return run("gather", o.asyncOp, [&](c10d::Backend& t) { return t.gather(outputs, inputs, o); });
}

WorkPtr TorchBackend::scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                              const c10d::ScatterOptions& opts) {
  auto o = opts;
  o.timeout = timeout_or(opts.timeout);
  return run("scatter", o.asyncOp, [&](c10d::Backend& t) { return t.scatter(outputs, inputs, o); });
}

WorkPtr TorchBackend::alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
                                    std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts) {
  auto o = opts;
  o.timeout = timeout_or(opts.timeout);
  at::Tensor in = input.contiguous();  // Gloo rejects strided inputs; shm would stage them the same way
  return run("all_to_all_single", o.asyncOp,
             [&](c10d::Backend& t) { return t.alltoall_base(output, in, output_split_sizes, input_split_sizes, o); });
}

WorkPtr TorchBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                               const c10d::AllToAllOptions& opts) {
  auto o = opts;
  o.timeout = timeout_or(opts.timeout);
  return run("all_to_all", o.asyncOp, [&](c10d::Backend& t) { return t.alltoall(outputs, inputs, o); });
}

WorkPtr TorchBackend::barrier(const c10d::BarrierOptions& opts) {
  auto o = opts;
  o.timeout = timeout_or(opts.timeout);
  return run("barrier", o.asyncOp, [&](c10d::Backend& t) { return t.barrier(o); });
}

WorkPtr TorchBackend::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  return run("send", true, [&](c10d::Backend& t) { return t.send(tensors, dst_rank, tag); });
}

WorkPtr TorchBackend::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  return run("recv", true, [&](c10d::Backend& t) { return t.recv(tensors, src_rank, tag); });
}

WorkPtr TorchBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return run("recv", true, [&](c10d::Backend& t) { return t.recvAnysource(tensors, tag); });
}

// ~~~ sparse all_reduce ~~~

WorkPtr TorchBackend::allreduce_sparse(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  const std::string where = c10::str("[commgrad] all_reduce (sparse) ", group_.describe(), ": ");
  TORCH_CHECK(tensors.size() == 1 && tensors[0].layout() == at::kSparse, where,
              "expects one sparse COO tensor per call, got ", tensors.size());
  TORCH_CHECK(opts.reduceOp.op_ == c10d::ReduceOp::SUM, where, "only SUM is offered for sparse tensors");
  at::Tensor& t = tensors[0];
  const at::Tensor mine = t.coalesce();
  const at::Tensor indices = mine._indices().t().contiguous();  // [nnz, sparse dims]
  const at::Tensor values = mine._values().contiguous();        // [nnz, dense sizes...]
  c10d::AllgatherOptions gather_opts;
  gather_opts.timeout = opts.timeout;
  // Every rank's part of `local` ([n_r, ...] for the counts n_r) into `parts`.
  auto gather_all = [&](std::vector<at::Tensor> parts, const at::Tensor& local) {
    std::vector<std::vector<at::Tensor>> outs{parts};
    std::vector<at::Tensor> in{local};
    allgather(outs, in, gather_opts)->wait();
    return parts;
  };
  std::vector<at::Tensor> counts;
  for (int r = 0; r < getSize(); ++r) counts.push_back(at::empty({1}, at::kLong));
  counts = gather_all(counts, at::full({1}, mine._nnz(), at::kLong));
  std::vector<at::Tensor> all_indices;
  std::vector<at::Tensor> all_values;
  for (const auto& count : counts) {
    const int64_t n = count.item<int64_t>();
    all_indices.push_back(at::empty({n, indices.size(1)}, indices.options()));
    std::vector<int64_t> shape = values.sizes().vec();
    shape[0] = n;
    all_values.push_back(at::empty(shape, values.options()));
  }
  all_indices = gather_all(all_indices, indices);
  all_values = gather_all(all_values, values);
  const auto sum = at::sparse_coo_tensor(at::cat(all_indices).t(), at::cat(all_values), t.sizes()).coalesce();
  t.copy_(sum);
  return finished(tensors, c10d::OpType::ALLREDUCE, opts.asyncOp);
}

// ~~~ monitored barrier ~~~
//
// Through the group's store, so it never touches the transport's messages.
// Rank r counts its arrivals in the key "<r>/arrived"; rank 0 takes one
// arrival of each rank per barrier (an arrival that comes late counts for
// the next barrier, as a late message does on Gloo), then counts one release
// in "<r>/released" for every rank, which each waits for.

namespace {

const char* kMonitoredBarrier = "commgrad/monitored_barrier/";

// Polls `key`'s counter until it exceeds `seen` or `deadline` passes.
bool counter_exceeds(c10d::Store& store, const std::string& key, int64_t seen,
                     std::chrono::steady_clock::time_point deadline) {
  auto pause = std::chrono::microseconds(500);
  while (store.add(key, 0) <= seen) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(2 * pause, std::chrono::milliseconds(20));
  }
  return true;
}

}  // namespace

void TorchBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  const auto timeout = opts.timeout == c10d::kUnsetTimeout ? group_.timeout() : opts.timeout;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const std::string where = c10::str("[commgrad] monitored_barrier ", group_.describe(), ": ");
  const std::string mine = c10::str(kMonitoredBarrier, getRank());
  if (getRank() != 0) {
    store_->add(mine + "/arrived", 1);
    if (!counter_exceeds(*store_, mine + "/released", released_, deadline)) {
      COMMGRAD_THROW_MESSAGE(
          ::commgrad::ErrorKind::kPeerFailed, where, "Rank ", getRank(),
          " successfully reached monitoredBarrier, but received errors while ",
          "waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank (not released within ",
          timeout.count(), " ms)");
    }
    ++released_;
    return;
  }
  const std::vector<int> late = late_ranks(deadline, timeout, wait_all_ranks);
  if (!late.empty()) {
    COMMGRAD_THROW_MESSAGE(::commgrad::ErrorKind::kPeerFailed, where, wait_all_ranks ? "Ranks " : "Rank ",
                           c10::Join(", ", late), " failed to pass monitoredBarrier in ", timeout.count(), " ms");
  }
  for (int r = 1; r < getSize(); ++r) store_->add(c10::str(kMonitoredBarrier, r, "/released"), 1);
}

// Rank 0: takes one arrival of every rank, waiting for each in rank order
// until `deadline` (the barrier's `timeout` from its start). Without `wait_all_ranks` the first late rank ends the
// wait (a timeout spent before any rank is rank 0's own); the arrivals that
// are there then are taken all the same, as Gloo's posted receives take them.
std::vector<int> TorchBackend::late_ranks(std::chrono::steady_clock::time_point deadline,
                                          std::chrono::milliseconds timeout, bool wait_all_ranks) {
  if (arrivals_taken_.empty()) arrivals_taken_.assign(getSize(), 0);
  if (!wait_all_ranks && timeout.count() <= 0 && getSize() > 1) {
    COMMGRAD_THROW_MESSAGE(::commgrad::ErrorKind::kPeerFailed, "[commgrad] monitored_barrier ", group_.describe(),
                           ": Rank 0 timed out in monitoredBarrier after ", timeout.count(), " ms");
  }
  std::vector<int> late;
  for (int r = 1; r < getSize(); ++r) {
    const std::string key = c10::str(kMonitoredBarrier, r, "/arrived");
    const bool waiting = wait_all_ranks || late.empty();
    const auto until = waiting ? deadline : std::chrono::steady_clock::now();
    if (counter_exceeds(*store_, key, arrivals_taken_[r], until)) {
      ++arrivals_taken_[r];
    } else if (waiting) {
      late.push_back(r);
    }
  }
  return late;
}

}  // namespace commgrad::python
