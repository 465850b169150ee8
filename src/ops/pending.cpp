// The machinery under every commgrad::ops call: in-flight collectives
// (raw::Pending, AsyncTensor), argument checks shared by the ops, the
// mapping of dtypes onto the transport, and the debug-mode fingerprint.
//
// Debug fingerprint. Each rank encodes its call as a fixed-size int64 record
// (sequence number, a text signature such as "all_reduce(float32[4, 3],
// op=sum)", and up to two per-rank lists such as all_to_all's splits); the
// group all-gathers the records with one small transport all_gather and
// every rank compares all of them. Because every rank sees every record,
// every rank raises the same mismatch, naming itself and the first rank that
// disagrees, before any mismatched collective reaches the transport (where
// Gloo would fail with "Connection closed by peer" or a timeout and leave the
// group unusable). The record size depends only on the group size, so the
// exchange itself can never mismatch. Point-to-point calls cannot use a
// collective; their two sides swap a small header instead.
//
// Aborts. Some transport failures cannot be caught: Gloo enforces in its I/O
// thread that a peer sends no more bytes than this rank posted, and the
// uncaught exception terminates the process. The last collective this
// process started is remembered (before it reaches the transport), and a
// terminate handler (installed with the first collective) names it and the
// likely cause before the process ends.

#include "detail/common.h"

#include "commgrad/ops/async.h"
#include "commgrad/ops/debug.h"
#include "commgrad/dist/process_group.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <memory>
#include <mutex>
#include <strings.h>

namespace commgrad {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kProduct: return "product";
  }
  return "?";
}

