// fully_shard(): which module is a unit (a registry keyed by the module,
// valid while the module lives), how units join into trees, and the
// handle's operations over a tree (clipping, state dicts, statistics).

#include "commgrad/fsdp/fully_shard.h"

#include "commgrad/dist/check.h"
#include "commgrad/dist/parallel_state.h"
#include "commgrad/ops/raw.h"
#include "commgrad/optim/clip_grad.h"
#include "commgrad/tp/sharding.h"
#include "commgrad/tp/wiring_checks.h"
#include "detail/unit.h"

#include <ATen/ATen.h>

#include <cmath>
#include <mutex>
#include <unordered_map>

namespace commgrad::fsdp {
namespace detail {
namespace {

struct Entry {
  std::weak_ptr<torch::nn::Module> module;
  std::shared_ptr<Unit> unit;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<const torch::nn::Module*, Entry> units;
};

Registry& registry() {
  static Registry r;
  return r;
}

// The units in `module`'s tree below it, and the trees they head.
std::vector<std::shared_ptr<Unit>> inner_units(const torch::nn::Module& module) {
  std::vector<std::shared_ptr<Unit>> inner;
  for (const auto& m : module.modules(/*include_self=*/false)) {
    if (auto u = unit_of(*m)) inner.push_back(std::move(u));
  }
  return inner;
}

// Every unit of the trees of `inner`, innermost first, then `root`.
std::shared_ptr<Tree> join(const std::vector<std::shared_ptr<Unit>>& inner, Unit& root) {
  auto tree = std::make_shared<Tree>();
  for (const auto& u : inner) {
    for (Unit* member : u->tree()->units) {
      if (std::find(tree->units.begin(), tree->units.end(), member) == tree->units.end()) {
        tree->units.push_back(member);
      }
    }
  }
  tree->units.push_back(&root);
  for (Unit* member : tree->units) member->tree() = tree;
  return tree;
}

}  // namespace

std::shared_ptr<Unit> unit_of(const torch::nn::Module& module) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.units.find(&module);
  if (it == r.units.end()) return nullptr;
  if (it->second.module.expired()) {  // another module at a freed one's address
    r.units.erase(it);
    return nullptr;
  }
  return it->second.unit;
}

void before_forward(Unit& unit) { unit.before_forward(); }
std::vector<at::Tensor> after_forward(Unit& unit, std::vector<at::Tensor> outputs) {
  return unit.after_forward(std::move(outputs));
}
void abandon_forward(Unit& unit) noexcept { unit.abandon_forward(); }
at::Tensor cast_input(Unit& unit, const at::Tensor& input) { return unit.cast_input(input); }

}  // namespace detail

FullyShardedModule fully_shard(const std::shared_ptr<torch::nn::Module>& module, FullyShardOptions options) {
  TORCH_CHECK_VALUE(module != nullptr, "[commgrad] fully_shard: the module is null");
  TORCH_CHECK_VALUE(detail::unit_of(*module) == nullptr, "[commgrad] fully_shard: the module (", module->name(),
                    ") is already a unit");
  const Group group = options.group().defined() ? options.group() : default_data_parallel_group();
  tp::check_data_parallel_group(*module, group, "fully_shard", "FullyShardOptions(group)");
  tp::check_data_parallel_group(*module, options.replicate_group(), "fully_shard",
                                "FullyShardOptions().replicate_group(group)");
  if (!options.replicate_group().defined())
    tp::check_context_parallel_replicas(*module, group, "fully_shard", "FullyShardOptions(group)");
  const auto inner = detail::inner_units(*module);
  auto unit = std::make_shared<detail::Unit>(module, std::move(options), inner);
  detail::join(inner, *unit);
  unit->install_hooks();  // while the parameters are whole (the accumulators record their shapes)
  unit->reshard();
  {
    auto& r = detail::registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (auto it = r.units.begin(); it != r.units.end();) {
      it = it->second.module.expired() ? r.units.erase(it) : std::next(it);
    }
    r.units[module.get()] = detail::Entry{module, unit};
  }
  return FullyShardedModule(unit);
}

