// The gradient reducer of DistributedDataParallel: bucketed all-reduce of
// gradients, overlapped with backward.
//
// Buckets. The parameters that require grad are taken in reverse
// registration order (roughly the order in which backward produces their
// gradients) and packed, one dtype per bucket, into flat buffers of about
// `bucket_cap_mb`; the first bucket of each dtype is small
// (`first_bucket_cap_mb`) so that its all-reduce can start as early as
// possible. Each parameter owns a slot (a contiguous alias) of its bucket.
//
// Hooks. Each parameter gets a post hook on its gradient accumulator (the
// AccumulateGrad node), so it runs after the new gradient has been added to
// `.grad()`. The hook moves the gradient into its slot: with
// gradient_as_bucket_view the slot *is* `.grad()` (backward accumulates
// straight into the bucket and nothing is copied); otherwise it is one copy.
// When averaging, the slot is divided by the group size there (fused with
// the copy), so a bucket only has to be summed. The first hook of a backward
// queues an end-of-backward callback with the autograd engine (as c10d's
// reducer does).
//
// Launch order. A bucket whose slots are all ready is handed to the
// communication hook (by default one asynchronous SUM all-reduce), but only
// in bucket order: every rank must issue its collectives in the same order,
// so bucket k+1 waits for bucket k even when its gradients are ready first.
// The all-reduces run on the transport's threads while backward goes on.
//
// End of backward. The callback treats parameters whose hook did not fire:
// a gradient accumulated under no_sync() counts as ready; otherwise the slot
// is zero and, without find_unused_parameters, the parameter is reported as
// an error, but only after the remaining buckets have been reduced, so that
// all ranks stay in step. With find_unused_parameters a small all-reduce of
// per-parameter use counts tells which parameters no rank used; those keep
// their old `.grad()`. The callback waits for the buckets in order, runs the
// hooks' completion steps, writes the result back (nothing to do for bucket
// views) and broadcasts the buffers.
//
// Released gradients (release_gradients, for ZeRO-2). Buffers exist only
// while a bucket is being reduced: allocated when its first gradient
// arrives, freed once its hook's `then` has run. The hook copies each
// gradient into its slot and drops `.grad()`; launching bucket k finishes
// bucket k-2, so at most two buckets (plus autograd's own gradients) are
// alive during backward. Nothing is written back.
//
// A backward that fails half way drops its callback; the callback's
// destructor notices and drains the buckets already launched, so the next
// backward starts clean.

#include "detail/reducer.h"

#include "commgrad/dist/check.h"
#include "commgrad/util/names.h"
#include "commgrad/util/logging.h"
#include "commgrad/util/error.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <chrono>
#include <map>

namespace commgrad::dp::detail {
namespace {

int64_t mib_to_bytes(double mib) { return static_cast<int64_t>(mib * 1024.0 * 1024.0); }

// A contiguous alias of `numel` elements of `buffer` at `offset`, shaped
// `sizes`. Not an autograd view: optimizers' zero_grad() calls detach_() on
// gradients, which LibTorch refuses for views.
at::Tensor slot_alias(const at::Tensor& buffer, int64_t offset, at::IntArrayRef sizes) {
  auto alias = at::empty({0}, buffer.options());
  alias.set_(buffer.storage(), buffer.storage_offset() + offset, sizes);
  return alias;
}

bool same_memory(const at::Tensor& a, const at::Tensor& b) {
  return a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() && a.strides() == b.strides();
}

// Runs the reducer's end of backward from the autograd engine's final
// callbacks; if the backward fails first, the engine drops the callback
// without running it, and the destructor drains the reducer instead.
struct EndOfBackward {
  explicit EndOfBackward(std::weak_ptr<DdpReducer> r) : reducer(std::move(r)) {}
  ~EndOfBackward() {
    if (ran) return;
    if (auto r = reducer.lock()) r->abandon_backward();
  }
  void run() {
    ran = true;
    if (auto r = reducer.lock()) r->finalize_backward();
  }
  std::weak_ptr<DdpReducer> reducer;
  bool ran = false;
};

}  // namespace

std::vector<std::vector<size_t>> assign_buckets(const std::vector<at::Tensor>& tensors, int64_t first_cap_bytes,
                                                int64_t cap_bytes, const std::vector<char>& alone) {
  struct Open {
    std::vector<size_t> indices;
    int64_t bytes = 0;
    bool first = true;
  };
  std::map<std::pair<int, std::string>, Open> open;  // by (dtype, device)
  std::vector<std::vector<size_t>> buckets;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    auto& bucket = open[{static_cast<int>(t.scalar_type()), t.device().str()}];
    if (i < alone.size() && alone[i]) {
      // Close the open bucket first: buckets launch in order, so the ones
      // after this tensor must not wait for gradients that come later.
      if (!bucket.indices.empty()) buckets.push_back(std::move(bucket.indices));
      bucket.indices.clear();
      buckets.push_back({i});
      continue;
    }
    bucket.indices.push_back(i);
    bucket.bytes += t.numel() * static_cast<int64_t>(t.element_size());
    if (bucket.bytes >= (bucket.first ? first_cap_bytes : cap_bytes)) {
      buckets.push_back(std::move(bucket.indices));
      bucket.indices.clear();
      bucket.bytes = 0;
      bucket.first = false;
    }
  }
  for (auto& entry : open) {
    if (!entry.second.indices.empty()) buckets.push_back(std::move(entry.second.indices));
  }
  std::sort(buckets.begin(), buckets.end(), [](const auto& a, const auto& b) { return a.front() < b.front(); });
  return buckets;
}

