// ZeroOptimizer: ZeRO-1/2 on DistributedDataParallel's buckets.
//
// Layout. DistributedDataParallel is built with buckets padded to a multiple
// of the group size n, so bucket b of P padded elements splits into n equal
// chunks of c = P / n; rank r owns elements [r c, min((r+1) c, numel)) of
// it (the last ranks' ranges are shorter or empty when the bucket does not
// fill its padding). The parameters of each bucket are made views of one
// flat parameter buffer laid out like the gradient bucket, and the inner
// optimizer's parameter for bucket b is the alias of this rank's range of
// that buffer: stepping it updates the model's parameters in place.
//
// Backward. The communication hook reduce-scatters each bucket (DDP has
// already divided it by n when averaging) as soon as DDP launches it; at
// the end of backward its `then` copies this rank's part into the shard's
// gradient, which is the inner parameter's .grad(). A bucket moves 2(n-1)/n
// of its bytes over the whole step (reduce-scatter + all-gather), the same
// as DDP's all-reduce.
//
// Step. Parameters marked partial_grad (sequence parallelism: LayerNorm
// weights, row-parallel biases) have only this TP rank's part of their
// gradient: their segments are summed over the TP group first (one
// all-reduce; the TP ranks of one DP rank have the same ranges), which is
// what tp::allreduce_sequence_parallel_grads() does for unsharded training.
// Tied parameters (a pipeline's shared embedding) sit alone in their
// buckets, so their copies on the ranks of the tied group have the same
// ranges; this rank's range of each is summed over the tied group next.
// Then optional clipping by the global norm: each rank sums the squares of
// its ranges (float64; with a TP group, TP-replicated parameters only on TP
// rank 0), one all-reduce over the DP group (and one over the TP group)
// gives every rank the same total, hence the same factor as an unsharded
// clip_grad_norm_. Then the inner step, and one all-gather per bucket of
// each rank's chunk back into the flat parameter buffers (all started
// before the first is waited for).
//
// Mixed precision. DDP casts the parameters to the policy's param_dtype and
// builds its buckets in the reduce dtype, so the reduce-scatter sums (and
// this rank's gradient arrives) in that dtype; a 16-bit sum was divided by
// part of the group size before it and is divided by the rest here. With
// float32 masters the inner optimizer steps float32 copies of this rank's
// ranges; their gradients are the reduced ones cast to float32 (no copy
// when the reduction already was), and the parameters take the rounded
// result. With a loss scaler the masters' gradients are unscaled after the
// partial and tied sums, and one flag per group of the scaler (MAX) tells
// every rank whether some rank found inf/NaN: then nobody clips, steps or
// all-gathers, and the scale backs off.

#include "detail/zero_impl.h"

#include "commgrad/dist/check.h"
#include "commgrad/dist/parallel_state.h"
#include "commgrad/ops/raw.h"
#include "commgrad/optim/clip_grad.h"
#include "commgrad/optim/loss_scaler.h"
#include "commgrad/tp/sharding.h"
#include "commgrad/tp/wiring_checks.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>

