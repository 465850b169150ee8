// ShmProcessGroup: the c10d face of the shm backend.
//
// Each call checks its arguments on the calling thread, stages tensors that
// are not contiguous through a contiguous copy, and hands a job to an
// executor: one for the group's collectives (they must run in issue order),
// one per peer and direction for point-to-point messages (a send that waits
// for a slow receiver must not hold up traffic with anyone else; they are
// in shm_process_group_p2p.cpp). An
// executor runs a job on the calling thread when nothing is queued or
// running and the job is small (a futex hand-off to a worker thread costs
// more than a small all-reduce), and otherwise queues it for its worker
// thread, started on first use. Either way the job completes a Work (and
// its Future) with the result or the exception, so wait() behaves the same.
//
// When a rank's arguments are rejected it throws at once, but it also
// queues a job that takes its place in the collective (Comm::reject), so
// the other ranks fail immediately with its reason instead of timing out.

#include "commgrad/backend/shm_process_group.h"

#include "detail/shm_comm.h"
#include "detail/shm_checks.h"
#include "detail/shm_executor.h"
#include "detail/shm_memory.h"
#include "detail/shm_defaults.h"
#include "detail/shm_staged.h"
#include "detail/shm_work.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <functional>

namespace commgrad::backend {
using detail::Call;
using detail::Comm;
using detail::OpKind;
using detail::PerRank;
using detail::RedOp;
using detail::ShmWork;
using detail::Staged;

// ~~~ construction ~~~

ShmProcessGroup::ShmProcessGroup(const commgrad::detail::StorePtr& store, int rank, int size, ShmOptions options)
    : commgrad::detail::TransportBase(rank, size), options_(detail::resolve(std::move(options), size)) {
  TORCH_CHECK(store, "[commgrad] shm: ShmProcessGroup needs a store");
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "[commgrad] shm group '", options_.group_name(), "': rank ", rank,
              " is outside [0, ", size, ")");
  const std::string context = c10::str("rank ", rank, "/", size, " group '", options_.group_name(), "' (shm)");
  detail::SegmentConfig config;
  config.store = store;
  config.rank = rank;
  config.size = size;
  config.chunk_bytes = static_cast<uint64_t>(options_.chunk_bytes());
  config.mailbox_bytes = static_cast<uint64_t>(options_.mailbox_bytes());
  config.single_copy_bytes = options_.single_copy_bytes();
  config.single_copy_max_bytes = options_.single_copy_max_bytes();
  config.single_copy_piece_bytes = options_.single_copy_piece_bytes();
  config.timeout = options_.timeout();
  config.context = context;
  auto segment = std::make_unique<detail::Segment>(config);
  detail::WaitPolicy policy;
  policy.max_spin_ns = static_cast<int64_t>(options_.spin_us()) * 1000;
  if (size > detail::usable_cpus()) policy.max_yield_ns = 50 * 1000;
  detail::SingleCopyPolicy single_copy;
  single_copy.min_bytes = options_.single_copy_bytes();
  single_copy.max_bytes = options_.single_copy_max_bytes();
  single_copy.piece_bytes = options_.single_copy_piece_bytes();
  single_copy.timeout = options_.timeout();
  comm_ = std::make_unique<Comm>(std::move(segment), rank, size, context, policy, single_copy,
                                 static_cast<detail::StoreMode>(options_.streaming_stores()));
  // The worker starts collectives at once only when it can have a core of
  // its own (see Executor: eager or lazy).
  collectives_ = std::make_unique<detail::Executor>(options_.eager_worker() != 0);
  senders_.resize(size);
  receivers_.resize(size);
  init();
}

ShmProcessGroup::~ShmProcessGroup() {
  // Drain and stop every worker before the segment goes away.
  senders_.clear();
  receivers_.clear();
  any_source_receiver_.reset();
  collectives_.reset();
}

std::string ShmProcessGroup::segment_name() const { return comm_->segment().name(); }
int64_t ShmProcessGroup::segment_bytes() const { return static_cast<int64_t>(comm_->segment().layout().total_bytes); }
std::string ShmProcessGroup::describe() const { return comm_->context(); }
bool ShmProcessGroup::uses_single_copy(int64_t bytes) const { return comm_->single_copy(bytes); }