DdpReducer::DdpReducer(Group group, DistributedDataParallelOptions options, std::vector<NamedTensor> params,
                       std::vector<at::Tensor> buffers)
    : group_(std::move(group)), options_(std::move(options)), buffers_(std::move(buffers)) {
  // Reduction order: reverse registration order.
  std::vector<at::Tensor> ordered;
  std::vector<char> alone;
  const auto& own = options_.own_bucket();
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    Param p;
    p.name = it->first;
    p.tensor = it->second;
    alone.push_back(std::find(own.begin(), own.end(), p.name) != own.end());
    params_.push_back(std::move(p));
    ordered.push_back(it->second);
  }
  for (const auto& name : own) {
    COMMGRAD_CHECK(std::any_of(params_.begin(), params_.end(), [&](const Param& p) { return p.name == name; }), kDdpOp,
                   group_, "own_bucket names '", name, "', which is not a trainable parameter of the module");
  }
  const auto assignment = assign_buckets(ordered, mib_to_bytes(options_.first_bucket_cap_mb()),
                                         mib_to_bytes(options_.bucket_cap_mb()), alone);

  at::NoGradGuard no_grad;
  const int64_t multiple = options_.bucket_multiple();
  COMMGRAD_CHECK(multiple >= 1, kDdpOp, group_, "bucket_multiple must be at least 1, got ", multiple);
  for (size_t b = 0; b < assignment.size(); ++b) {
    Bucket bucket;
    bucket.param_dtype = ordered[assignment[b].front()].scalar_type();
    bucket.dtype = options_.mixed_precision().reduction_dtype(bucket.param_dtype);
    if (options_.reduction() == GradReduction::kAverage) {
      const int64_t divisor = options_.average_divisor() > 0 ? options_.average_divisor() : group_.size();
      bucket.average = split_average(options_.mixed_precision(), bucket.dtype, divisor);
    }
    bucket.params = assignment[b];
    for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
      auto& p = params_[bucket.params[slot]];
      p.bucket = b;
      p.slot = slot;
      bucket.names.push_back(p.name);
      bucket.offsets.push_back(bucket.numel);
      bucket.numel += p.tensor.numel();
    }
    bucket.padded_numel = (bucket.numel + multiple - 1) / multiple * multiple;
    bucket.bytes = bucket.numel * static_cast<int64_t>(ordered[bucket.params.front()].element_size());
    if (!release()) {
      ensure_buffer(bucket);
      // Gradients that already exist move into the bucket now.
      for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
        auto& grad = params_[bucket.params[slot]].tensor.mutable_grad();
        if (as_bucket_view(bucket) && grad.defined() && !grad.is_sparse()) {
          bucket.views[slot].copy_(grad);
          grad = bucket.views[slot];
        }
      }
    }
    buckets_.push_back(std::move(bucket));
  }
  ready_.assign(params_.size(), 0);
  used_since_sync_.assign(params_.size(), 0);
  comm_hook_ = allreduce_hook();
}