namespace commgrad::optim {
namespace {

using detail::alias;
using detail::bytes_of;
using detail::kZeroOp;

// The policy: the options' own, or, when it sets no dtype, the one in their
// DDP options (with the options' float32_master).
dp::MixedPrecisionPolicy resolve_policy(const ZeroOptimizerOptions& options, const Group& group) {
  auto policy = options.mixed_precision();
  if (policy.full_precision()) {
    const auto& given = options.ddp().mixed_precision();
    policy.param_dtype(given.param_dtype()).reduce_dtype(given.reduce_dtype()).output_dtype(given.output_dtype());
  }
  dp::check_policy(policy, kZeroOp);
  COMMGRAD_CHECK(!policy.output_dtype(), kZeroOp, group, "the mixed-precision policy (", policy.describe(),
                 ") sets output_dtype, but ZeroOptimizer does not wrap forward: cast the outputs in the module");
  return policy;
}

// The scaler must agree over the data-parallel group, or the ranks of one
// bucket could step and skip apart.
void check_loss_scaler(const ZeroOptimizerOptions& options, const Group& group) {
  const auto* scaler = options.loss_scaler();
  if (scaler == nullptr) return;
  COMMGRAD_CHECK(options.clip_partner() == nullptr, kZeroOp, group,
                 "loss_scaler does not combine with clip_partner yet (the partner's gradients are not unscaled)");
  if (group.size() == 1) return;
  const auto& groups = scaler->groups();
  COMMGRAD_CHECK(std::find(groups.begin(), groups.end(), group) != groups.end(), kZeroOp, group,
                 "the loss scaler agrees on inf/NaN over ", groups.size(),
                 " groups, none of which is the data-parallel group ", group.describe(),
                 ": give it DynamicLossScalerOptions().groups({...}) with that group");
}

}  // namespace

ZeroOptimizer::ZeroOptimizer(std::shared_ptr<torch::nn::Module> module, OptimizerFactory make_optimizer,
                             ZeroOptimizerOptions options)
    : impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  TORCH_CHECK(module, "[commgrad] ZeroOptimizer: the module is null");
  TORCH_CHECK(make_optimizer, "[commgrad] ZeroOptimizer: the optimizer factory is empty");
  TORCH_CHECK(options.stage() == 1 || options.stage() == 2,
              "[commgrad] ZeroOptimizer: stage must be 1 (optimizer state sharded) or 2 (gradients too), got ",
              options.stage());
  TORCH_CHECK(options.max_grad_norm() >= 0, "[commgrad] ZeroOptimizer: max_grad_norm must be >= 0, got ",
              options.max_grad_norm());
  m.module = std::move(module);
  m.options = std::move(options);
  // Groups not given come from the current layout (an explicit one wins).
  if (!m.options.ddp().group().defined()) m.options.ddp().group(default_data_parallel_group());
  // The norm's TP group: the given one, else the layout's, else the group the
  // module's partitioned parameters are split over (an error when it differs
  // from theirs); a data-parallel group holding two TP peers is an error.
  const Group given_tp =
      m.options.tensor_parallel_group().defined() ? m.options.tensor_parallel_group() : default_tensor_parallel_group();
  m.options.tensor_parallel_group(tp::tensor_parallel_group_for_norm(*m.module, given_tp, kZeroOp));
  tp::check_data_parallel_group(*m.module, m.options.ddp().group(), kZeroOp, "ZeroOptimizerOptions(group)");
  tp::check_context_parallel_replicas(*m.module, m.options.ddp().group(), kZeroOp, "ZeroOptimizerOptions(group)",
                                      m.options.ddp().ignored_parameters());
  if (!m.options.pipeline_parallel_group().defined()) {
    m.options.pipeline_parallel_group(default_pipeline_parallel_group());
  }
  const Group group = m.options.ddp().group();
  m.options.mixed_precision(resolve_policy(m.options, group));
  check_loss_scaler(m.options, group);
  for (const auto& name : m.options.tied_parameters()) {
    const auto* p = m.module->named_parameters().find(name);
    COMMGRAD_CHECK(p != nullptr && p->requires_grad(), kZeroOp, group, "tied parameter '", name,
                   "' is not a trainable parameter of the module");
  }
  auto ddp_options = m.options.ddp();
  auto own_bucket = ddp_options.own_bucket();
  own_bucket.insert(own_bucket.end(), m.options.tied_parameters().begin(), m.options.tied_parameters().end());
  ddp_options.group(group)
      .own_bucket(own_bucket)
      .bucket_multiple(group.size())
      .release_gradients(m.options.stage() == 2)
      .gradient_as_bucket_view(m.options.stage() == 1)
      .mixed_precision(m.options.mixed_precision());
  m.ddp = std::make_unique<dp::DistributedDataParallel>(m.module, ddp_options);
  m.group = m.ddp->group();
  for (const auto& item : m.module->named_parameters()) {
    if (item.value().requires_grad()) m.params[item.key()] = item.value();
  }
  for (const auto& [name, p] : m.params) {
    COMMGRAD_CHECK(p.is_floating_point(), kZeroOp, m.group, "parameter '", name, "' is ", tensor_name(p),
                   "; only floating-point parameters can be optimized");
  }
  m.build_shards();
  m.check_tied();
  std::vector<at::Tensor> masters;
  for (const auto& s : m.shards) {
    if (s.master.defined()) masters.push_back(s.master);
  }
  m.optimizer = make_optimizer(masters);
  TORCH_CHECK(m.optimizer, "[commgrad] ZeroOptimizer: the optimizer factory returned null");
  m.install_hook();
}

