// ShmProcessGroup: the c10d face of the shm backend.
//
// Each call checks its arguments on the calling thread, stages tensors that
// are not contiguous through a contiguous copy, and hands a job to an
// executor: one for the group's collectives (they must run in issue order),
// one per peer and direction for point-to-point messages (a send that waits
// for a slow receiver must not hold up traffic with anyone else). An
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
#include "commgrad/util/env.h"

#include "detail/shm_comm.h"
#include "detail/shm_executor.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <sched.h>

#include <cstdlib>
#include <functional>
#include <numeric>
#include <thread>

namespace commgrad::backend {
using detail::Call;
using detail::Comm;
using detail::OpKind;
using detail::RedOp;

struct ShmProcessGroup::Job {
  std::function<void(Comm&, const Call&)> run;
};

namespace {

/// A Work completed by an executor job. Its Future (as ProcessGroupGloo
/// has) is made on first request: most callers only wait(), and completing
/// a Future costs more than a small all-reduce.
class ShmWork : public c10d::Work {
 public:
  ShmWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
      : c10d::Work(rank, type), outputs_(std::move(outputs)) {}

  void complete(const std::exception_ptr& error) {
    c10::intrusive_ptr<c10::ivalue::Future> future;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      error_ = error;
      done_ = true;
      future = future_;
    }
    if (future) settle(*future);
    finish(error);
  }

  std::vector<at::Tensor> result() override { return outputs_; }

  /// The job behind this Work sits in `executor`'s queue under `ticket`.
  void queued_in(detail::Executor* executor, uint64_t ticket) {
    executor_ = executor;
    ticket_ = ticket;
  }

  // A caller that waits before the worker thread has started the job runs
  // it itself (see Executor::run_until); otherwise the worker must get to it.
  // A Work that is not completed belongs to a live group: the group's
  // destructor drains its queue.
  bool wait(std::chrono::milliseconds timeout) override {
    if (executor_ != nullptr && !c10d::Work::isCompleted() && !executor_->run_until(ticket_)) executor_->wake();
    return c10d::Work::wait(timeout);
  }

  // A caller that polls instead of waiting gets the job started.
  bool isCompleted() override {
    const bool done = c10d::Work::isCompleted();
    if (!done && executor_ != nullptr) executor_->wake();
    return done;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    if (executor_ != nullptr && !c10d::Work::isCompleted()) executor_->wake();  // callbacks need progress
    c10::intrusive_ptr<c10::ivalue::Future> future;
    bool settle_now = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!future_) {
        future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
        settle_now = done_;
      }
      future = future_;
    }
    if (settle_now) settle(*future);
    return future;
  }

 private:
  void settle(c10::ivalue::Future& future) {
    if (error_) {
      future.setError(error_);
    } else {
      future.markCompleted(c10::IValue(outputs_));
    }
  }

  std::vector<at::Tensor> outputs_;
  detail::Executor* executor_ = nullptr;
  uint64_t ticket_ = 0;
  std::exception_ptr error_;  // guarded by mutex_ until done_
  bool done_ = false;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

/// An executor job: runs `run` under a Call for `op` whose deadline starts
/// when the job does, and completes `work` with the outcome.
std::function<void()> completing(c10::intrusive_ptr<ShmWork> work, Comm* comm, const char* op,
                                 std::chrono::milliseconds limit, std::function<void(Comm&, const Call&)> run) {
  return [work = std::move(work), comm, op, limit, run = std::move(run)] {
    Call call;
    call.op = op;
    call.timeout = limit;
    call.deadline = std::chrono::steady_clock::now() + limit;
    std::exception_ptr error;
    try {
      run(*comm, call);
    } catch (...) {
      error = std::current_exception();
    }
    work->complete(error);
  };
}

/// A tensor as the engine sees it: contiguous memory, copied back into the
/// caller's tensor afterwards when that one is not contiguous.
struct Staged {
  at::Tensor user;
  at::Tensor buffer;

  explicit Staged(const at::Tensor& t) : user(t), buffer(t.is_contiguous() ? t : t.contiguous()) {}
  uint8_t* data() const { return static_cast<uint8_t*>(buffer.data_ptr()); }
  int64_t bytes() const { return static_cast<int64_t>(buffer.nbytes()); }
  void finish() const {
    if (!buffer.is_same(user)) user.copy_(buffer);
  }
};

