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

#include "commgrad/optim/zero_optimizer.h"

#include "commgrad/dist/check.h"
#include "commgrad/dist/parallel_state.h"
#include "commgrad/ops/raw.h"
#include "commgrad/optim/clip_grad.h"
#include "commgrad/tp/sharding.h"
#include "commgrad/tp/wiring_checks.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

namespace commgrad::optim {
namespace {

constexpr const char* kOp = "ZeroOptimizer";
constexpr const char* kMaster = "master";  // the state name of float32 master weights

// A contiguous alias of `numel` elements of `buffer` at `offset`, shaped
// `sizes` (not an autograd view, like DDP's bucket slots).
at::Tensor alias(const at::Tensor& buffer, int64_t offset, at::IntArrayRef sizes) {
  auto out = at::empty({0}, buffer.options());
  out.set_(buffer.storage(), buffer.storage_offset() + offset, sizes);
  return out;
}

int64_t bytes_of(const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; }

}  // namespace

struct ZeroOptimizer::Impl {
  struct Shard {
    ZeroShardInfo info;
    int64_t chunk = 0;
    std::vector<std::string> names;  // the bucket's parameters, in slot order
    std::vector<int64_t> offsets;    // their offsets in the bucket
    at::Tensor params;               // the bucket's flat parameter buffer (padded)
    at::Tensor master;               // this rank's range of it, or a float32 copy (the inner optimizer's parameter)
    bool separate_master = false;    // master is a float32 copy of a 16-bit range
    at::ScalarType state_dtype;      // of master, gradient and state (the same on every rank)
    at::Tensor grad;                 // this rank's averaged gradient of the range (the bucket's dtype;
                                     // ZeRO-1: an alias of DDP's bucket buffer)
    std::vector<char> counted;       // per segment: part of the global norm on this rank
    std::vector<char> partial;       // per segment: a partial_grad parameter, summed over TP in step()
    bool tied = false;               // the bucket of a tied parameter, summed over the tied group in step()
    bool fresh = false;              // reduced since the last step
  };

  std::shared_ptr<torch::nn::Module> module;
  ZeroOptimizerOptions options;
  std::map<std::string, at::Tensor> params;  // by name
  std::vector<Shard> shards;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<dp::DistributedDataParallel> ddp;  // last: its hook refers to the shards
  Group group;
  Group partial_group;  // the TP group of partial_grad (sequence-parallel) parameters