ZeroOptimizer::~ZeroOptimizer() = default;

void ZeroOptimizer::Impl::build_shards() {
  at::NoGradGuard no_grad;
  const int n = group.size();
  const int rank = group.rank();
  const auto specs = tp::shard_specs(*module);
  const bool tp = options.tensor_parallel_group().defined() && options.tensor_parallel_group().size() > 1;
  const bool tp_first = !tp || options.tensor_parallel_group().rank() == 0;
  const auto& tied = options.tied_parameters();
  const bool tied_first = !options.tied_group().defined() || options.tied_group().rank() == 0;
  for (const auto& bucket : ddp->buckets()) {
    Shard s;
    s.tied = bucket.names.size() == 1 && std::find(tied.begin(), tied.end(), bucket.names.front()) != tied.end();
    s.info.bucket_numel = bucket.numel;
    s.info.padded_numel = bucket.padded_numel;
    s.chunk = bucket.padded_numel / n;
    s.info.begin = std::min<int64_t>(rank * s.chunk, bucket.numel);
    s.info.end = std::min<int64_t>((rank + 1) * s.chunk, bucket.numel);
    const auto& first = params.at(bucket.names.front());
    s.params = at::zeros({bucket.padded_numel}, first.options().requires_grad(false));
    const bool sixteen_bit = bucket.param_dtype == at::kHalf || bucket.param_dtype == at::kBFloat16;
    s.state_dtype = options.mixed_precision().float32_master() && sixteen_bit ? at::kFloat : bucket.param_dtype;
    s.grad_dtype = bucket.dtype;
    s.info.state_dtype = s.state_dtype;
    int64_t offset = 0;
    for (const auto& name : bucket.names) {
      auto& p = params.at(name);
      s.names.push_back(name);
      s.offsets.push_back(offset);
      auto view = alias(s.params, offset, p.sizes());
      view.copy_(p);
      p.set_data(view);  // keeps the parameter's autograd identity and DDP's hook
      // The part of this parameter inside this rank's range.
      const int64_t lo = std::max(offset, s.info.begin);
      const int64_t hi = std::min(offset + p.numel(), s.info.end);
      if (lo < hi) {
        s.info.segments.push_back({name, lo - offset, lo - s.info.begin, hi - lo});
        const bool replicated = !specs.contains(name) || !specs[name].spec.is_partitioned();
        s.counted.push_back((!replicated || tp_first) && (!s.tied || tied_first));
        const bool partial = specs.contains(name) && specs[name].spec.partial_grad;
        s.partial.push_back(partial);
        if (partial && !partial_group.defined()) {
          partial_group =
              options.tensor_parallel_group().defined() ? options.tensor_parallel_group() : specs[name].group;
        }
      }
      offset += p.numel();
    }
    if (s.info.end > s.info.begin) {
      const int64_t len = s.info.end - s.info.begin;
      s.separate_master = s.state_dtype != bucket.param_dtype;
      s.master = s.separate_master ? s.params.narrow(0, s.info.begin, len).to(at::kFloat)
                                   : alias(s.params, s.info.begin, {len});
      // ZeRO-1: set by the hook (DDP's bucket, in the reduction dtype)
      if (options.stage() == 2) s.grad = at::zeros({len}, s.params.options().dtype(s.grad_dtype));
    }
    shards.push_back(std::move(s));
  }
}