// A non-negative integer from the environment; -1 when unset.
int64_t env_int(const char* name, const char* unit) { return env::get_count(name, unit).value_or(-1); }

int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

ShmOptions resolve(ShmOptions o, int size) {
  int64_t chunk = o.chunk_bytes() > 0 ? o.chunk_bytes() : env_int("COMMGRAD_SHM_CHUNK_BYTES", "bytes");
  if (chunk <= 0) chunk = 256 * 1024;
  o.chunk_bytes(std::max<int64_t>(round_up(chunk, 64), 64 * static_cast<int64_t>(size)));
  int64_t mailbox = o.mailbox_bytes();
  if (mailbox <= 0 && size > 1) {
    mailbox = std::clamp<int64_t>((16 << 20) / (static_cast<int64_t>(size) * (size - 1)), 4096, 1 << 20);
  }
  o.mailbox_bytes(round_up(std::max<int64_t>(mailbox, 64), 64));
  if (o.spin_us() < 0) {
    const int64_t env = env_int("COMMGRAD_SHM_SPIN_US", "microseconds");
    o.spin_us(env >= 0 ? static_cast<int>(env) : (size <= usable_cpus() ? 50 : 0));
  }
  if (o.async_bytes() < 0) {
    const int64_t env = env_int("COMMGRAD_SHM_ASYNC_BYTES", "bytes");
    o.async_bytes(env >= 0 ? env : int64_t{1} << 20);
  }
  if (o.eager_worker() < 0) {
    const int64_t env = env_int("COMMGRAD_SHM_EAGER_WORKER", "0 or 1");
    o.eager_worker(env >= 0 ? (env != 0 ? 1 : 0) : (2 * size <= usable_cpus() ? 1 : 0));
  }
  if (o.group_name().empty()) o.group_name("shm");
  return o;
}

bool is_cpu_dense(const at::Tensor& t) { return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided; }

}  // namespace

// ~~~ construction ~~~

ShmProcessGroup::ShmProcessGroup(const commgrad::detail::StorePtr& store, int rank, int size, ShmOptions options)
    : commgrad::detail::TransportBase(rank, size), options_(resolve(std::move(options), size)) {
  TORCH_CHECK(store, "[commgrad] shm: ShmProcessGroup needs a store");
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "[commgrad] shm group '", options_.group_name(),
              "': rank ", rank, " is outside [0, ", size, ")");
  const std::string context = c10::str("rank ", rank, "/", size, " group '", options_.group_name(), "' (shm)");
  detail::SegmentConfig config;
  config.store = store;
  config.rank = rank;
  config.size = size;
  config.chunk_bytes = static_cast<uint64_t>(options_.chunk_bytes());
  config.mailbox_bytes = static_cast<uint64_t>(options_.mailbox_bytes());
  config.timeout = options_.timeout();
  config.context = context;
  auto segment = std::make_unique<detail::Segment>(config);
  detail::WaitPolicy policy;
  policy.max_spin_ns = static_cast<int64_t>(options_.spin_us()) * 1000;
  if (size > usable_cpus()) policy.max_yield_ns = 50 * 1000;
  comm_ = std::make_unique<Comm>(std::move(segment), rank, size, context, policy);
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
  collectives_.reset();
}

std::string ShmProcessGroup::segment_name() const { return comm_->segment().name(); }
int64_t ShmProcessGroup::segment_bytes() const {
  return static_cast<int64_t>(comm_->segment().layout().total_bytes);
}
std::string ShmProcessGroup::describe() const { return comm_->context(); }