// ~~~ FullyShardedModule ~~~

namespace {

// Each unit of the tree with the name of its module in the root's tree.
std::vector<std::pair<detail::Unit*, std::string>> named_units(const detail::Unit& unit) {
  const detail::Unit& root = *unit.tree()->root();
  std::unordered_map<const torch::nn::Module*, std::string> names;
  if (auto m = root.module()) {
    for (const auto& item : m->named_modules("", /*include_self=*/true)) names[item.value().get()] = item.key();
  }
  std::vector<std::pair<detail::Unit*, std::string>> out;
  for (detail::Unit* u : root.tree()->units) out.emplace_back(u, names[u->module_address()]);
  return out;
}

std::string joined(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

}  // namespace

FullyShardedModule::FullyShardedModule(std::shared_ptr<detail::Unit> unit) : unit_(std::move(unit)) {}

void FullyShardedModule::set_requires_gradient_sync(bool sync) { unit_->tree()->sync = sync; }

FullyShardedModule::NoSync FullyShardedModule::no_sync() { return NoSync(unit_); }

FullyShardedModule::NoSync::NoSync(std::shared_ptr<detail::Unit> unit) : unit_(std::move(unit)) {
  previous_ = unit_->tree()->sync;
  unit_->tree()->sync = false;
}

FullyShardedModule::NoSync::NoSync(NoSync&& other) noexcept
    : unit_(std::move(other.unit_)), previous_(other.previous_) {}

FullyShardedModule::NoSync::~NoSync() {
  if (unit_) unit_->tree()->sync = previous_;
}

void FullyShardedModule::finish_gradients() {
  at::NoGradGuard no_grad;
  for (detail::Unit* u : unit_->tree()->units) {
    const Group& tied = u->options().tied_group();
    if (!tied.defined() || tied.size() == 1 || u->params().empty()) continue;
    auto flat = at::zeros({u->shard().numel()}, u->shard().options());
    for (const auto& p : u->params()) {
      if (p.piece.grad().defined()) flat.narrow(0, p.shard_offset, p.length).copy_(p.piece.grad());
    }
    flat = ops::raw::all_reduce(flat, ops::AllReduceOptions().op(ReduceOp::kSum), tied).wait();
    for (auto& p : u->params()) {
      if (!p.requires_grad) continue;
      at::Tensor& g = p.piece.mutable_grad();
      if (g.defined()) {
        g.copy_(flat.narrow(0, p.shard_offset, p.length));
      } else {
        g = flat.narrow(0, p.shard_offset, p.length).clone();
      }
    }
  }
}

double FullyShardedModule::clip_grad_norm_(double max_norm, const Group& tensor_parallel_given,
                                           const Group& pipeline_parallel_given) {
  TORCH_CHECK_VALUE(max_norm > 0, "[commgrad] fully_shard clip_grad_norm_: max_norm must be positive, got ", max_norm);
  const auto root = unit_->tree()->root()->module();
  const auto specs = tp::shard_specs(*root);
  // Groups not given come from the layout, and the TP group from the
  // module's partitioned parameters when the layout has none.
  const Group tensor_parallel = tp::tensor_parallel_group_for_norm(
      *root, tensor_parallel_given.defined() ? tensor_parallel_given : default_tensor_parallel_group(),
      "fully_shard clip_grad_norm_");
  const Group pipeline_parallel =
      pipeline_parallel_given.defined() ? pipeline_parallel_given : default_pipeline_parallel_group();
  const bool tp = tensor_parallel.defined() && tensor_parallel.size() > 1;
  double replicated = 0, partitioned = 0;
  const Group& outer = unit_->tree()->root()->group();  // the outermost unit's
  for (const auto& [u, prefix] : named_units(*unit_)) {
    const Group& tied = u->options().tied_group();
    if (tied.defined() && tied.rank() > 0) continue;  // the copy on the first rank of the tied group counts
    // Experts: their shards summed over the outer group count each expert once.
    COMMGRAD_CHECK(u->group().size() <= outer.size() && outer.size() % u->group().size() == 0,
                   "fully_shard clip_grad_norm_", u->group(), "the unit of '", prefix,
                   "' is sharded over a group whose size does not divide the outermost unit's group (size ",
                   outer.size(), "): its shards cannot be counted once");
    for (const auto& p : u->params()) {
      if (!p.piece.grad().defined()) continue;
      const auto* spec = specs.find(joined(prefix, p.name));
      const bool split = tp && spec != nullptr && spec->spec.is_partitioned();
      (split ? partitioned : replicated) += optim::squared_norm(p.piece.grad());
    }
  }
  auto sums = at::tensor({replicated, partitioned}, at::kDouble);
  sums = ops::raw::all_reduce(sums, ops::AllReduceOptions().op(ReduceOp::kSum), outer).wait();
  double total = sums[0].item<double>();
  double split = sums[1].item<double>();
  if (tp) {
    split = ops::raw::all_reduce(at::full({1}, split, at::kDouble), {}, tensor_parallel).wait().item<double>();
  }
  total += split;
  if (pipeline_parallel.defined() && pipeline_parallel.size() > 1) {
    total = ops::raw::all_reduce(at::full({1}, total, at::kDouble), {}, pipeline_parallel).wait().item<double>();
  }
  const double norm = std::sqrt(total);
  const float coef = optim::clip_coefficient(norm, max_norm);
  if (coef < 1.0f) {
    at::NoGradGuard no_grad;
    for (detail::Unit* u : unit_->tree()->units) {
      for (const auto& p : u->params()) {
        if (p.piece.grad().defined()) p.piece.grad().mul_(coef);
      }
    }
  }
  return norm;
}

torch::OrderedDict<std::string, at::Tensor> FullyShardedModule::full_state_dict() {
  torch::OrderedDict<std::string, at::Tensor> out;
  for (const auto& [u, prefix] : named_units(*unit_)) {
    if (u->params().empty()) continue;
    const at::Tensor flat = ops::raw::all_gather(u->shard(), ops::AllGatherOptions().dim(0), u->group()).wait();
    for (const auto& p : u->params()) {
      out.insert(joined(prefix, p.name), flat.narrow(0, p.offset, p.numel).reshape(p.view.sizes()).clone());
    }
  }
  return out;
}

void FullyShardedModule::load_full_state_dict(const torch::OrderedDict<std::string, at::Tensor>& full) {
  at::NoGradGuard no_grad;
  for (const auto& [u, prefix] : named_units(*unit_)) {
    for (auto& p : u->params()) {
      const std::string name = joined(prefix, p.name);
      const auto* value = full.find(name);
      COMMGRAD_CHECK(value != nullptr, "fully_shard load_full_state_dict", u->group(), "the state dict has no '", name,
                     "'");
      COMMGRAD_CHECK(value->numel() == p.numel, "fully_shard load_full_state_dict", u->group(), "'", name, "' has ",
                     value->numel(), " elements in the state dict, the parameter ", p.numel);
      p.piece.copy_(value->reshape({-1}).narrow(0, p.param_begin, p.length));
    }
  }
}

std::vector<UnitInfo> FullyShardedModule::units() const {
  std::vector<UnitInfo> out;
  for (const auto& [u, prefix] : named_units(*unit_)) out.push_back(u->info(prefix));
  return out;
}

std::shared_ptr<torch::nn::Module> FullyShardedModule::module() const { return unit_->tree()->root()->module(); }
const Group& FullyShardedModule::group() const { return unit_->group(); }
const FullyShardOptions& FullyShardedModule::options() const { return unit_->options(); }
StepStats FullyShardedModule::last_step() const { return unit_->tree()->last; }

int64_t FullyShardedModule::parameter_bytes() const {
  int64_t bytes = 0;
  for (detail::Unit* u : unit_->tree()->units) bytes += u->parameter_bytes();
  return bytes;
}

int64_t FullyShardedModule::gradient_bytes() const {
  int64_t bytes = 0;
  for (detail::Unit* u : unit_->tree()->units) bytes += u->gradient_bytes();
  return bytes;
}

}  // namespace commgrad::fsdp