void ZeroOptimizer::Impl::install_hook() {
  ddp->register_comm_hook([this](dp::GradBucket& bucket) {
    Shard& s = shards.at(bucket.index());
    const int64_t len = s.info.end - s.info.begin;
    if (options.stage() == 1 && len > 0 && !s.grad.defined()) {
      // ZeRO-1 keeps DDP's buckets: this rank's range of the bucket is the
      // shard's gradient (the bucket buffer lives as long as DDP).
      s.grad = alias(bucket.buffer(), s.info.begin, {len});
    }
    const double post_divide = bucket.post_divide();  // the rest of a split 16-bit average
    if (bucket.group().size() == 1) {                 // the bucket is the result: no copy for ZeRO-1, one for ZeRO-2
      const auto buffer = bucket.buffer();
      return dp::CommWork{{}, [buffer, &s, len, post_divide] {
                            if (len > 0 && !s.grad.is_alias_of(buffer)) s.grad.copy_(buffer.narrow(0, 0, len));
                            if (len > 0 && post_divide != 1) s.grad.div_(post_divide);
                            s.fresh = true;
                          }};
    }
    auto pending = ops::raw::reduce_scatter(bucket.buffer(), {}, bucket.group());
    return dp::CommWork{pending, [pending, &s, len, post_divide]() mutable {
                          const auto part = pending.wait();
                          if (len > 0) s.grad.copy_(part.narrow(0, 0, len));
                          if (len > 0 && post_divide != 1) s.grad.div_(post_divide);
                          s.fresh = true;
                        }};
  });
}

namespace {

// Sums `parts` (views) over `group` in place, with one all-reduce. Every rank
// of the group passes parts of the same sizes.
void sum_in_place(std::vector<at::Tensor>& parts, const Group& group) {
  if (parts.empty()) return;
  auto flat = at::cat(parts);
  ops::raw::all_reduce_(flat, {}, group).wait();
  int64_t offset = 0;
  for (auto& part : parts) {
    part.copy_(flat.narrow(0, offset, part.numel()));
    offset += part.numel();
  }
}

}  // namespace

void ZeroOptimizer::Impl::sum_partial_gradients() {
  if (!partial_group.defined() || partial_group.size() == 1) return;
  std::vector<at::Tensor> parts;
  for (auto& s : shards) {
    for (size_t i = 0; i < s.info.segments.size(); ++i) {
      const auto& seg = s.info.segments[i];
      if (s.partial[i]) parts.push_back(s.master.grad().narrow(0, seg.shard_offset, seg.length));
    }
  }
  sum_in_place(parts, partial_group);  // the same sizes on every rank of the TP group: their ranges are alike
}

void ZeroOptimizer::Impl::sum_tied_gradients() {
  const auto& tied = options.tied_group();
  if (!tied.defined() || tied.size() == 1) return;
  std::vector<at::Tensor> parts;
  for (auto& s : shards) {
    if (s.tied && s.master.defined()) parts.push_back(s.master.grad());
  }
  sum_in_place(parts, tied);  // the copies' buckets, and so their ranges, are alike (check_tied)
}

void ZeroOptimizer::Impl::check_tied() const {
  const auto& names = options.tied_parameters();
  const auto& tied = options.tied_group();
  if (names.empty()) return;
  COMMGRAD_CHECK(tied.defined(), kZeroOp, group, "tied_parameters are named ('", names.front(),
                 "', ...) but tied_group is not set");
  if (tied.size() == 1) return;
  // Every copy: the same data-parallel rank and size, and the same shapes.
  std::vector<int64_t> mine{group.rank(), group.size(), static_cast<int64_t>(names.size())};
  for (const auto& name : names) mine.push_back(params.at(name).numel());
  const auto local = at::tensor(mine, at::kLong);
  const auto local_count = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  const auto counts = ops::raw::all_gather(local_count, {}, tied).wait();
  COMMGRAD_CHECK(counts.eq(counts[0]).all().item<bool>(), kZeroOp, tied, "the ranks of the tied group name ",
                 "different numbers of tied parameters (this rank ", names.size(), ")");
  const auto all = ops::raw::all_gather(local, {}, tied).wait().view({tied.size(), -1});
  const at::IntArrayRef my_numels = at::IntArrayRef(mine).slice(3);
  for (int r = 0; r < tied.size(); ++r) {
    const auto theirs = all[r].contiguous();
    const auto* v = theirs.data_ptr<int64_t>();
    COMMGRAD_CHECK(theirs.equal(local), kZeroOp, tied, "the tied parameters ('", names.front(),
                   "', ...) are not split like group rank ", r, "'s copies: this rank has data-parallel rank ", mine[0],
                   "/", mine[1], " and ", shape_name(my_numels), " elements, rank ", r, " has ", v[0], "/", v[1],
                   " and ", shape_name(at::IntArrayRef(v + 3, mine.size() - 3)), " elements");
  }
}