  void build_shards();
  void check_tied() const;
  void sum_partial_gradients();
  void sum_tied_gradients();
  void install_hook();
  double local_squares(bool master) const;
  double clip();
  void all_gather_parameters();
  Shard* shard_with(const std::string& param, int64_t param_begin, size_t* segment);
  /// The state of a shard's range: the inner optimizer's, plus "master" for
  /// float32 master weights; nullopt before the first step.
  std::optional<ParamState> state_of(const Shard& s) const;
};

std::optional<ParamState> ZeroOptimizer::Impl::state_of(const Shard& s) const {
  if (!s.master.defined()) return std::nullopt;
  auto state = get_param_state(*optimizer, s.master);
  if (state && s.separate_master) state->tensors.emplace_back(kMaster, s.master);
  return state;
}

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
  m.options.tensor_parallel_group(tp::tensor_parallel_group_for_norm(*m.module, given_tp, kOp));
  tp::check_data_parallel_group(*m.module, m.options.ddp().group(), kOp, "ZeroOptimizerOptions(group)");
  if (!m.options.pipeline_parallel_group().defined()) {
    m.options.pipeline_parallel_group(default_pipeline_parallel_group());
  }
  const Group group = m.options.ddp().group();
  for (const auto& name : m.options.tied_parameters()) {
    const auto* p = m.module->named_parameters().find(name);
    COMMGRAD_CHECK(p != nullptr && p->requires_grad(), kOp, group, "tied parameter '", name,
                   "' is not a trainable parameter of the module");
  }
  auto ddp_options = m.options.ddp();
  auto own_bucket = ddp_options.own_bucket();
  own_bucket.insert(own_bucket.end(), m.options.tied_parameters().begin(), m.options.tied_parameters().end());
  ddp_options.group(group)
      .own_bucket(own_bucket)
      .bucket_multiple(group.size())
      .release_gradients(m.options.stage() == 2)
      .gradient_as_bucket_view(m.options.stage() == 1);
  m.ddp = std::make_unique<dp::DistributedDataParallel>(m.module, ddp_options);
  m.group = m.ddp->group();
  for (const auto& item : m.module->named_parameters()) {
    if (item.value().requires_grad()) m.params[item.key()] = item.value();
  }
  for (const auto& [name, p] : m.params) {
    COMMGRAD_CHECK(p.is_floating_point(), kOp, m.group, "parameter '", name, "' is ", tensor_name(p),
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
    const bool sixteen_bit = bucket.dtype == at::kHalf || bucket.dtype == at::kBFloat16;
    s.state_dtype = options.float32_master() && sixteen_bit ? at::kFloat : bucket.dtype;
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
      s.separate_master = s.state_dtype != bucket.dtype;
      s.master = s.separate_master ? s.params.narrow(0, s.info.begin, len).to(at::kFloat)
                                   : alias(s.params, s.info.begin, {len});
      if (options.stage() == 2) s.grad = at::zeros({len}, s.params.options());  // ZeRO-1: set by the hook
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
    if (bucket.group().size() == 1) {  // the bucket is the result: no copy for ZeRO-1, one for ZeRO-2
      const auto buffer = bucket.buffer();
      return dp::CommWork{{}, [buffer, &s, len] {
                            if (len > 0 && !s.grad.is_alias_of(buffer)) s.grad.copy_(buffer.narrow(0, 0, len));
                            s.fresh = true;
                          }};
    }
    auto pending = ops::raw::reduce_scatter(bucket.buffer(), {}, bucket.group());
    return dp::CommWork{pending, [pending, &s, len]() mutable {
                          const auto part = pending.wait();
                          if (len > 0) s.grad.copy_(part.narrow(0, 0, len));
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
  COMMGRAD_CHECK(tied.defined(), kOp, group, "tied_parameters are named ('", names.front(),
                 "', ...) but tied_group is not set");
  if (tied.size() == 1) return;
  // Every copy: the same data-parallel rank and size, and the same shapes.
  std::vector<int64_t> mine{group.rank(), group.size(), static_cast<int64_t>(names.size())};
  for (const auto& name : names) mine.push_back(params.at(name).numel());
  const auto local = at::tensor(mine, at::kLong);
  const auto local_count = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  const auto counts = ops::raw::all_gather(local_count, {}, tied).wait();
  COMMGRAD_CHECK(counts.eq(counts[0]).all().item<bool>(), kOp, tied, "the ranks of the tied group name ",
                 "different numbers of tied parameters (this rank ", names.size(), ")");
  const auto all = ops::raw::all_gather(local, {}, tied).wait().view({tied.size(), -1});
  const at::IntArrayRef my_numels = at::IntArrayRef(mine).slice(3);
  for (int r = 0; r < tied.size(); ++r) {
    const auto theirs = all[r].contiguous();
    const auto* v = theirs.data_ptr<int64_t>();
    COMMGRAD_CHECK(theirs.equal(local), kOp, tied, "the tied parameters ('", names.front(),
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

double ZeroOptimizer::step() {
  auto& m = *impl_;
  at::NoGradGuard no_grad;
  for (size_t b = 0; b < m.shards.size(); ++b) {
    COMMGRAD_CHECK(m.shards[b].fresh, kOp, m.group, "step() without a synchronised backward since the last step ",
                   "(bucket ", b, " of ", m.shards.size(),
                   " was not reduced: call backward() outside no_sync() before step())");
  }
  // The inner parameters' gradients: the shards' own, or float32 copies
  // for float32 masters (kept only during the step).
  for (auto& s : m.shards) {
    if (s.master.defined()) s.master.mutable_grad() = s.separate_master ? s.grad.to(at::kFloat) : s.grad;
  }
  m.sum_partial_gradients();
  m.sum_tied_gradients();
  const double norm = m.options.max_grad_norm() > 0 ? m.clip() : -1.0;
  m.optimizer->step();
  for (auto& s : m.shards) {
    if (!s.separate_master) continue;
    s.params.narrow(0, s.info.begin, s.master.numel()).copy_(s.master);  // rounds
    s.master.mutable_grad() = at::Tensor();
  }
  m.all_gather_parameters();
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
    bytes += impl_->options.stage() == 1 ? s.info.padded_numel * static_cast<int64_t>(s.params.element_size())
                                         : bytes_of(s.grad);
  }
  return bytes;
}

std::vector<ZeroOptimizer::StateShard> ZeroOptimizer::state_shards() const {
  std::vector<StateShard> out;
  for (const auto& s : impl_->shards) {
    const auto state = impl_->state_of(s);
    if (!state) continue;
    for (const auto& seg : s.info.segments) {
      for (const auto& [name, tensor] : state->tensors) {
        out.push_back({seg.name, name, seg.param_begin, tensor.narrow(0, seg.shard_offset, seg.length)});
      }
    }
  }
  return out;
}

std::vector<std::string> ZeroOptimizer::state_names() {
  auto names = param_state_names(*impl_->optimizer);
  const bool masters = std::any_of(impl_->shards.begin(), impl_->shards.end(),
                                   [](const Impl::Shard& s) { return s.state_dtype != s.params.scalar_type(); });
  if (masters) names.push_back(kMaster);
  return names;
}

int64_t ZeroOptimizer::step_count() const {
  for (const auto& s : impl_->shards) {
    if (auto state = impl_->state_of(s)) return state->step.value_or(0);
  }
  return 0;
}

ZeroOptimizer::Impl::Shard* ZeroOptimizer::Impl::shard_with(const std::string& param, int64_t param_begin,
                                                            size_t* segment) {
  for (auto& s : shards) {
    for (size_t i = 0; i < s.info.segments.size(); ++i) {
      if (s.info.segments[i].name == param && s.info.segments[i].param_begin == param_begin) {
        *segment = i;
        return &s;
      }
    }
  }
  return nullptr;
}

void ZeroOptimizer::load_state_shards(const std::vector<StateShard>& shards, int64_t step) {
  auto& m = *impl_;
  at::NoGradGuard no_grad;
  std::map<Impl::Shard*, std::map<std::string, at::Tensor>> states;
  for (const auto& in : shards) {
    size_t i = 0;
    auto* s = m.shard_with(in.param, in.param_begin, &i);
    COMMGRAD_CHECK(s, kOp, m.group, "load_state_shards: no range of this rank starts at element ", in.param_begin,
                   " of parameter '", in.param, "'");
    const auto& seg = s->info.segments[i];
    COMMGRAD_CHECK(in.tensor.numel() == seg.length, kOp, m.group, "load_state_shards: state '", in.state,
                   "' of parameter '", in.param, "' from element ", in.param_begin, " has ", in.tensor.numel(),
                   " elements, but this rank's range of it has ", seg.length);
    if (in.state == kMaster) {
      COMMGRAD_CHECK(s->separate_master, kOp, m.group, "load_state_shards: master weights of parameter '", in.param,
                     "' given, but this optimizer keeps none (float32_master with float16/bfloat16 parameters)");
      s->master.narrow(0, seg.shard_offset, seg.length).copy_(in.tensor.reshape({-1}));
      s->params.narrow(0, s->info.begin + seg.shard_offset, seg.length).copy_(in.tensor.reshape({-1}));
      continue;
    }
    auto& t = states[s][in.state];
    if (!t.defined()) t = at::zeros({s->info.end - s->info.begin}, s->master.options());
    t.narrow(0, seg.shard_offset, seg.length).copy_(in.tensor.reshape({-1}));
  }
  for (auto& [s, tensors] : states) {
    ParamState state;
    for (auto& [name, t] : tensors) state.tensors.emplace_back(name, t);
    state.step = step;
    set_param_state(*m.optimizer, s->master, state);
  }
}

torch::OrderedDict<std::string, at::Tensor> ZeroOptimizer::full_state_dict() {
  auto& m = *impl_;
  at::NoGradGuard no_grad;
  const auto names = state_names();
  torch::OrderedDict<std::string, at::Tensor> out;
  // Which state tensors exist anywhere (a rank with empty ranges has none).
  auto present = at::zeros({static_cast<int64_t>(names.size()) + 1}, at::kLong);
  for (const auto& s : m.shards) {
    if (auto state = m.state_of(s)) {
      for (size_t k = 0; k < names.size(); ++k) {
        for (const auto& entry : state->tensors) {
          if (entry.first == names[k]) present[k] = 1;
        }
      }
      present[names.size()] = std::max<int64_t>(present[names.size()].item<int64_t>(), state->step.value_or(0));
    }
  }
  ops::raw::all_reduce_(present, ops::AllReduceOptions().op(ReduceOp::kMax), m.group).wait();
  for (size_t k = 0; k < names.size(); ++k) {
    if (present[k].item<int64_t>() == 0) continue;
    for (auto& s : m.shards) {
      // Every rank's ranges of a bucket share one dtype (the master's).
      auto mine = at::zeros({s.chunk}, s.params.options().dtype(s.state_dtype));
      if (auto state = m.state_of(s)) {
        for (const auto& entry : state->tensors) {
          if (entry.first == names[k]) mine.narrow(0, 0, entry.second.numel()).copy_(entry.second);
        }
      }
      const auto full = ops::raw::all_gather(mine, {}, m.group).wait();
      for (size_t i = 0; i < s.names.size(); ++i) {
        const auto& p = m.params.at(s.names[i]);
        out.insert(s.names[i] + "/" + names[k], full.narrow(0, s.offsets[i], p.numel()).view(p.sizes()).clone());
      }
    }
  }
  out.insert("step", at::scalar_tensor(present[names.size()].item<int64_t>(), at::kLong));
  return out;
}

void ZeroOptimizer::load_full_state_dict(const torch::OrderedDict<std::string, at::Tensor>& full) {
  auto& m = *impl_;
  const auto names = state_names();
  const auto* step = full.find("step");
  COMMGRAD_CHECK(step, kOp, m.group, "load_full_state_dict: no 'step' entry");
  std::vector<StateShard> mine;
  for (const auto& s : m.shards) {
    for (const auto& seg : s.info.segments) {
      for (const auto& name : names) {
        const auto* t = full.find(seg.name + "/" + name);
        if (!t || (name == kMaster && !s.separate_master)) continue;
        const auto& p = m.params.at(seg.name);
        COMMGRAD_CHECK(t->numel() == p.numel(), kOp, m.group, "load_full_state_dict: '", seg.name, "/", name, "' is ",
                       tensor_name(*t), ", but the parameter is ", tensor_name(p));
        mine.push_back({seg.name, name, seg.param_begin, t->reshape({-1}).narrow(0, seg.param_begin, seg.length)});
      }
    }
  }
  load_state_shards(mine, step->item<int64_t>());
}

torch::OrderedDict<std::string, at::Tensor> unsharded_state_dict(const torch::nn::Module& module,
                                                                 torch::optim::Optimizer& optimizer) {
  torch::OrderedDict<std::string, at::Tensor> out;
  int64_t step = 0;
  for (const auto& item : module.named_parameters()) {
    const auto state = get_param_state(optimizer, item.value());
    if (!state) continue;
    for (const auto& [name, t] : state->tensors) out.insert(item.key() + "/" + name, t.clone());
    step = std::max(step, state->step.value_or(0));
  }
  out.insert("step", at::scalar_tensor(step, at::kLong));
  return out;
}

}  // namespace commgrad::optim