namespace ops {
namespace {

// -1: follow COMMGRAD_DEBUG; 0/1: set by set_debug_checks().
std::atomic<int> g_debug_override{-1};

bool debug_from_env() {
  const char* v = std::getenv("COMMGRAD_DEBUG");
  if (v == nullptr) return false;
  return std::strcmp(v, "1") == 0 || strcasecmp(v, "CHECK") == 0 || strcasecmp(v, "TRACE") == 0;
}

std::string message_of(const std::exception& e) {
  if (const auto* c10e = dynamic_cast<const c10::Error*>(&e)) return c10e->what_without_backtrace();
  return e.what();
}

bool looks_like_timeout(const std::string& m) {
  return m.find("imed out") != std::string::npos || m.find("imeout") != std::string::npos;
}

}  // namespace

bool debug_checks() {
  const int o = g_debug_override.load();
  if (o >= 0) return o == 1;
  static const bool from_env = debug_from_env();
  return from_env;
}

void set_debug_checks(std::optional<bool> enabled) { g_debug_override.store(enabled ? (*enabled ? 1 : 0) : -1); }

// ~~~ Pending, AsyncTensor ~~~

namespace raw {

bool Pending::is_completed() const {
  TORCH_CHECK(state_, "[commgrad] is_completed() on an empty Pending");
  if (state_->done) return true;
  for (const auto& w : state_->works) {
    if (!w->isCompleted()) return false;
  }
  return true;
}

at::Tensor Pending::wait() {
  TORCH_CHECK(state_, "[commgrad] wait() on an empty Pending");
  auto& s = *state_;
  TORCH_CHECK(s.error.empty(), s.error);
  if (s.done) return s.result;
  for (auto& w : s.works) {
    try {
      commgrad::detail::wait_work(w);
    } catch (const std::exception& e) {
      const std::string what = message_of(e);
      const bool timeout = looks_like_timeout(what);
      s.error = c10::str("[commgrad] ", s.op, " ", s.group.describe(), ": collective #", s.sequence,
                         timeout ? c10::str(" did not complete within the group timeout (",
                                            s.group.timeout().count() / 1000.0, "s)")
                                 : std::string(" failed"),
                         ": ", what,
                         " -- a peer may have failed, be late, or have called a different collective (set "
                         "COMMGRAD_DEBUG=1 on every rank to check each collective across ranks); this group "
                         "cannot be used any more");
      s.works.clear();
      s.finish = nullptr;
      if (timeout) commgrad::detail::throw_timeout_error(s.error);
      commgrad::detail::throw_dist_error(s.error);
    }
  }
  s.works.clear();
  if (s.finish) {
    s.result = s.finish();
    s.finish = nullptr;
  }
  s.done = true;
  return s.result;
}

Group resolve_group(const Group& group) { return group.defined() ? group : world(); }

}  // namespace raw

struct AsyncTensor::State {
  raw::Pending pending;
  Finish finish;
  at::Tensor result;
  bool done = false;
};

AsyncTensor::AsyncTensor(raw::Pending pending, Finish finish) : state_(std::make_shared<State>()) {
  state_->pending = std::move(pending);
  state_->finish = std::move(finish);
}

bool AsyncTensor::is_completed() const {
  TORCH_CHECK(state_, "[commgrad] is_completed() on an empty AsyncTensor");
  return state_->done || state_->pending.is_completed();
}

at::Tensor AsyncTensor::wait() {
  TORCH_CHECK(state_, "[commgrad] wait() on an empty AsyncTensor");
  if (!state_->done) {
    state_->result = state_->finish ? state_->finish(state_->pending) : state_->pending.wait();
    state_->finish = nullptr;
    state_->done = true;
  }
  return state_->result;
}

namespace detail {

// ~~~ Call ~~~

Call::Call(const char* op_name, const Group& g) : op(op_name), group(raw::resolve_group(g)) {
  check_member(op, group);
  rank = group.rank();
  size = group.size();
}

raw::Pending Call::ready(at::Tensor result) const {
  auto s = std::make_shared<PendingState>();
  s->op = op;
  s->group = group;
  s->sequence = sequence;
  s->result = std::move(result);
  s->done = true;
  return raw::Pending(std::move(s));
}

namespace {

// The last collective this process started (see "Aborts" at the top).
struct Started {
  const char* op = nullptr;
  uint64_t sequence = 0;
  std::weak_ptr<commgrad::detail::GroupState> group;  // not kept alive by this record
};
std::mutex g_started_mutex;
Started g_started;
std::terminate_handler g_previous_terminate = nullptr;

// Names the last collective started when the process is terminated (by an
// exception nobody could catch, e.g. in a transport's I/O thread), then lets
// the previous handler print the exception and abort.
[[noreturn]] void terminate_with_context() {
  std::string what = "an uncaught exception";
  if (const auto e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      what = ex.what();
    } catch (...) {
    }
  }
  Started last;
  if (g_started_mutex.try_lock()) {
    last = g_started;
    g_started_mutex.unlock();
  }
  if (last.op != nullptr) {
    const auto state = last.group.lock();
    std::cerr << "[commgrad] " << last.op << " " << (state ? Group(state).describe() : std::string("(group gone)"))
              << ": the process is terminating (" << what << "); the last collective it started is #"
              << last.sequence;
    if (what.find("op.preamble.length <= op.nbytes") != std::string::npos) {
      std::cerr << ". Gloo aborts like this when another rank called a collective with more data than this rank; "
                   "set COMMGRAD_DEBUG=1 on every rank to check each collective across ranks and raise an error on "
                   "all of them instead";
    }
    std::cerr << std::endl;
  }
  if (g_previous_terminate != nullptr) g_previous_terminate();
  std::abort();
}

}  // namespace

void Call::start() {
  sequence = group.next_sequence();
  static std::once_flag installed;
  std::call_once(installed, [] { g_previous_terminate = std::set_terminate(terminate_with_context); });
  std::lock_guard<std::mutex> lock(g_started_mutex);
  g_started.op = op;
  g_started.sequence = sequence;
  g_started.group = group.state();
}

raw::Pending Call::pending(std::vector<commgrad::detail::WorkPtr> works, std::function<at::Tensor()> finish) const {
  auto s = std::make_shared<PendingState>();
  s->op = op;
  s->group = group;
  s->sequence = sequence;
  s->works = std::move(works);
  s->finish = std::move(finish);
  return raw::Pending(std::move(s));
}

// ~~~ checks ~~~

namespace {

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kBool: return "bool";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    default: return c10::toString(t);
  }
}

std::string describe_sizes(at::IntArrayRef sizes, int64_t wild_dim) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0) s += ", ";
    s += static_cast<int64_t>(i) == wild_dim ? std::string("*") : std::to_string(sizes[i]);
  }
  return s + "]";
}

}  // namespace

std::string describe_tensor(const at::Tensor& x, int64_t wild_dim) {
  return std::string(dtype_name(x.scalar_type())) + describe_sizes(x.sizes(), wild_dim);
}

void check_tensor(const Call& call, const at::Tensor& x) {
  COMMGRAD_CHECK(x.defined(), call.op, call.group, "got an undefined tensor");
  COMMGRAD_CHECK(x.layout() == at::kStrided, call.op, call.group, "needs a dense (strided) tensor, got layout ",
                 x.layout());
}

int64_t check_dim(const Call& call, const at::Tensor& x, int64_t dim) {
  const int64_t nd = x.dim();
  COMMGRAD_CHECK(nd > 0, call.op, call.group, "dim ", dim, " is out of range: the tensor is a scalar (",
                 describe_tensor(x), "); this op needs at least one dimension");
  COMMGRAD_CHECK(dim >= -nd && dim < nd, call.op, call.group, "dim ", dim, " is out of range for ",
                 describe_tensor(x), " (expected ", -nd, "..", nd - 1, ")");
  return dim < 0 ? dim + nd : dim;
}