DdpReducer::~DdpReducer() { remove_hooks(); }

void DdpReducer::ensure_buffer(Bucket& bucket) {
  if (bucket.buffer.defined()) return;
  const auto& first = params_[bucket.params.front()].tensor;
  bucket.buffer = at::zeros({bucket.padded_numel}, first.options().dtype(bucket.dtype).requires_grad(false));
  bucket.views.clear();
  for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
    bucket.views.push_back(
        slot_alias(bucket.buffer, bucket.offsets[slot], params_[bucket.params[slot]].tensor.sizes()));
  }
}

void DdpReducer::install_hooks() {
  std::weak_ptr<DdpReducer> weak = weak_from_this();
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    // The accumulator is cached weakly by the parameter; holding it here
    // keeps the same node (and so the hook) across iterations.
    p.accumulator = torch::autograd::impl::grad_accumulator(p.tensor);
    TORCH_INTERNAL_ASSERT(p.accumulator, "no gradient accumulator for parameter ", p.name);
    p.hook_key = p.accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [weak, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          if (auto self = weak.lock()) self->on_gradient_ready(i);
          return outputs;
        }));
  }
}

void DdpReducer::remove_hooks() {
  for (auto& p : params_) {
    if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
    p.accumulator.reset();
  }
}

bool DdpReducer::sync_enabled() const {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  return sync_enabled_;
}

void DdpReducer::set_sync_enabled(bool enabled) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  sync_enabled_ = enabled;
}

void DdpReducer::set_comm_hook(CommHook hook) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  COMMGRAD_CHECK(static_cast<bool>(hook), kDdpOp, group_, "register_comm_hook: the hook is empty");
  COMMGRAD_CHECK(!in_backward_, kDdpOp, group_, "register_comm_hook: called during backward");
  comm_hook_ = std::move(hook);
}

void DdpReducer::sync_buffers() {
  if (buffers_.empty() || group_.size() == 1) return;
  broadcast_from_first(group_, buffers_, mib_to_bytes(options_.bucket_cap_mb()));
}

std::vector<DdpBucketInfo> DdpReducer::bucket_info() const {
  std::vector<DdpBucketInfo> info;
  for (const auto& b : buckets_) {
    info.push_back(DdpBucketInfo{b.dtype, b.param_dtype, b.numel, b.padded_numel, b.names});
  }
  return info;
}

DdpStepStats DdpReducer::last_step() const {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  return last_step_;
}

void DdpReducer::on_gradient_ready(size_t index) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  used_since_sync_[index] = 1;
  if (!sync_enabled_) return;  // no_sync(): the gradient just accumulates
  at::NoGradGuard no_grad;
  try {
    if (!in_backward_) begin_backward();
    COMMGRAD_CHECK(!ready_[index], kDdpOp, group_, "parameter '", params_[index].name,
                   "' received a gradient twice in one backward (reentrant backward, e.g. activation "
                   "checkpointing, is not supported)");
    mark_ready(index);
    launch_ready_buckets(/*during_backward=*/true);
  } catch (...) {
    abandon_backward();
    throw;
  }
}

void DdpReducer::begin_backward() {
  if (backward_check_) backward_check_();
  in_backward_ = true;
  next_bucket_ = 0;
  launched_in_backward_ = 0;
  std::fill(ready_.begin(), ready_.end(), 0);
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.launched = false;
    b.finished = false;
    b.work = CommWork{};
  }
  auto end = std::make_shared<EndOfBackward>(weak_from_this());
  torch::autograd::Engine::get_default_engine().queue_callback([end] { end->run(); });
}

