// DistributedDataParallel: construction (replica check and broadcast from
// the first rank, in replicas.cpp) and the public handle; the per-backward
// work is in reducer.cpp.

#include "commgrad/dp/distributed_data_parallel.h"

#include "commgrad/dist/check.h"
#include "commgrad/dist/parallel_state.h"
#include "commgrad/dist/process_group.h"
#include "commgrad/dp/replicas.h"
#include "commgrad/tp/replica_check.h"
#include "commgrad/tp/wiring_checks.h"
#include "detail/reducer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <unordered_set>

namespace commgrad::dp {
namespace detail {
namespace {

// The trainable floating parameters in the policy's compute dtype (in
// place: each keeps its autograd identity), before the replica check.
void cast_parameters(const std::vector<NamedTensor>& params, const MixedPrecisionPolicy& policy) {
  if (!policy.param_dtype()) return;
  at::NoGradGuard no_grad;
  for (const auto& [name, p] : params) {
    if (!p.requires_grad() || !p.is_floating_point() || p.scalar_type() == *policy.param_dtype()) continue;
    at::Tensor t = p;
    t.set_data(p.to(*policy.param_dtype()));
    if (t.grad().defined()) t.mutable_grad() = t.grad().to(*policy.param_dtype());
  }
}
}  // namespace
}  // namespace detail

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 DistributedDataParallelOptions options)
    : module_(std::move(module)) {
  using detail::kDdpOp;
  Group group = options.group().defined() ? options.group() : default_data_parallel_group();
  options.group(group);
  check_member(kDdpOp, group);
  COMMGRAD_CHECK(module_ != nullptr, kDdpOp, group, "the module is null");
  tp::check_data_parallel_group(*module_, group, kDdpOp, "DistributedDataParallelOptions(group)");
  tp::check_context_parallel_replicas(*module_, group, kDdpOp, "DistributedDataParallelOptions(group)",
                                      options.ignored_parameters());
  COMMGRAD_CHECK(options.bucket_cap_mb() > 0 && options.first_bucket_cap_mb() > 0, kDdpOp, group,
                 "bucket sizes must be positive, got bucket_cap_mb ", options.bucket_cap_mb(),
                 " and first_bucket_cap_mb ", options.first_bucket_cap_mb());
  COMMGRAD_CHECK(options.average_divisor() >= 0, kDdpOp, group,
                 "average_divisor must be >= 0 (0: the group size), got ", options.average_divisor());
  const auto& policy = options.mixed_precision();
  check_policy(policy, kDdpOp);
  COMMGRAD_CHECK(!policy.output_dtype(), kDdpOp, group, "the mixed-precision policy (", policy.describe(),
                 ") sets output_dtype, but DistributedDataParallel does not wrap forward: cast the outputs in the "
                 "module (or shard it with fully_shard)");

  // Parameters and buffers, each tensor once (tied weights have several names).
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<detail::NamedTensor> params;
  const auto& ignored = options.ignored_parameters();
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    if (std::find(ignored.begin(), ignored.end(), item.key()) != ignored.end()) continue;
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    const auto& p = item.value();
    COMMGRAD_CHECK(p.layout() == at::kStrided, kDdpOp, group, "parameter '", item.key(), "' is not a dense tensor");
    COMMGRAD_CHECK(p.is_leaf(), kDdpOp, group, "parameter '", item.key(), "' is not a leaf tensor");
    params.emplace_back(item.key(), p);
  }
  detail::cast_parameters(params, policy);
  std::vector<detail::NamedTensor> buffers;
  for (const auto& item : module_->named_buffers(/*recurse=*/true)) {
    if (!item.value().defined() || !seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    buffers.emplace_back(item.key(), item.value());
  }

  // Same replicas everywhere, then rank 0's values everywhere.
  verify_replicas(kDdpOp, group, params, buffers);
  std::vector<at::Tensor> state;
  for (const auto& p : params) state.push_back(p.second);
  for (const auto& b : buffers) state.push_back(b.second);
  const auto cap = static_cast<int64_t>(options.bucket_cap_mb() * 1024 * 1024);
  broadcast_from_first(group, state, cap);

  std::vector<detail::NamedTensor> trainable;
  for (const auto& p : params) {
    if (p.second.requires_grad() && p.second.numel() > 0) trainable.push_back(p);
  }
  std::vector<at::Tensor> buffer_tensors;
  for (const auto& b : buffers) buffer_tensors.push_back(b.second);
  reducer_ =
      std::make_shared<detail::DdpReducer>(group, std::move(options), std::move(trainable), std::move(buffer_tensors));
  reducer_->install_hooks();
  // Under COMMGRAD_DEBUG, TP-replicated parameters must still be equal when
  // a backward starts (the last step kept them in step across TP ranks).
  std::weak_ptr<torch::nn::Module> weak = module_;
  reducer_->set_backward_check([weak] {
    if (const auto m = weak.lock()) tp::debug_check_replicated_parameters(*m, detail::kDdpOp);
  });
}

DistributedDataParallel::~DistributedDataParallel() {
  if (reducer_) reducer_->remove_hooks();
}

DistributedDataParallel::DistributedDataParallel(DistributedDataParallel&&) noexcept = default;
DistributedDataParallel& DistributedDataParallel::operator=(DistributedDataParallel&& other) noexcept {
  if (this != &other) {
    if (reducer_) reducer_->remove_hooks();
    module_ = std::move(other.module_);
    reducer_ = std::move(other.reducer_);
  }
  return *this;
}

detail::DdpReducer& DistributedDataParallel::reducer() const {
  TORCH_CHECK(reducer_ != nullptr, "[commgrad] DistributedDataParallel: used after it was moved from");
  return *reducer_;
}

const std::shared_ptr<torch::nn::Module>& DistributedDataParallel::module() const { return module_; }
const Group& DistributedDataParallel::group() const { return reducer().group(); }
const DistributedDataParallelOptions& DistributedDataParallel::options() const { return reducer().options(); }

DistributedDataParallel::NoSync DistributedDataParallel::no_sync() {
  reducer();
  return NoSync(reducer_);
}

DistributedDataParallel::NoSync::NoSync(std::shared_ptr<detail::DdpReducer> reducer) : reducer_(std::move(reducer)) {
  previous_ = reducer_->sync_enabled();
  reducer_->set_sync_enabled(false);
}

DistributedDataParallel::NoSync::NoSync(NoSync&& other) noexcept
    : reducer_(std::move(other.reducer_)), previous_(other.previous_) {
  other.reducer_.reset();
}

DistributedDataParallel::NoSync::~NoSync() {
  if (reducer_) reducer_->set_sync_enabled(previous_);
}

void DistributedDataParallel::register_comm_hook(CommHook hook) { reducer().set_comm_hook(std::move(hook)); }
void DistributedDataParallel::sync_buffers() { reducer().sync_buffers(); }
std::vector<DdpBucketInfo> DistributedDataParallel::buckets() const { return reducer().bucket_info(); }
DdpStepStats DistributedDataParallel::last_step() const { return reducer().last_step(); }

}  // namespace commgrad::dp