// The squares of this rank's counted ranges (`master`: of the masters'
// gradients in step(); else of the reduced gradients, for a clip partner).
double ZeroOptimizer::Impl::local_squares(bool master) const {
  double sum = 0;
  for (const auto& s : shards) {
    const at::Tensor& g = master ? s.master.grad() : s.grad;
    for (size_t i = 0; i < s.info.segments.size(); ++i) {
      const auto& seg = s.info.segments[i];
      if (s.counted[i]) sum += squared_norm(g.narrow(0, seg.shard_offset, seg.length));
    }
  }
  return sum;
}

double ZeroOptimizer::Impl::clip() {
  auto total = at::full({1}, local_squares(true), at::kDouble);
  if (group.size() > 1) ops::raw::all_reduce_(total, {}, group).wait();
  Impl* partner = options.clip_partner() != nullptr ? options.clip_partner()->impl_.get() : nullptr;
  if (partner != nullptr) {
    auto theirs = at::full({1}, partner->local_squares(false), at::kDouble);
    if (partner->group.size() > 1) ops::raw::all_reduce_(theirs, {}, partner->group).wait();
    const auto& g = options.clip_partner_group();
    if (g.defined() && g.size() > 1) ops::raw::all_reduce_(theirs, {}, g).wait();
    total += theirs;
  }
  const auto& tp = options.tensor_parallel_group();
  if (tp.defined() && tp.size() > 1) ops::raw::all_reduce_(total, {}, tp).wait();
  const auto& pp = options.pipeline_parallel_group();
  if (pp.defined() && pp.size() > 1) ops::raw::all_reduce_(total, {}, pp).wait();
  const double norm = std::sqrt(total.item<double>());
  const float coef = clip_coefficient(norm, options.max_grad_norm());
  if (coef < 1.0f) {
    for (auto& s : shards) {
      if (s.master.defined()) s.master.mutable_grad().mul_(coef);
    }
    if (partner != nullptr) {
      for (auto& s : partner->shards) {
        if (s.grad.defined()) s.grad.mul_(coef);
      }
    }
  }
  return norm;
}

void ZeroOptimizer::Impl::all_gather_parameters() {
  if (group.size() == 1) return;
  std::vector<ops::raw::Pending> pending;
  for (auto& s : shards) {
    pending.push_back(ops::raw::all_gather(s.params.narrow(0, group.rank() * s.chunk, s.chunk), {}, group));
  }
  for (size_t b = 0; b < shards.size(); ++b) shards[b].params.copy_(pending[b].wait());
}

// The hooks, with this rank's ranges of the masters' gradients (`master`)
// or of the reduced ones (a clip partner's, before its own step()).
void ZeroOptimizer::Impl::run_gradient_hooks(bool master) {
  if (gradient_hooks.empty()) return;
  std::vector<StateShard> grads;
  for (auto& s : shards) {
    if (master && !s.master.defined()) continue;  // no elements of this bucket on this rank
    const at::Tensor& g = master ? s.master.grad() : s.grad;
    if (!g.defined()) continue;
    for (const auto& seg : s.info.segments) {
      grads.push_back({seg.name, "grad", seg.param_begin, g.narrow(0, seg.shard_offset, seg.length)});
    }
  }
  for (const auto& hook : gradient_hooks) hook(grads);
}

void ZeroOptimizer::register_gradient_hook(GradientHook hook) {
  TORCH_CHECK(hook, "[commgrad] ZeroOptimizer: register_gradient_hook() was given an empty function");
  impl_->gradient_hooks.push_back(std::move(hook));
}