void check_peer(const Call& call, const char* what, int peer) {
  COMMGRAD_CHECK(peer >= 0 && peer < call.size, call.op, call.group, what, " ", peer,
                 " is outside the group (group ranks 0..", call.size - 1, "; ", what,
                 " is a rank within the group, not a global rank)");
}

void check_sizes(const Call& call, const char* what, const std::vector<int64_t>& sizes, int64_t total,
                 const at::Tensor& x, int64_t dim) {
  const at::IntArrayRef shown(sizes);
  COMMGRAD_CHECK(static_cast<int>(sizes.size()) == call.size, call.op, call.group, what, " ", shown, " has ",
                 sizes.size(), " entries; expected one per rank (", call.size, ")");
  int64_t sum = 0;
  for (int64_t s : sizes) {
    COMMGRAD_CHECK(s >= 0, call.op, call.group, what, " ", shown, " has a negative entry");
    sum += s;
  }
  COMMGRAD_CHECK(total < 0 || sum == total, call.op, call.group, what, " ", shown, " add up to ", sum,
                 ", but dim ", dim, " of ", describe_tensor(x), " has size ", total);
}

bool wire_native(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

at::Tensor wire(const at::Tensor& t) {
  // Below the view-tracking layer: an autograd view would keep a reference
  // to `t` itself for as long as the transport holds the wire tensor, and
  // a result with a second reference is copied by autograd (AccumulateGrad
  // steals only a gradient nobody else holds).
  at::AutoDispatchBelowADInplaceOrView untracked;
  auto flat = t.view({-1});
  return wire_native(t.scalar_type()) ? flat : flat.view(at::kByte);
}

int64_t wire_scale(at::ScalarType t) { return wire_native(t) ? 1 : static_cast<int64_t>(c10::elementSize(t)); }

at::ScalarType reduce_dtype(const Call& call, at::ScalarType t, ReduceOp op) {
  const bool complex = at::isComplexType(t);
  const bool floating = at::isFloatingType(t);
  COMMGRAD_CHECK(!(op == ReduceOp::kAvg && !floating && !complex), call.op, call.group,
                 "AVG needs a floating-point tensor, got ", dtype_name(t), " (use SUM and divide)");
  COMMGRAD_CHECK(!(complex && op != ReduceOp::kSum && op != ReduceOp::kAvg), call.op, call.group,
                 reduce_op_name(op), " is not defined for complex tensors (", dtype_name(t), ")");
  if (t == at::kHalf || t == at::kBFloat16) return at::kFloat;  // reduced in float32, see docs/benchmarks.md
  if (complex || wire_native(t)) return t;
  COMMGRAD_CHECK(false, call.op, call.group, "reductions of ", dtype_name(t),
                 " tensors are not supported (supported: float16, bfloat16, float32, float64, complex, int8, "
                 "uint8, int32, int64)");
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return c10d::ReduceOp::SUM;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
    case ReduceOp::kProduct: return c10d::ReduceOp::PRODUCT;
  }
  return c10d::ReduceOp::SUM;
}

// ~~~ debug fingerprint ~~~

namespace {

constexpr int64_t kTextWords = 64;  // 512 bytes of signature

struct Record {
  int64_t sequence = 0;
  std::string text;
  std::vector<int64_t> a, b;
};

void wait_or_throw(const Call& call, const commgrad::detail::WorkPtr& work, const char* what) {
  try {
    commgrad::detail::wait_work(work);
  } catch (const std::exception& e) {
    commgrad::detail::throw_dist_error(c10::str("[commgrad] ", call.op, " ", call.group.describe(), ": ", what,
                                                " for collective #", call.sequence, " failed: ", message_of(e)));
  }
}

std::string show(const Record& r) {
  std::string s = c10::str("#", r.sequence, " ", r.text);
  if (!r.a.empty()) s += c10::str(" ", at::IntArrayRef(r.a));
  if (!r.b.empty()) s += c10::str(" -> ", at::IntArrayRef(r.b));
  return s;
}

}  // namespace