bool ShmProcessGroup::reads_pieces_directly(int64_t bytes) const { return comm_->reads_directly(bytes); }

std::chrono::milliseconds ShmProcessGroup::timeout_of(std::chrono::milliseconds requested) const {
  return requested.count() > 0 ? requested : options_.timeout();
}

// Small collectives run on the calling thread when nothing is queued (see
// ShmOptions::async_bytes).
template <class Run>
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::submit_collective(const char* op, c10d::OpType type,
                                                                  c10::ArrayRef<at::Tensor> outputs, int64_t bytes,
                                                                  std::chrono::milliseconds timeout, Run&& run) {
  return detail::run_or_queue(*collectives_, bytes < options_.async_bytes(), *comm_, op, timeout_of(timeout), getRank(),
                              type, outputs, std::forward<Run>(run));
}

void ShmProcessGroup::reject(const char* op, int kind, const std::string& message) {
  Comm* comm = comm_.get();
  const auto limit = options_.timeout();
  collectives_->submit([comm, op, kind, limit, message] {
    auto run = [&](Comm& c, const Call& call) { c.reject(call, static_cast<OpKind>(kind), message); };
    (void)detail::run_call(*comm, op, limit, run);  // this rank reports the problem to its caller below
  });
  TORCH_CHECK(false, "[commgrad] ", op, " ", comm_->context(), ": ", message);
}