void DdpReducer::mark_ready(size_t index) {
  auto& p = params_[index];
  auto& bucket = buckets_[p.bucket];
  ensure_buffer(bucket);
  auto& slot = bucket.views[p.slot];
  auto& grad = p.tensor.mutable_grad();
  const double divisor = bucket.average.before;
  const bool average = divisor != 1;
  if (grad.defined()) {
    COMMGRAD_CHECK(!grad.is_sparse(), kDdpOp, group_, "parameter '", p.name,
                   "' has a sparse gradient; only dense gradients are supported");
    COMMGRAD_CHECK(grad.sizes() == p.tensor.sizes() && grad.scalar_type() == bucket.param_dtype, kDdpOp, group_,
                   "gradient of parameter '", p.name, "' is ", tensor_name(grad), ", but the parameter is ",
                   dtype_name(bucket.param_dtype), shape_name(p.tensor.sizes()));
    if (as_bucket_view(bucket)) {
      if (!same_memory(grad, slot)) {
        slot.copy_(grad);
        grad = slot;
      }
      if (average) slot.div_(divisor);
    } else if (bucket.dtype != bucket.param_dtype) {
      slot.copy_(grad);  // cast into the reduction dtype, divided there
      if (average) slot.div_(divisor);
    } else if (average) {
      at::div_out(slot, grad, at::scalar_tensor(divisor, slot.options()));
    } else {
      slot.copy_(grad);
    }
    if (release()) grad = at::Tensor();  // the bucket holds the only copy now
  } else {
    slot.zero_();  // no gradient on this rank: it contributes zero
  }
  ready_[index] = 1;
  --bucket.pending;
}

void DdpReducer::launch_ready_buckets(bool during_backward) {
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    auto& b = buckets_[next_bucket_];
    GradBucket view(next_bucket_, buckets_.size(), b.buffer, b.views, b.names, group_, b.average.after);
    b.work = comm_hook_(view);
    b.launched = true;
    if (during_backward) ++launched_in_backward_;
    ++next_bucket_;
    // With released gradients at most two buckets are in flight: finishing
    // the older ones frees their buffers while backward goes on.
    if (release() && during_backward && next_bucket_ >= 3) {
      std::exception_ptr error;
      for (size_t old = 0; old + 2 < next_bucket_; ++old) finish_bucket(old, error);
      if (error) std::rethrow_exception(error);
    }
  }
}

void DdpReducer::finish_bucket(size_t b, std::exception_ptr& error) {
  auto& bucket = buckets_[b];
  if (bucket.finished) return;
  bucket.finished = true;
  auto& work = bucket.work;
  try {
    if (work.pending.defined()) work.pending.wait();
    if (work.then) work.then();
  } catch (const std::exception& e) {
    if (!error) {
      try {
        // The cause first (a peer that failed says so there); the hint
        // is for the other common reason, ranks whose backward differs.
        COMMGRAD_THROW_MESSAGE(::commgrad::ErrorKind::kPeerFailed, "[commgrad] ", kDdpOp, " ", group_.describe(),
                               ": reducing ", bucket_context(b), " failed: ",
                               dynamic_cast<const c10::Error*>(&e)
                                   ? dynamic_cast<const c10::Error&>(e).what_without_backtrace()
                                   : e.what(),
                               " (if the ranks ran different backwards, e.g. one skipped parameters, construct "
                               "DistributedDataParallel with find_unused_parameters(true))");
      } catch (...) {
        error = std::current_exception();
      }
    }
  }
  work = CommWork{};
  release_buffer(bucket);
}

void DdpReducer::release_buffer(Bucket& bucket) {
  if (!release()) return;
  bucket.buffer = at::Tensor();
  bucket.views.clear();
}

std::string DdpReducer::bucket_context(size_t b) const {
  const auto& bucket = buckets_[b];
  return c10::str("gradient bucket ", b, "/", buckets_.size(), " (", bucket.names.size(), " parameters from '",
                  bucket.names.front(), "', ", bucket.bytes, " bytes of ", dtype_name(bucket.dtype), ")");
}