std::chrono::milliseconds ShmProcessGroup::timeout_of(std::chrono::milliseconds requested) const {
  return requested.count() > 0 ? requested : options_.timeout();
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::submit_collective(const char* op, c10d::OpType type,
                                                                  std::vector<at::Tensor> outputs, int64_t bytes,
                                                                  std::chrono::milliseconds timeout, Job job) {
  auto work = c10::make_intrusive<ShmWork>(getRank(), type, std::move(outputs));
  const uint64_t ticket = collectives_->submit(completing(work, comm_.get(), op, timeout_of(timeout), std::move(job.run)),
                                               bytes < options_.async_bytes());
  if (ticket != 0) work->queued_in(collectives_.get(), ticket);
  return work;
}

void ShmProcessGroup::reject(const char* op, int kind, const std::string& message) {
  Comm* comm = comm_.get();
  const auto limit = options_.timeout();
  collectives_->submit(
      [comm, op, kind, limit, message] {
        Call call;
        call.op = op;
        call.timeout = limit;
        call.deadline = std::chrono::steady_clock::now() + limit;
        try {
          comm->reject(call, static_cast<OpKind>(kind), message);
        } catch (...) {
          // This rank already reported the problem to its caller.
        }
      },
      false);
  TORCH_CHECK(false, "[commgrad] ", op, " ", comm_->context(), ": ", message);
}

detail::Executor& ShmProcessGroup::peer_executor(bool sending, int peer) {
  std::lock_guard<std::mutex> lock(peers_mutex_);
  auto& slot = sending ? senders_[peer] : receivers_[peer];
  if (!slot) slot = std::make_unique<detail::Executor>();
  return *slot;
}

// ~~~ argument checks ~~~

#define SHM_REQUIRE(cond, ...)                                   \
  do {                                                           \
    if (!(cond)) reject(op, static_cast<int>(kind), c10::str(__VA_ARGS__)); \
  } while (0)

namespace {

RedOp to_red_op(const c10d::ReduceOp& op, bool* ok) {
  *ok = true;
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return RedOp::kSum;
    case c10d::ReduceOp::AVG: return RedOp::kAvg;
    case c10d::ReduceOp::PRODUCT: return RedOp::kProduct;
    case c10d::ReduceOp::MIN: return RedOp::kMin;
    case c10d::ReduceOp::MAX: return RedOp::kMax;
    case c10d::ReduceOp::BAND: return RedOp::kBand;
    case c10d::ReduceOp::BOR: return RedOp::kBor;
    case c10d::ReduceOp::BXOR: return RedOp::kBxor;
    default: *ok = false; return RedOp::kSum;
  }
}

}  // namespace

// Shared checks, as lambdas-in-macros would obscure: each op spells out its own.
#define SHM_CHECK_TENSOR(t, what)                                                                         \
  SHM_REQUIRE(is_cpu_dense(t), what, " must be a defined CPU tensor with strided layout, got ",          \
              (t).defined() ? c10::str((t).device(), " ", (t).layout()) : std::string("an undefined tensor"))

#define SHM_CHECK_REDUCTION(red_out, reduce_op, dtype)                                                     \
  do {                                                                                                    \
    bool known_ = false;                                                                                  \
    red_out = to_red_op(reduce_op, &known_);                                                              \
    SHM_REQUIRE(known_, "reduce op ", static_cast<int>((reduce_op).op_),                                  \
                " is not supported by shm (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR are)");           \
    std::string why_;                                                                                     \
    SHM_REQUIRE(detail::reduction_supported(dtype, red_out, &why_), why_);                                \
  } while (0)