// ~~~ collectives ~~~

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  const Checks check(*this, "allreduce", OpKind::kAllreduce);
  check.require(tensors.size() == 1, "expects exactly one tensor per call, got ", tensors.size());
  check.tensor(tensors[0], "the tensor");
  const RedOp red = check.reduction(opts.reduceOp, tensors[0].scalar_type());
  Staged s(tensors[0]);
  const int64_t bytes = s.bytes();  // before s moves into the job
  return submit_collective(check.op(), c10d::OpType::ALLREDUCE, tensors, bytes, opts.timeout,
                           [s = std::move(s), red](Comm& c, const Call& call) {
                             c.allreduce(call, s.data(), s.data(), s.buffer.numel(), s.buffer.scalar_type(), red);
                             s.finish();
                           });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::submit_reduce_out(const Checks& check, const at::Tensor& input,
                                                                  const at::Tensor& output,
                                                                  const c10d::ReduceOp& reduce_op,
                                                                  std::chrono::milliseconds timeout, int root) {
  check.tensor(input, "the input");
  check.tensor(output, "the output");
  check.require(input.is_contiguous() && output.is_contiguous(), "the out-of-place form needs contiguous tensors");
  check.require(input.scalar_type() == output.scalar_type() && input.numel() == output.numel(), "input ",
                input.scalar_type(), input.sizes(), " and output ", output.scalar_type(), output.sizes(),
                " differ in dtype or number of elements");
  // The engine takes the same buffer (in place) or two apart, nothing between.
  const auto bytes = static_cast<int64_t>(input.nbytes());
  const void* in_ptr = input.data_ptr();
  void* out_ptr = output.data_ptr();
  check.require(in_ptr == out_ptr || !detail::overlap(in_ptr, bytes, out_ptr, bytes), "input and output overlap");
  const auto dtype = input.scalar_type();
  const RedOp red = check.reduction(reduce_op, dtype);
  const auto type = root < 0 ? c10d::OpType::ALLREDUCE : c10d::OpType::REDUCE;
  const int64_t count = output.numel();
  // The job holds the tensors (a queued job outlives this call) and uses the pointers read above.
  return submit_collective(check.op(), type, {output}, bytes, timeout,
                           [input, output, in_ptr, out_ptr, count, dtype, red, root](Comm& c, const Call& call) {
                             c.reduce(call, in_ptr, out_ptr, count, dtype, red, root);
                           });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allreduce_out(const at::Tensor& input, const at::Tensor& output,
                                                              const c10d::AllreduceOptions& opts) {
  const Checks check(*this, "allreduce", OpKind::kAllreduce);
  return submit_reduce_out(check, input, output, opts.reduceOp, opts.timeout, /*root=*/-1);
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::reduce_out(const at::Tensor& input, const at::Tensor& output,
                                                           const c10d::ReduceOptions& opts) {
  const Checks check(*this, "reduce", OpKind::kReduce);
  check.require(opts.rootRank >= 0 && opts.rootRank < getSize(), "root rank ", opts.rootRank, " is outside [0, ",
                getSize(), ")");
  return submit_reduce_out(check, input, output, opts.reduceOp, opts.timeout, static_cast<int>(opts.rootRank));
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                    const c10d::AllreduceCoalescedOptions& opts) {
  const Checks check(*this, "allreduce_coalesced", OpKind::kAllreduce);
  check.require(!tensors.empty(), "expects at least one tensor");
  PerRank<Staged> staged;
  RedOp red = RedOp::kSum;
  int64_t bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    check.tensor(tensors[i], "tensor", i);
    red = check.reduction(opts.reduceOp, tensors[i].scalar_type());
    staged.emplace_back(tensors[i]);
    bytes += staged.back().bytes();
  }
  return submit_collective(check.op(), c10d::OpType::ALLREDUCE_COALESCED, tensors, bytes, opts.timeout,
                           [staged = std::move(staged), red](Comm& c, const Call& call) {
                             for (const Staged& s : staged) {
                               c.allreduce(call, s.data(), s.data(), s.buffer.numel(), s.buffer.scalar_type(), red);
                               s.finish();
                             }
                           });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  const Checks check(*this, "reduce", OpKind::kReduce);
  check.require(tensors.size() == 1, "expects exactly one tensor per call, got ", tensors.size());
  check.require(opts.rootRank >= 0 && opts.rootRank < getSize(), "root rank ", opts.rootRank, " is outside [0, ",
                getSize(), ")");
  check.require(opts.rootTensor == 0, "root tensor ", opts.rootTensor, " must be 0 (one tensor per call)");
  check.tensor(tensors[0], "the tensor");
  const RedOp red = check.reduction(opts.reduceOp, tensors[0].scalar_type());
  Staged s(tensors[0]);
  const int64_t bytes = s.bytes();  // before s moves into the job
  const int root = static_cast<int>(opts.rootRank);
  return submit_collective(check.op(), c10d::OpType::REDUCE, tensors, bytes, opts.timeout,
                           [s = std::move(s), red, root](Comm& c, const Call& call) {
                             c.reduce(call, s.data(), s.data(), s.buffer.numel(), s.buffer.scalar_type(), red, root);
                             if (c.rank() == root) s.finish();
                           });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  const Checks check(*this, "broadcast", OpKind::kBroadcast);
  check.require(tensors.size() == 1, "expects exactly one tensor per call, got ", tensors.size());
  check.require(opts.rootRank >= 0 && opts.rootRank < getSize(), "root rank ", opts.rootRank, " is outside [0, ",
                getSize(), ")");
  check.require(opts.rootTensor == 0, "root tensor ", opts.rootTensor, " must be 0 (one tensor per call)");
  check.tensor(tensors[0], "the tensor");
  Staged s(tensors[0]);
  const int64_t bytes = s.bytes();  // before s moves into the job
  const int root = static_cast<int>(opts.rootRank);
  return submit_collective(check.op(), c10d::OpType::BROADCAST, tensors, bytes, opts.timeout,
                           [s = std::move(s), root](Comm& c, const Call& call) {
                             c.broadcast(call, s.data(), s.bytes(), s.buffer.scalar_type(), root);
                             if (c.rank() != root) s.finish();
                           });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  const Checks check(*this, "allgather", OpKind::kAllgather);
  check.require(inputs.size() == 1, "expects exactly one input tensor, got ", inputs.size());
  check.require(outputs.size() == 1, "expects one list of output tensors, got ", outputs.size());
  check.require(static_cast<int>(outputs[0].size()) == getSize(), "expects ", getSize(),
                " output tensors (one per rank), got ", outputs[0].size());
  check.tensor(inputs[0], "the input");
  const auto dtype = inputs[0].scalar_type();
  PerRank<Staged> outs;
  for (int q = 0; q < getSize(); ++q) {
    const at::Tensor& t = outputs[0][q];
    check.tensor(t, "output", q);
    check.require(t.scalar_type() == dtype, "output ", q, " has dtype ", t.scalar_type(), ", the input ", dtype);
    outs.emplace_back(t);
  }
  check.require(outputs[0][getRank()].numel() == inputs[0].numel(), "output ", getRank(), " (this rank's) has ",
                outputs[0][getRank()].numel(), " elements, the input ", inputs[0].numel());
  Staged in(inputs[0]);
  const int64_t bytes = in.bytes() * getSize();  // before `in` moves into the job
  return submit_collective(check.op(), c10d::OpType::ALLGATHER, outputs[0], bytes, opts.timeout,
                           [in = std::move(in), outs = std::move(outs), dtype](Comm& c, const Call& call) {
                             PerRank<void*> ptrs;
                             PerRank<int64_t> sizes;
                             for (const Staged& o : outs) {
                               ptrs.push_back(o.data());
                               sizes.push_back(o.bytes());
                             }
                             c.allgather(call, in.data(), in.bytes(), ptrs.data(), sizes.data(), dtype, -1);
                             for (const Staged& o : outs) o.finish();
                           });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::AllgatherOptions& opts) {
  const Checks check(*this, "_allgather_base", OpKind::kAllgather);
  check.tensor(input, "the input");
  check.tensor(output, "the output");
  check.require(output.scalar_type() == input.scalar_type(), "output dtype ", output.scalar_type(),
                " differs from input dtype ", input.scalar_type());
  check.require(output.numel() == input.numel() * getSize(), "output has ", output.numel(),
                " elements; expected world size x input = ", getSize(), " x ", input.numel(), " (input ", input.sizes(),
                ", output ", output.sizes(), ")");
  // In place means the input is this rank's part of the output; any other
  // overlap would be overwritten while it is read.
  const auto part_bytes = static_cast<int64_t>(input.nbytes());
  const void* in_ptr = input.data_ptr();
  const void* out_ptr = output.data_ptr();
  const auto* own_part = static_cast<const uint8_t*>(out_ptr) + part_bytes * getRank();
  check.require(in_ptr == own_part || !detail::overlap(in_ptr, part_bytes, out_ptr, part_bytes * getSize()),
                "the input overlaps the output without being this rank's part of it (in place, the input is "
                "output[",
                getRank(), "])");
  Staged in(input);
  Staged out(output);
  const int64_t bytes = out.bytes();  // before `out` moves into the job
  return submit_collective(check.op(), c10d::OpType::_ALLGATHER_BASE, {output}, bytes, opts.timeout,
                           [in = std::move(in), out = std::move(out)](Comm& c, const Call& call) {
                             PerRank<void*> ptrs;
                             PerRank<int64_t> sizes;
                             for (int q = 0; q < c.size(); ++q) {
                               ptrs.push_back(out.data() + q * in.bytes());
                               sizes.push_back(in.bytes());
                             }
                             c.allgather(call, in.data(), in.bytes(), ptrs.data(), sizes.data(),
                                         in.buffer.scalar_type(), -1);
                             out.finish();
                           });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::GatherOptions& opts) {
  const Checks check(*this, "gather", OpKind::kGather);
  check.require(opts.rootRank >= 0 && opts.rootRank < getSize(), "root rank ", opts.rootRank, " is outside [0, ",
                getSize(), ")");
  check.require(inputs.size() == 1, "expects exactly one input tensor, got ", inputs.size());
  check.tensor(inputs[0], "the input");
  const int root = static_cast<int>(opts.rootRank);
  const auto dtype = inputs[0].scalar_type();
  PerRank<Staged> outs;
  if (getRank() == root) {
    check.require(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(), "the root expects ",
                  getSize(), " output tensors (one per rank) in one list");
    for (int q = 0; q < getSize(); ++q) {
      const at::Tensor& t = outputs[0][q];
      check.tensor(t, "output", q);
      check.require(t.scalar_type() == dtype, "output ", q, " has dtype ", t.scalar_type(), ", the input ", dtype);
      outs.emplace_back(t);
    }
    check.require(outputs[0][root].numel() == inputs[0].numel(), "output ", root, " (the root's) has ",
                  outputs[0][root].numel(), " elements, the input ", inputs[0].numel());
  } else {
    check.require(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                  "a non-root rank takes no output tensors (root is ", root, ")");
  }
  Staged in(inputs[0]);
  const int64_t bytes = in.bytes();  // before `in` moves into the job
  std::vector<at::Tensor> results = getRank() == root ? outputs[0] : std::vector<at::Tensor>{};
  return submit_collective(check.op(), c10d::OpType::GATHER, results, bytes, opts.timeout,
                           [in = std::move(in), outs = std::move(outs), dtype, root](Comm& c, const Call& call) {
                             PerRank<void*> ptrs;
                             PerRank<int64_t> sizes;
                             for (const Staged& o : outs) {
                               ptrs.push_back(o.data());
                               sizes.push_back(o.bytes());
                             }
                             c.allgather(call, in.data(), in.bytes(), outs.empty() ? nullptr : ptrs.data(),
                                         outs.empty() ? nullptr : sizes.data(), dtype, root);
                             for (const Staged& o : outs) o.finish();
                           });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::scatter(std::vector<at::Tensor>& outputs,
                                                        std::vector<std::vector<at::Tensor>>& inputs,
                                                        const c10d::ScatterOptions& opts) {
  const Checks check(*this, "scatter", OpKind::kScatter);
  check.require(opts.rootRank >= 0 && opts.rootRank < getSize(), "root rank ", opts.rootRank, " is outside [0, ",
                getSize(), ")");
  check.require(outputs.size() == 1, "expects exactly one output tensor, got ", outputs.size());
  check.tensor(outputs[0], "the output");
  const int root = static_cast<int>(opts.rootRank);
  const auto dtype = outputs[0].scalar_type();
  PerRank<Staged> ins;
  if (getRank() == root) {
    check.require(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(), "the root expects ", getSize(),
                  " input tensors (one per rank) in one list");
    for (int q = 0; q < getSize(); ++q) {
      const at::Tensor& t = inputs[0][q];
      check.tensor(t, "input", q);
      check.require(t.scalar_type() == dtype, "input ", q, " has dtype ", t.scalar_type(), ", the output ", dtype);
      ins.emplace_back(t);
    }
  } else {
    check.require(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                  "a non-root rank takes no input tensors (root is ", root, ")");
  }
  Staged out(outputs[0]);
  const int64_t bytes = out.bytes();  // before `out` moves into the job
  return submit_collective(check.op(), c10d::OpType::SCATTER, outputs, bytes, opts.timeout,
                           [ins = std::move(ins), out = std::move(out), dtype, root](Comm& c, const Call& call) {
                             PerRank<const void*> ptrs;
                             PerRank<int64_t> sizes;
                             for (const Staged& i : ins) {
                               ptrs.push_back(i.data());
                               sizes.push_back(i.bytes());
                             }
                             c.scatter(call, ins.empty() ? nullptr : ptrs.data(), ins.empty() ? nullptr : sizes.data(),
                                       out.data(), out.bytes(), dtype, root);
                             out.finish();
                           });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                               std::vector<std::vector<at::Tensor>>& inputs,
                                                               const c10d::ReduceScatterOptions& opts) {
  const Checks check(*this, "reduce_scatter", OpKind::kReduceScatter);
  check.require(outputs.size() == 1, "expects exactly one output tensor, got ", outputs.size());
  check.require(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(), "expects ", getSize(),
                " input tensors (one per rank) in one list");
  check.tensor(outputs[0], "the output");
  const auto dtype = outputs[0].scalar_type();
  const RedOp red = check.reduction(opts.reduceOp, dtype);
  PerRank<Staged> ins;
  for (int q = 0; q < getSize(); ++q) {
    const at::Tensor& t = inputs[0][q];
    check.tensor(t, "input", q);
    check.require(t.scalar_type() == dtype, "input ", q, " has dtype ", t.scalar_type(), ", the output ", dtype);
    check.require(t.numel() == outputs[0].numel(), "input ", q, " has ", t.numel(), " elements, the output ",
                  outputs[0].numel(), " (all must be equal)");
    ins.emplace_back(t);
  }
  Staged out(outputs[0]);
  const int64_t bytes = out.bytes() * getSize();  // before `out` moves into the job
  return submit_collective(check.op(), c10d::OpType::REDUCE_SCATTER, outputs, bytes, opts.timeout,
                           [ins = std::move(ins), out = std::move(out), red](Comm& c, const Call& call) {
                             PerRank<const void*> ptrs;
                             for (const Staged& i : ins) ptrs.push_back(i.data());
                             c.reduce_scatter(call, ptrs.data(), out.data(), out.buffer.numel(),
                                              out.buffer.scalar_type(), red);
                             out.finish();
                           });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                     const c10d::ReduceScatterOptions& opts) {
  const Checks check(*this, "_reduce_scatter_base", OpKind::kReduceScatter);
  check.tensor(input, "the input");
  check.tensor(output, "the output");
  check.require(output.scalar_type() == input.scalar_type(), "output dtype ", output.scalar_type(),
                " differs from input dtype ", input.scalar_type());
  check.require(input.numel() == output.numel() * getSize(), "input has ", input.numel(),
                " elements; expected world size x output = ", getSize(), " x ", output.numel(), " (input ",
                input.sizes(), ", output ", output.sizes(), ")");
  const RedOp red = check.reduction(opts.reduceOp, input.scalar_type());
  Staged in(input);
  Staged out(output);
  const int64_t bytes = in.bytes();  // before `in` moves into the job
  return submit_collective(check.op(), c10d::OpType::_REDUCE_SCATTER_BASE, {output}, bytes, opts.timeout,
                           [in = std::move(in), out = std::move(out), red](Comm& c, const Call& call) {
                             PerRank<const void*> ptrs;
                             for (int q = 0; q < c.size(); ++q) ptrs.push_back(in.data() + q * out.bytes());
                             c.reduce_scatter(call, ptrs.data(), out.data(), out.buffer.numel(),
                                              out.buffer.scalar_type(), red);
                             out.finish();
                           });
}

namespace {

// Byte offset and size of each piece of an alltoall_base tensor split along dim 0.
bool split_pieces(const at::Tensor& t, const std::vector<int64_t>& splits, int size, PerRank<int64_t>* offsets,
                  PerRank<int64_t>* bytes, std::string* why) {
  if (t.dim() == 0) {
    *why = "needs tensors with at least one dimension";
    return false;
  }
  const int64_t rows = t.size(0);
  const int64_t row_bytes = rows == 0 ? 0 : static_cast<int64_t>(t.nbytes()) / rows;
  PerRank<int64_t> counts(splits.begin(), splits.end());
  if (counts.empty()) {
    if (rows % size != 0) {
      *why = c10::str("dim 0 of ", t.sizes(), " is not divisible by the group size ", size,
                      " (pass split sizes for uneven pieces)");
      return false;
    }
    counts.assign(size, rows / size);
  }
  if (static_cast<int>(counts.size()) != size) {
    *why = c10::str("has ", counts.size(), " split sizes for ", size, " ranks");
    return false;
  }
  int64_t sum = 0;
  for (int64_t c : counts) {
    if (c < 0) {
      *why = c10::str("has a negative split size in ", c10::IntArrayRef(counts));
      return false;
    }
    sum += c;
  }
  if (sum != rows) {
    *why = c10::str("split sizes ", c10::IntArrayRef(counts), " add up to ", sum, ", but dim 0 of ", t.sizes(), " is ",
                    rows);
    return false;
  }
  int64_t off = 0;
  for (int64_t c : counts) {
    offsets->push_back(off);
    bytes->push_back(c * row_bytes);
    off += c * row_bytes;
  }
  return true;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                              std::vector<int64_t>& output_split_sizes,
                                                              std::vector<int64_t>& input_split_sizes,
                                                              const c10d::AllToAllOptions& opts) {
  const Checks check(*this, "alltoall_base", OpKind::kAlltoall);
  check.tensor(input, "the input");
  check.tensor(output, "the output");
  check.require(output.scalar_type() == input.scalar_type(), "output dtype ", output.scalar_type(),
                " differs from input dtype ", input.scalar_type());
  PerRank<int64_t> in_off, in_bytes, out_off, out_bytes;
  std::string why;
  check.require(split_pieces(input, input_split_sizes, getSize(), &in_off, &in_bytes, &why), "the input ", why);
  check.require(split_pieces(output, output_split_sizes, getSize(), &out_off, &out_bytes, &why), "the output ", why);
  Staged in(input);
  Staged out(output);
  const int64_t bytes = in.bytes();  // before `in` moves into the job
  return submit_collective(
      check.op(), c10d::OpType::ALLTOALL_BASE, {output}, bytes, opts.timeout,
      [in = std::move(in), out = std::move(out), in_off = std::move(in_off), in_bytes = std::move(in_bytes),
       out_off = std::move(out_off), out_bytes = std::move(out_bytes)](Comm& c, const Call& call) {
        PerRank<const void*> ins;
        PerRank<void*> outs;
        for (int q = 0; q < c.size(); ++q) {
          ins.push_back(in.data() + in_off[q]);
          outs.push_back(out.data() + out_off[q]);
        }
        c.alltoall(call, ins.data(), in_bytes.data(), outs.data(), out_bytes.data(), in.buffer.scalar_type());
        out.finish();
      });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::alltoall(std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  const Checks check(*this, "alltoall", OpKind::kAlltoall);
  check.require(static_cast<int>(inputs.size()) == getSize() && static_cast<int>(outputs.size()) == getSize(),
                "expects ", getSize(), " input and output tensors (one per rank), got ", inputs.size(), " and ",
                outputs.size());
  check.tensor(inputs[0], "input 0");
  const auto dtype = inputs[0].scalar_type();
  PerRank<Staged> ins, outs;
  int64_t bytes = 0;
  for (int q = 0; q < getSize(); ++q) {
    check.tensor(inputs[q], "input", q);
    check.tensor(outputs[q], "output", q);
    check.require(inputs[q].scalar_type() == dtype && outputs[q].scalar_type() == dtype,
                  "every input and output must have dtype ", dtype, "; input ", q, " has ", inputs[q].scalar_type(),
                  ", output ", q, " has ", outputs[q].scalar_type());
    ins.emplace_back(inputs[q]);
    outs.emplace_back(outputs[q]);
    bytes += ins.back().bytes();
  }
  check.require(inputs[getRank()].numel() == outputs[getRank()].numel(), "input ", getRank(), " has ",
                inputs[getRank()].numel(), " elements but output ", getRank(), " (this rank's own piece) has ",
                outputs[getRank()].numel());
  return submit_collective(check.op(), c10d::OpType::ALLTOALL, outputs, bytes, opts.timeout,
                           [ins = std::move(ins), outs = std::move(outs), dtype](Comm& c, const Call& call) {
                             PerRank<const void*> in_ptrs;
                             PerRank<void*> out_ptrs;
                             PerRank<int64_t> in_bytes, out_bytes;
                             for (int q = 0; q < c.size(); ++q) {
                               in_ptrs.push_back(ins[q].data());
                               in_bytes.push_back(ins[q].bytes());
                               out_ptrs.push_back(outs[q].data());
                               out_bytes.push_back(outs[q].bytes());
                             }
                             c.alltoall(call, in_ptrs.data(), in_bytes.data(), out_ptrs.data(), out_bytes.data(),
                                        dtype);
                             for (const Staged& o : outs) o.finish();
                           });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::barrier(const c10d::BarrierOptions& opts) {
  return submit_collective("barrier", c10d::OpType::BARRIER, {}, 0, opts.timeout,
                           [](Comm& c, const Call& call) { c.barrier(call); });
}

}  // namespace commgrad::backend