void DdpReducer::finalize_backward() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!in_backward_) return;
  at::NoGradGuard no_grad;
  const auto start = std::chrono::steady_clock::now();
  const bool find_unused = options_.find_unused_parameters();
  std::vector<std::string> unused;  // no gradient since the last reduction
  std::exception_ptr error;

  // 1. Parameters whose hook did not fire in this backward; then the rest
  //    of the buckets, in order.
  try {
    for (size_t i = 0; i < params_.size(); ++i) {
      if (ready_[i]) continue;
      if (!used_since_sync_[i]) unused.push_back(params_[i].name);
      mark_ready(i);
    }
    launch_ready_buckets(/*during_backward=*/false);
  } catch (...) {
    wait_all_quietly();
    reset_backward_state();
    throw;
  }

  // 2. Which parameters did any rank use (find_unused_parameters only).
  std::vector<int32_t> global_use;
  at::Tensor use_counts;
  ops::raw::Pending use_pending;
  if (find_unused) {
    use_counts = at::empty({static_cast<int64_t>(params_.size())}, at::kInt);
    auto* counts = use_counts.data_ptr<int32_t>();
    for (size_t i = 0; i < params_.size(); ++i) counts[i] = used_since_sync_[i] ? 1 : 0;
    use_pending = ops::raw::all_reduce_(use_counts, {}, group_);
  }

  // 3. Wait for every bucket in order and let its hook finish.
  for (size_t b = 0; b < buckets_.size(); ++b) finish_bucket(b, error);
  if (use_pending.defined()) {
    try {
      use_pending.wait();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (find_unused) {
    const auto* counts = use_counts.data_ptr<int32_t>();
    global_use.assign(counts, counts + params_.size());
  }

  // 4. Results into .grad().
  if (!error) write_back(global_use);
  last_step_ = DdpStepStats{};
  last_step_.buckets = static_cast<int64_t>(buckets_.size());
  last_step_.launched_in_backward = launched_in_backward_;
  last_step_.unused_parameters = unused;
  last_step_.wait_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  reset_backward_state();

  // 5. Buffers, as PyTorch's DDP broadcasts them before each forward.
  if (!error && options_.broadcast_buffers()) {
    try {
      sync_buffers();
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  if (!find_unused && !unused.empty()) {
    std::string names;
    for (size_t i = 0; i < unused.size() && i < 8; ++i) names += c10::str(i ? ", '" : "'", unused[i], "'");
    if (unused.size() > 8) names += c10::str(", ... (", unused.size(), " in all)");
    COMMGRAD_CHECK(false, kDdpOp, group_, "parameter '", unused.front(),
                   "' received no gradient in this backward (parameters without gradient: ", names,
                   "). Make every parameter take part in the loss, or construct DistributedDataParallel with "
                   "find_unused_parameters(true). The gradients were still reduced so that the ranks stay in "
                   "step.");
  }
}

void DdpReducer::write_back(const std::vector<int32_t>& global_use) {
  if (release()) return;  // the hook's result is the only copy
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    const auto& bucket = buckets_[p.bucket];
    const auto& slot = bucket.views[p.slot];
    auto& grad = p.tensor.mutable_grad();
    const bool used_anywhere = global_use.empty() || global_use[i] > 0;
    if (as_bucket_view(bucket)) {
      if (!grad.defined() && used_anywhere) grad = slot;  // otherwise grad is the slot already
    } else if (grad.defined()) {
      grad.copy_(slot);  // rounds a wider reduction into the parameter's dtype
    } else if (used_anywhere) {
      grad = slot.to(bucket.param_dtype, /*non_blocking=*/false, /*copy=*/true);
    }
  }
}

void DdpReducer::wait_all_quietly() {
  for (auto& b : buckets_) {
    try {
      if (b.work.pending.defined()) b.work.pending.wait();
    } catch (const std::exception& e) {
      COMMGRAD_LOG(kWarn, kDdpOp, " ", group_.describe(), ": ignoring a failed bucket reduction: ", e.what());
    }
    b.work = CommWork{};
    release_buffer(b);
  }
}

void DdpReducer::reset_backward_state() {
  in_backward_ = false;
  next_bucket_ = 0;
  std::fill(used_since_sync_.begin(), used_since_sync_.end(), 0);
}

void DdpReducer::abandon_backward() {
  try {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (!in_backward_) return;
    COMMGRAD_LOG(kWarn, kDdpOp, " ", group_.describe(),
                 ": backward ended before its gradients were reduced; draining launched buckets");
    wait_all_quietly();
    reset_backward_state();
  } catch (...) {
    // Called from a destructor: never throw.
  }
}

}  // namespace commgrad::dp::detail