// ~~~ collectives ~~~

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  const char* op = "allreduce";
  const OpKind kind = OpKind::kAllreduce;
  SHM_REQUIRE(tensors.size() == 1, "expects exactly one tensor per call, got ", tensors.size());
  SHM_CHECK_TENSOR(tensors[0], "the tensor");
  RedOp red;
  SHM_CHECK_REDUCTION(red, opts.reduceOp, tensors[0].scalar_type());
  const Staged s(tensors[0]);
  return submit_collective(op, c10d::OpType::ALLREDUCE, tensors, s.bytes(), opts.timeout,
                           Job{[s, red](Comm& c, const Call& call) {
                             c.allreduce(call, s.data(), s.data(), s.buffer.numel(), s.buffer.scalar_type(), red);
                             s.finish();
                           }});
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::submit_reduce_out(const char* op, int kind, const at::Tensor& input,
                                                                  const at::Tensor& output,
                                                                  const c10d::ReduceOp& reduce_op,
                                                                  std::chrono::milliseconds timeout, int root) {
  SHM_CHECK_TENSOR(input, "the input");
  SHM_CHECK_TENSOR(output, "the output");
  SHM_REQUIRE(input.is_contiguous() && output.is_contiguous(), "the out-of-place form needs contiguous tensors");
  SHM_REQUIRE(input.scalar_type() == output.scalar_type() && input.numel() == output.numel(),
              "input ", input.scalar_type(), input.sizes(), " and output ", output.scalar_type(), output.sizes(),
              " differ in dtype or number of elements");
  const auto* in_begin = static_cast<const uint8_t*>(input.data_ptr());
  const auto* out_begin = static_cast<const uint8_t*>(output.data_ptr());
  SHM_REQUIRE(in_begin == out_begin || in_begin + input.nbytes() <= out_begin || out_begin + output.nbytes() <= in_begin,
              "input and output overlap");
  RedOp red;
  SHM_CHECK_REDUCTION(red, reduce_op, input.scalar_type());
  const auto type = root < 0 ? c10d::OpType::ALLREDUCE : c10d::OpType::REDUCE;
  return submit_collective(op, type, {output}, static_cast<int64_t>(output.nbytes()), timeout,
                           Job{[input, output, red, root](Comm& c, const Call& call) {
                             c.reduce(call, input.data_ptr(), output.data_ptr(), output.numel(),
                                      output.scalar_type(), red, root);
                           }});
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allreduce_out(const at::Tensor& input, const at::Tensor& output,
                                                              const c10d::AllreduceOptions& opts) {
  return submit_reduce_out("allreduce", static_cast<int>(OpKind::kAllreduce), input, output, opts.reduceOp,
                           opts.timeout, /*root=*/-1);
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::reduce_out(const at::Tensor& input, const at::Tensor& output,
                                                           const c10d::ReduceOptions& opts) {
  const char* op = "reduce";
  const OpKind kind = OpKind::kReduce;
  SHM_REQUIRE(opts.rootRank >= 0 && opts.rootRank < getSize(), "root rank ", opts.rootRank, " is outside [0, ",
              getSize(), ")");
  return submit_reduce_out(op, static_cast<int>(kind), input, output, opts.reduceOp, opts.timeout,
                           static_cast<int>(opts.rootRank));
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                    const c10d::AllreduceCoalescedOptions& opts) {
  const char* op = "allreduce_coalesced";
  const OpKind kind = OpKind::kAllreduce;
  SHM_REQUIRE(!tensors.empty(), "expects at least one tensor");
  std::vector<Staged> staged;
  RedOp red = RedOp::kSum;
  int64_t bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    SHM_CHECK_TENSOR(tensors[i], "tensor " + std::to_string(i));
    SHM_CHECK_REDUCTION(red, opts.reduceOp, tensors[i].scalar_type());
    staged.emplace_back(tensors[i]);
    bytes += staged.back().bytes();
  }
  return submit_collective(op, c10d::OpType::ALLREDUCE_COALESCED, tensors, bytes, opts.timeout,
                           Job{[staged, red](Comm& c, const Call& call) {
                             for (const Staged& s : staged) {
                               c.allreduce(call, s.data(), s.data(), s.buffer.numel(), s.buffer.scalar_type(), red);
                               s.finish();
                             }
                           }});
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  const char* op = "reduce";
  const OpKind kind = OpKind::kReduce;
  SHM_REQUIRE(tensors.size() == 1, "expects exactly one tensor per call, got ", tensors.size());
  SHM_REQUIRE(opts.rootRank >= 0 && opts.rootRank < getSize(), "root rank ", opts.rootRank, " is outside [0, ",
              getSize(), ")");
  SHM_REQUIRE(opts.rootTensor == 0, "root tensor ", opts.rootTensor, " must be 0 (one tensor per call)");
  SHM_CHECK_TENSOR(tensors[0], "the tensor");
  RedOp red;
  SHM_CHECK_REDUCTION(red, opts.reduceOp, tensors[0].scalar_type());
  const Staged s(tensors[0]);
  const int root = static_cast<int>(opts.rootRank);
  return submit_collective(op, c10d::OpType::REDUCE, tensors, s.bytes(), opts.timeout,
                           Job{[s, red, root](Comm& c, const Call& call) {
                             c.reduce(call, s.data(), s.data(), s.buffer.numel(), s.buffer.scalar_type(), red, root);
                             if (c.rank() == root) s.finish();
                           }});
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  const char* op = "broadcast";
  const OpKind kind = OpKind::kBroadcast;
  SHM_REQUIRE(tensors.size() == 1, "expects exactly one tensor per call, got ", tensors.size());
  SHM_REQUIRE(opts.rootRank >= 0 && opts.rootRank < getSize(), "root rank ", opts.rootRank, " is outside [0, ",
              getSize(), ")");
  SHM_REQUIRE(opts.rootTensor == 0, "root tensor ", opts.rootTensor, " must be 0 (one tensor per call)");
  SHM_CHECK_TENSOR(tensors[0], "the tensor");
  const Staged s(tensors[0]);
  const int root = static_cast<int>(opts.rootRank);
  return submit_collective(op, c10d::OpType::BROADCAST, tensors, s.bytes(), opts.timeout,
                           Job{[s, root](Comm& c, const Call& call) {
                             c.broadcast(call, s.data(), s.bytes(), s.buffer.scalar_type(), root);
                             if (c.rank() != root) s.finish();
                           }});
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  const char* op = "allgather";
  const OpKind kind = OpKind::kAllgather;
  SHM_REQUIRE(inputs.size() == 1, "expects exactly one input tensor, got ", inputs.size());
  SHM_REQUIRE(outputs.size() == 1, "expects one list of output tensors, got ", outputs.size());
  SHM_REQUIRE(static_cast<int>(outputs[0].size()) == getSize(), "expects ", getSize(),
              " output tensors (one per rank), got ", outputs[0].size());
  SHM_CHECK_TENSOR(inputs[0], "the input");
  const auto dtype = inputs[0].scalar_type();
  std::vector<Staged> outs;
  for (int q = 0; q < getSize(); ++q) {
    const at::Tensor& t = outputs[0][q];
    SHM_CHECK_TENSOR(t, "output " + std::to_string(q));
    SHM_REQUIRE(t.scalar_type() == dtype, "output ", q, " has dtype ", t.scalar_type(), ", the input ", dtype);
    outs.emplace_back(t);
  }
  SHM_REQUIRE(outputs[0][getRank()].numel() == inputs[0].numel(), "output ", getRank(), " (this rank's) has ",
              outputs[0][getRank()].numel(), " elements, the input ", inputs[0].numel());
  const Staged in(inputs[0]);
  return submit_collective(op, c10d::OpType::ALLGATHER, outputs[0], in.bytes() * getSize(), opts.timeout,
                           Job{[in, outs, dtype](Comm& c, const Call& call) {
                             std::vector<void*> ptrs;
                             std::vector<int64_t> sizes;
                             for (const Staged& o : outs) {
                               ptrs.push_back(o.data());
                               sizes.push_back(o.bytes());
                             }
                             c.allgather(call, in.data(), in.bytes(), ptrs.data(), sizes.data(), dtype, -1);
                             for (const Staged& o : outs) o.finish();
                           }});
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::AllgatherOptions& opts) {
  const char* op = "_allgather_base";
  const OpKind kind = OpKind::kAllgather;
  SHM_CHECK_TENSOR(input, "the input");
  SHM_CHECK_TENSOR(output, "the output");
  SHM_REQUIRE(output.scalar_type() == input.scalar_type(), "output dtype ", output.scalar_type(),
              " differs from input dtype ", input.scalar_type());
  SHM_REQUIRE(output.numel() == input.numel() * getSize(), "output has ", output.numel(),
              " elements; expected world size x input = ", getSize(), " x ", input.numel(), " (input ",
              input.sizes(), ", output ", output.sizes(), ")");
  const Staged in(input);
  const Staged out(output);
  return submit_collective(op, c10d::OpType::_ALLGATHER_BASE, {output}, out.bytes(), opts.timeout,
                           Job{[in, out](Comm& c, const Call& call) {
                             std::vector<void*> ptrs;
                             std::vector<int64_t> sizes(c.size(), in.bytes());
                             for (int q = 0; q < c.size(); ++q) ptrs.push_back(out.data() + q * in.bytes());
                             c.allgather(call, in.data(), in.bytes(), ptrs.data(), sizes.data(),
                                         in.buffer.scalar_type(), -1);
                             out.finish();
                           }});
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::GatherOptions& opts) {
  const char* op = "gather";
  const OpKind kind = OpKind::kGather;
  SHM_REQUIRE(opts.rootRank >= 0 && opts.rootRank < getSize(), "root rank ", opts.rootRank, " is outside [0, ",
              getSize(), ")");
  SHM_REQUIRE(inputs.size() == 1, "expects exactly one input tensor, got ", inputs.size());
  SHM_CHECK_TENSOR(inputs[0], "the input");
  const int root = static_cast<int>(opts.rootRank);
  const auto dtype = inputs[0].scalar_type();
  std::vector<Staged> outs;
  if (getRank() == root) {
    SHM_REQUIRE(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(), "the root expects ",
                getSize(), " output tensors (one per rank) in one list");
    for (int q = 0; q < getSize(); ++q) {
      const at::Tensor& t = outputs[0][q];
      SHM_CHECK_TENSOR(t, "output " + std::to_string(q));
      SHM_REQUIRE(t.scalar_type() == dtype, "output ", q, " has dtype ", t.scalar_type(), ", the input ", dtype);
      outs.emplace_back(t);
    }
    SHM_REQUIRE(outputs[0][root].numel() == inputs[0].numel(), "output ", root, " (the root's) has ",
                outputs[0][root].numel(), " elements, the input ", inputs[0].numel());
  } else {
    SHM_REQUIRE(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                "a non-root rank takes no output tensors (root is ", root, ")");
  }
  const Staged in(inputs[0]);
  std::vector<at::Tensor> results = getRank() == root ? outputs[0] : std::vector<at::Tensor>{};
  return submit_collective(op, c10d::OpType::GATHER, results, in.bytes(), opts.timeout,
                           Job{[in, outs, dtype, root](Comm& c, const Call& call) {
                             std::vector<void*> ptrs;
                             std::vector<int64_t> sizes;
                             for (const Staged& o : outs) {
                               ptrs.push_back(o.data());
                               sizes.push_back(o.bytes());
                             }
                             c.allgather(call, in.data(), in.bytes(), outs.empty() ? nullptr : ptrs.data(),
                                         outs.empty() ? nullptr : sizes.data(), dtype, root);
                             for (const Staged& o : outs) o.finish();
                           }});
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::scatter(std::vector<at::Tensor>& outputs,
                                                        std::vector<std::vector<at::Tensor>>& inputs,
                                                        const c10d::ScatterOptions& opts) {
  const char* op = "scatter";
  const OpKind kind = OpKind::kScatter;
  SHM_REQUIRE(opts.rootRank >= 0 && opts.rootRank < getSize(), "root rank ", opts.rootRank, " is outside [0, ",
              getSize(), ")");
  SHM_REQUIRE(outputs.size() == 1, "expects exactly one output tensor, got ", outputs.size());
  SHM_CHECK_TENSOR(outputs[0], "the output");
  const int root = static_cast<int>(opts.rootRank);
  const auto dtype = outputs[0].scalar_type();
  std::vector<Staged> ins;
  if (getRank() == root) {
    SHM_REQUIRE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(), "the root expects ",
                getSize(), " input tensors (one per rank) in one list");
    for (int q = 0; q < getSize(); ++q) {
      const at::Tensor& t = inputs[0][q];
      SHM_CHECK_TENSOR(t, "input " + std::to_string(q));
      SHM_REQUIRE(t.scalar_type() == dtype, "input ", q, " has dtype ", t.scalar_type(), ", the output ", dtype);
      ins.emplace_back(t);
    }
  } else {
    SHM_REQUIRE(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                "a non-root rank takes no input tensors (root is ", root, ")");
  }
  const Staged out(outputs[0]);
  return submit_collective(op, c10d::OpType::SCATTER, outputs, out.bytes(), opts.timeout,
                           Job{[ins, out, dtype, root](Comm& c, const Call& call) {
                             std::vector<const void*> ptrs;
                             std::vector<int64_t> sizes;
                             for (const Staged& i : ins) {
                               ptrs.push_back(i.data());
                               sizes.push_back(i.bytes());
                             }
                             c.scatter(call, ins.empty() ? nullptr : ptrs.data(), ins.empty() ? nullptr : sizes.data(),
                                       out.data(), out.bytes(), dtype, root);
                             out.finish();
                           }});
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                               std::vector<std::vector<at::Tensor>>& inputs,
                                                               const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter";
  const OpKind kind = OpKind::kReduceScatter;
  SHM_REQUIRE(outputs.size() == 1, "expects exactly one output tensor, got ", outputs.size());
  SHM_REQUIRE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(), "expects ", getSize(),
              " input tensors (one per rank) in one list");
  SHM_CHECK_TENSOR(outputs[0], "the output");
  const auto dtype = outputs[0].scalar_type();
  RedOp red;
  SHM_CHECK_REDUCTION(red, opts.reduceOp, dtype);
  std::vector<Staged> ins;
  for (int q = 0; q < getSize(); ++q) {
    const at::Tensor& t = inputs[0][q];
    SHM_CHECK_TENSOR(t, "input " + std::to_string(q));
    SHM_REQUIRE(t.scalar_type() == dtype, "input ", q, " has dtype ", t.scalar_type(), ", the output ", dtype);
    SHM_REQUIRE(t.numel() == outputs[0].numel(), "input ", q, " has ", t.numel(), " elements, the output ",
                outputs[0].numel(), " (all must be equal)");
    ins.emplace_back(t);
  }
  const Staged out(outputs[0]);
  return submit_collective(op, c10d::OpType::REDUCE_SCATTER, outputs, out.bytes() * getSize(), opts.timeout,
                           Job{[ins, out, red](Comm& c, const Call& call) {
                             std::vector<const void*> ptrs;
                             for (const Staged& i : ins) ptrs.push_back(i.data());
                             c.reduce_scatter(call, ptrs.data(), out.data(), out.buffer.numel(),
                                              out.buffer.scalar_type(), red);
                             out.finish();
                           }});
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                     const c10d::ReduceScatterOptions& opts) {
  const char* op = "_reduce_scatter_base";
  const OpKind kind = OpKind::kReduceScatter;
  SHM_CHECK_TENSOR(input, "the input");
  SHM_CHECK_TENSOR(output, "the output");
  SHM_REQUIRE(output.scalar_type() == input.scalar_type(), "output dtype ", output.scalar_type(),
              " differs from input dtype ", input.scalar_type());
  SHM_REQUIRE(input.numel() == output.numel() * getSize(), "input has ", input.numel(),
              " elements; expected world size x output = ", getSize(), " x ", output.numel(), " (input ",
              input.sizes(), ", output ", output.sizes(), ")");
  RedOp red;
  SHM_CHECK_REDUCTION(red, opts.reduceOp, input.scalar_type());
  const Staged in(input);
  const Staged out(output);
  return submit_collective(op, c10d::OpType::_REDUCE_SCATTER_BASE, {output}, in.bytes(), opts.timeout,
                           Job{[in, out, red](Comm& c, const Call& call) {
                             std::vector<const void*> ptrs;
                             for (int q = 0; q < c.size(); ++q) ptrs.push_back(in.data() + q * out.bytes());
                             c.reduce_scatter(call, ptrs.data(), out.data(), out.buffer.numel(),
                                              out.buffer.scalar_type(), red);
                             out.finish();
                           }});
}