// Unscales the masters' gradients and agrees on inf/NaN over the scaler's
// groups; true when every rank skips this step (the scaler updated).
bool ZeroOptimizer::Impl::skip_for_loss_scaler() {
  auto* scaler = options.loss_scaler();
  if (scaler == nullptr) return false;
  std::vector<at::Tensor> grads;
  for (auto& s : shards) {
    if (s.master.defined()) grads.push_back(s.master.grad());
  }
  const bool found_inf = scaler->unscale_and_check(grads);
  if (found_inf) scaler->update(true);
  return found_inf;
}

double ZeroOptimizer::step() {
  auto& m = *impl_;
  at::NoGradGuard no_grad;
  for (size_t b = 0; b < m.shards.size(); ++b) {
    COMMGRAD_CHECK(m.shards[b].fresh, kZeroOp, m.group, "step() without a synchronised backward since the last step ",
                   "(bucket ", b, " of ", m.shards.size(),
                   " was not reduced: call backward() outside no_sync() before step())");
  }
  // The inner parameters' gradients: the shards' own, or copies in the
  // state dtype (float32 for float32 masters; kept only during the step).
  for (auto& s : m.shards) {
    if (s.master.defined()) s.master.mutable_grad() = s.grad.to(s.state_dtype);
  }
  m.sum_partial_gradients();
  m.sum_tied_gradients();
  const bool skip = m.skip_for_loss_scaler();
  if (!m.hooks_ran) m.run_gradient_hooks(true);
  Impl* partner = m.options.clip_partner() != nullptr ? m.options.clip_partner()->impl_.get() : nullptr;
  if (partner != nullptr && !partner->gradient_hooks.empty()) {
    partner->run_gradient_hooks(false);  // before the clip they share
    partner->hooks_ran = true;
  }
  m.hooks_ran = false;
  const double norm = skip ? std::numeric_limits<double>::quiet_NaN() : m.options.max_grad_norm() > 0 ? m.clip() : -1.0;
  if (!skip) m.optimizer->step();
  for (auto& s : m.shards) {
    if (!s.master.defined()) continue;
    if (s.separate_master && !skip) s.params.narrow(0, s.info.begin, s.master.numel()).copy_(s.master);  // rounds
    s.master.mutable_grad() = at::Tensor();
  }
  if (!skip) m.all_gather_parameters();
  if (!skip && m.options.loss_scaler() != nullptr) m.options.loss_scaler()->update(false);
  for (auto& s : m.shards) s.fresh = false;
  return norm;
}

void ZeroOptimizer::zero_grad() {
  at::NoGradGuard no_grad;
  for (auto& [name, p] : impl_->params) {
    auto& grad = p.mutable_grad();
    if (!grad.defined()) continue;
    if (impl_->options.stage() == 1) {
      grad.zero_();  // the bucket view: zeroed in place
    } else {
      grad = at::Tensor();
    }
  }
}

dp::DistributedDataParallel::NoSync ZeroOptimizer::no_sync() { return impl_->ddp->no_sync(); }
torch::optim::Optimizer& ZeroOptimizer::optimizer() { return *impl_->optimizer; }
dp::DistributedDataParallel& ZeroOptimizer::ddp() { return *impl_->ddp; }
const Group& ZeroOptimizer::group() const { return impl_->group; }
const ZeroOptimizerOptions& ZeroOptimizer::options() const { return impl_->options; }

std::vector<ZeroShardInfo> ZeroOptimizer::shards() const {
  std::vector<ZeroShardInfo> out;
  for (const auto& s : impl_->shards) out.push_back(s.info);
  return out;
}

int64_t ZeroOptimizer::state_bytes() const {
  int64_t bytes = 0;  // master weights count as optimizer state
  for (const auto& s : impl_->shards) {
    if (auto state = impl_->state_of(s)) {
      for (const auto& entry : state->tensors) bytes += bytes_of(entry.second);
    }
  }
  return bytes;
}

int64_t ZeroOptimizer::gradient_bytes() const {
  int64_t bytes = 0;
  for (const auto& s : impl_->shards) {
    // ZeRO-1: DDP's buckets (the shards' gradients are aliases of them).
    bytes += impl_->options.stage() == 1 ? s.info.padded_numel * static_cast<int64_t>(c10::elementSize(s.grad_dtype))
                                         : bytes_of(s.grad);
  }
  return bytes;
}

}  // namespace commgrad::optim