void check_fingerprint(const Call& call, const std::string& signature, const std::vector<int64_t>& a,
                       const std::vector<int64_t>& b, CrossCheck cross) {
  if (!debug_checks() || call.size == 1) return;
  const int n = call.size;
  const int64_t words = 3 + kTextWords + 2 * n;
  auto mine = at::zeros({words}, at::kLong);
  int64_t* p = mine.data_ptr<int64_t>();
  const std::string text = signature.substr(0, kTextWords * 8 - 1);
  p[0] = static_cast<int64_t>(call.sequence);
  p[1] = static_cast<int64_t>(a.size());
  p[2] = static_cast<int64_t>(b.size());
  std::memcpy(p + 3, text.data(), text.size());
  std::copy(a.begin(), a.end(), p + 3 + kTextWords);
  std::copy(b.begin(), b.end(), p + 3 + kTextWords + n);

  auto all = at::empty({n, words}, at::kLong);
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < n; ++r) outputs[0].push_back(all[r]);
  std::vector<at::Tensor> inputs{mine};
  wait_or_throw(call, call.group.transport().allgather(outputs, inputs), "the debug fingerprint exchange");

  std::vector<Record> records(n);
  for (int r = 0; r < n; ++r) {
    const int64_t* q = all[r].data_ptr<int64_t>();
    records[r].sequence = q[0];
    const char* chars = reinterpret_cast<const char*>(q + 3);
    records[r].text.assign(chars, strnlen(chars, kTextWords * 8));
    records[r].a.assign(q + 3 + kTextWords, q + 3 + kTextWords + std::min<int64_t>(q[1], n));
    records[r].b.assign(q + 3 + kTextWords + n, q + 3 + kTextWords + n + std::min<int64_t>(q[2], n));
  }
  const Record& me = records[call.rank];
  const char* kHint = " (COMMGRAD_DEBUG check; nothing was sent, the group is still usable)";
  for (int r = 0; r < n; ++r) {
    const Record& other = records[r];
    const bool same = other.sequence == me.sequence && other.text == me.text &&
                      (cross != CrossCheck::kEqualLists || (other.a == me.a && other.b == me.b));
    COMMGRAD_CHECK(same, call.op, call.group, "ranks disagree on collective #", me.sequence, kHint,
                   ": this rank (", call.rank, ") calls ", show(me), "; rank ", r, " calls ", show(other));
  }
  if (cross == CrossCheck::kTransposed) {
    for (int r = 0; r < n; ++r) {
      for (int s = 0; s < n; ++s) {
        const int64_t sent = records[r].a.size() == static_cast<size_t>(n) ? records[r].a[s] : -1;
        const int64_t expected = records[s].b.size() == static_cast<size_t>(n) ? records[s].b[r] : -1;
        COMMGRAD_CHECK(sent == expected, call.op, call.group, "ranks disagree on collective #", me.sequence, kHint,
                       ": rank ", r, " sends ", sent, " to rank ", s, " (input_splits ", at::IntArrayRef(records[r].a),
                       "), but rank ", s, " expects ", expected, " from rank ", r, " (output_splits ",
                       at::IntArrayRef(records[s].b),
                       "); this rank (", call.rank, ") calls ", show(me));
      }
    }
  }
}

void check_p2p_header(const Call& call, int peer, int tag, bool sending, at::IntArrayRef sizes,
                      at::ScalarType dtype, bool requires_grad) {
  if (!debug_checks()) return;
  static constexpr int64_t kMaxDims = 10;
  constexpr int64_t kWords = 6 + kMaxDims;
  auto encode = [&](at::Tensor t) {
    int64_t* p = t.data_ptr<int64_t>();
    p[0] = 0x636f6d6d67726164;  // "commgrad"
    p[1] = sending ? 1 : 0;
    p[2] = tag;
    p[3] = static_cast<int64_t>(dtype);
    p[4] = requires_grad ? 1 : 0;
    p[5] = static_cast<int64_t>(sizes.size());
    for (int64_t i = 0; i < std::min<int64_t>(kMaxDims, sizes.size()); ++i) p[6 + i] = sizes[i];
  };
  auto describe = [&](const int64_t* p) {
    std::vector<int64_t> dims(p + 6, p + 6 + std::min<int64_t>(kMaxDims, std::max<int64_t>(0, p[5])));
    return c10::str(p[1] ? "sends " : "receives ", dtype_name(static_cast<at::ScalarType>(p[3])),
                    describe_sizes(dims, -1), " (tag ", p[2], ", requires_grad=", p[4] ? "true" : "false", ")");
  };
  auto mine = at::zeros({kWords}, at::kLong);
  encode(mine);
  auto theirs = at::zeros({kWords}, at::kLong);
  std::vector<at::Tensor> out{mine}, in{theirs};
  auto& transport = call.group.transport();
  auto sent = transport.send(out, peer, kHeaderTagBase);
  wait_or_throw(call, transport.recv(in, peer, kHeaderTagBase), "the debug header exchange");
  wait_or_throw(call, sent, "the debug header exchange");
  const int64_t* m = mine.data_ptr<int64_t>();
  const int64_t* t = theirs.data_ptr<int64_t>();
  const bool ok = t[0] == m[0] && t[1] != m[1] && std::equal(m + 2, m + kWords, t + 2);
  COMMGRAD_CHECK(ok, call.op, call.group, "send/recv mismatch with rank ", peer,
                 " (COMMGRAD_DEBUG check; nothing was sent): this rank (", call.rank, ") ", describe(m), "; rank ",
                 peer, " ", describe(t));
}

}  // namespace detail
}  // namespace ops
}  // namespace commgrad