namespace {

// Byte offset and size of each piece of an alltoall_base tensor split along dim 0.
bool split_pieces(const at::Tensor& t, const std::vector<int64_t>& splits, int size, std::vector<int64_t>* offsets,
                  std::vector<int64_t>* bytes, std::string* why) {
  if (t.dim() == 0) {
    *why = "needs tensors with at least one dimension";
    return false;
  }
  const int64_t rows = t.size(0);
  const int64_t row_bytes = rows == 0 ? 0 : static_cast<int64_t>(t.nbytes()) / rows;
  std::vector<int64_t> counts = splits;
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
      *why = c10::str("has a negative split size in ", counts);
      return false;
    }
    sum += c;
  }
  if (sum != rows) {
    *why = c10::str("split sizes ", counts, " add up to ", sum, ", but dim 0 of ", t.sizes(), " is ", rows);
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
  const char* op = "alltoall_base";
  const OpKind kind = OpKind::kAlltoall;
  SHM_CHECK_TENSOR(input, "the input");
  SHM_CHECK_TENSOR(output, "the output");
  SHM_REQUIRE(output.scalar_type() == input.scalar_type(), "output dtype ", output.scalar_type(),
              " differs from input dtype ", input.scalar_type());
  std::vector<int64_t> in_off, in_bytes, out_off, out_bytes;
  std::string why;
  SHM_REQUIRE(split_pieces(input, input_split_sizes, getSize(), &in_off, &in_bytes, &why), "the input ", why);
  SHM_REQUIRE(split_pieces(output, output_split_sizes, getSize(), &out_off, &out_bytes, &why), "the output ", why);
  const Staged in(input);
  const Staged out(output);
  return submit_collective(op, c10d::OpType::ALLTOALL_BASE, {output}, in.bytes(), opts.timeout,
                           Job{[in, out, in_off, in_bytes, out_off, out_bytes](Comm& c, const Call& call) {
                             std::vector<const void*> ins;
                             std::vector<void*> outs;
                             for (int q = 0; q < c.size(); ++q) {
                               ins.push_back(in.data() + in_off[q]);
                               outs.push_back(out.data() + out_off[q]);
                             }
                             c.alltoall(call, ins.data(), in_bytes.data(), outs.data(), out_bytes.data(),
                                        in.buffer.scalar_type());
                             out.finish();
                           }});
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::alltoall(std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  const char* op = "alltoall";
  const OpKind kind = OpKind::kAlltoall;
  SHM_REQUIRE(static_cast<int>(inputs.size()) == getSize() && static_cast<int>(outputs.size()) == getSize(),
              "expects ", getSize(), " input and output tensors (one per rank), got ", inputs.size(), " and ",
              outputs.size());
  SHM_CHECK_TENSOR(inputs[0], "input 0");
  const auto dtype = inputs[0].scalar_type();
  std::vector<Staged> ins, outs;
  int64_t bytes = 0;
  for (int q = 0; q < getSize(); ++q) {
    SHM_CHECK_TENSOR(inputs[q], "input " + std::to_string(q));
    SHM_CHECK_TENSOR(outputs[q], "output " + std::to_string(q));
    SHM_REQUIRE(inputs[q].scalar_type() == dtype && outputs[q].scalar_type() == dtype,
                "every input and output must have dtype ", dtype, "; input ", q, " has ", inputs[q].scalar_type(),
                ", output ", q, " has ", outputs[q].scalar_type());
    ins.emplace_back(inputs[q]);
    outs.emplace_back(outputs[q]);
    bytes += ins.back().bytes();
  }
  SHM_REQUIRE(inputs[getRank()].numel() == outputs[getRank()].numel(), "input ", getRank(), " has ",
              inputs[getRank()].numel(), " elements but output ", getRank(), " (this rank's own piece) has ",
              outputs[getRank()].numel());
  return submit_collective(op, c10d::OpType::ALLTOALL, outputs, bytes, opts.timeout,
                           Job{[ins, outs, dtype](Comm& c, const Call& call) {
                             std::vector<const void*> in_ptrs;
                             std::vector<void*> out_ptrs;
                             std::vector<int64_t> in_bytes, out_bytes;
                             for (int q = 0; q < c.size(); ++q) {
                               in_ptrs.push_back(ins[q].data());
                               in_bytes.push_back(ins[q].bytes());
                               out_ptrs.push_back(outs[q].data());
                               out_bytes.push_back(outs[q].bytes());
                             }
                             c.alltoall(call, in_ptrs.data(), in_bytes.data(), out_ptrs.data(), out_bytes.data(),
                                        dtype);
                             for (const Staged& o : outs) o.finish();
                           }});
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::barrier(const c10d::BarrierOptions& opts) {
  return submit_collective("barrier", c10d::OpType::BARRIER, {}, 0, opts.timeout,
                           Job{[](Comm& c, const Call& call) { c.barrier(call); }});
}

// ~~~ point to point ~~~

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  const Staged s(p2p_tensor("send", tensors, dst_rank, "destination"));
  auto work = c10::make_intrusive<ShmWork>(getRank(), c10d::OpType::SEND, std::vector<at::Tensor>{});
  peer_executor(true, dst_rank)
      .submit(completing(work, comm_.get(), "send", options_.timeout(),
                         [s, dst_rank, tag](Comm& c, const Call& call) {
                           c.send(call, dst_rank, tag, s.data(), s.bytes(), s.buffer.scalar_type());
                         }),
              comm_->send_fits(dst_rank, s.bytes()));
  return work;
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  const Staged s(p2p_tensor("recv", tensors, src_rank, "source"));
  auto work = c10::make_intrusive<ShmWork>(getRank(), c10d::OpType::RECV, tensors);
  peer_executor(false, src_rank)
      .submit(completing(work, comm_.get(), "recv", options_.timeout(),
                         [s, src_rank, tag](Comm& c, const Call& call) {
                           c.recv(call, src_rank, tag, s.data(), s.bytes(), s.buffer.scalar_type());
                           s.finish();
                         }),
              comm_->recv_ready(src_rank, s.bytes()));
  return work;
}

const at::Tensor& ShmProcessGroup::p2p_tensor(const char* op, const std::vector<at::Tensor>& tensors, int peer,
                                              const char* role) const {
  const std::string where = c10::str("[commgrad] ", op, " ", comm_->context(), ": ");
  TORCH_CHECK(tensors.size() == 1, where, "expects exactly one tensor per call, got ", tensors.size());
  TORCH_CHECK(peer >= 0 && peer < getSize() && peer != getRank(), where, role, " rank ", peer,
              " must be another rank of the group [0, ", getSize(), ")");
  TORCH_CHECK(is_cpu_dense(tensors[0]), where, "the tensor must be a defined CPU tensor with strided layout");
  return tensors[0];
}

}  // namespace commgrad::backend
