#pragma once
// One unit of fully_shard and the tree of units it belongs to (internal; the
// mechanism is described in include/commgrad/fsdp/fully_shard.h).

#include "commgrad/detail/torch_compat.h"
#include "commgrad/fsdp/fully_shard.h"
#include "commgrad/ops/raw.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace commgrad::fsdp::detail {

// The op named in fully_shard's errors.
constexpr const char* kFullyShardOp = "fully_shard";

class Unit;

/// What the units of one tree share: the order they ran in, whether
/// backward reduces, the end-of-backward callback, the statistics.
struct Tree {
  std::vector<Unit*> units;       // innermost first; the last is the root
  std::vector<Unit*> order;       // first forward of each unit since the last synchronised backward
  std::vector<Unit*> last_order;  // the order of the previous step (forward prefetch)
  std::vector<Unit*> launched;    // reduce-scatters of this backward, in launch order
  bool sync = true;
  bool callback_queued = false;
  int depth = 0;           // nesting of fsdp::call
  int64_t forward_id = 0;  // outermost calls so far
  StepStats current, last;

  Unit* root() const { return units.empty() ? nullptr : units.back(); }
};

/// One parameter of a unit.
struct Param {
  std::string name;  // named_parameters() name in the unit's module
  torch::nn::Module* owner = nullptr;
  std::string key;                       // its name among owner's own parameters
  at::Tensor compute;                    // the tensor the module's code reads
  at::Tensor view;                       // the parameter's shape in the gathered buffer
  int64_t offset = 0, numel = 0;         // in the flat (gathered) buffer
  int64_t shard_offset = 0, length = 0;  // this rank's part, in the shard
  int64_t param_begin = 0;               // its first element of the parameter
  at::Tensor piece;                      // registered in the module in place of `compute`
  bool requires_grad = false;
  Group partial_group;  // sequence parallelism: its gradient is summed over this TP group first
  commgrad::detail::NodePtr accumulator;
  uintptr_t hook_key = 0;
  bool ready = false;
  at::Tensor tripwire;  // while armed: the one element `compute` holds (0 until an optimizer steps it)
};

class Unit : public std::enable_shared_from_this<Unit> {
 public:
  Unit(const std::shared_ptr<torch::nn::Module>& module, FullyShardOptions options,
       const std::vector<std::shared_ptr<Unit>>& inner);
  ~Unit();
  Unit(const Unit&) = delete;
  Unit& operator=(const Unit&) = delete;

  /// Installs the gradient hooks (after construction: they hold a weak_ptr).
  void install_hooks();

  // Forward (unit.cpp).
  void before_forward();
  std::vector<at::Tensor> after_forward(std::vector<at::Tensor> outputs);
  void abandon_forward() noexcept;
  at::Tensor cast_input(const at::Tensor& input) const;

  // Backward (backward.cpp).
  void before_backward();
  void on_gradient(size_t param);
  /// Before a gradient accumulates into a resharded unit's parameter (a
  /// deferred weight gradient of a zero-bubble schedule's W): gives the
  /// compute tensor its shape (over the freed buffer: nothing reads it) so
  /// that autograd accumulates a gradient of that shape; on_gradient puts
  /// the empty tensor back.
  void before_accumulate(size_t param);
  /// Packs the gradients (zeros for the missing) and starts the reduce-scatter.
  void launch_reduction();
  /// Waits for the reduce-scatter and adds the result to the pieces' grads.
  void finish_reduction();
  /// Resets what one backward set.
  void end_backward();
  /// After a synchronised backward: gives each compute tensor without a
  /// gradient one element (0) and a gradient (1), so that an optimizer built
  /// over the parameters before fully_shard changes that element instead
  /// of silently skipping the parameter; check_tripwires() at the next
  /// forward notices and puts the empty tensor back.
  void arm_tripwires();
  void check_tripwires();

  // Storage (unit.cpp).
  void unshard();
  void reshard();
  void start_gather(bool prefetch);
  /// Waits for a gather nobody will use (its values may be stale).
  void drop_gather();

  std::shared_ptr<Tree>& tree() { return tree_; }
  const std::shared_ptr<Tree>& tree() const { return tree_; }
  const Group& group() const { return group_; }
  const FullyShardOptions& options() const { return options_; }
  const std::vector<Param>& params() const { return params_; }
  std::vector<Param>& params() { return params_; }
  const std::shared_ptr<torch::nn::Module> module() const { return module_.lock(); }
  const torch::nn::Module* module_address() const { return module_address_; }
  bool is_root() const { return tree_->root() == this; }
  UnitInfo info(const std::string& name) const;
  int64_t parameter_bytes() const;
  int64_t gradient_bytes() const;
  /// The shard (flat, the parameters' own dtype); pieces alias it.
  const at::Tensor& shard() const { return shard_; }
  int64_t numel() const { return numel_; }
  int64_t padded_numel() const { return padded_; }
  bool unsharded() const { return unsharded_; }
  void set_pending_payload(at::Tensor payload) { payload_ = std::move(payload); }

 private:
  void collect(const std::shared_ptr<torch::nn::Module>& module, const std::vector<std::shared_ptr<Unit>>& inner);
  void make_equal_everywhere();
  void lay_out();
  void register_pieces();
  void adopt(at::Tensor gathered);
  void free_storage();
  void check_not_replaced() const;
  void post_backward();
  at::Tensor pack_gradients();
  void sum_partial_gradients(at::Tensor& payload) const;

  std::weak_ptr<torch::nn::Module> module_;
  const torch::nn::Module* module_address_ = nullptr;
  FullyShardOptions options_;
  Group group_;
  std::shared_ptr<Tree> tree_;
  std::vector<Param> params_;
  at::ScalarType dtype_ = at::kFloat;  // the parameters' own (shard) dtype
  at::ScalarType compute_dtype_ = at::kFloat;
  at::ScalarType reduce_dtype_ = at::kFloat;
  double pre_divide_ = 1, post_divide_ = 1;  // the average, before and after the sum
  int64_t numel_ = 0, padded_ = 0, shard_numel_ = 0;
  size_t trainable_ = 0;  // parameters that require grad
  bool has_frozen_ = false;
  at::Tensor shard_;  // this rank's part of the flat parameters
  at::Tensor full_;   // the gathered buffer, its storage freed when resharded
  at::Tensor empty_;  // what the compute tensors hold while resharded
  ops::raw::Pending gather_, reduction_;
  at::Tensor payload_;  // packed gradients waiting for their launch
  bool unsharded_ = false;
  bool in_order_ = false;  // in tree_->order this step
  int64_t last_forward_id_ = -1;
  size_t ready_ = 0;  // parameters whose gradient arrived this backward
  bool packed_ = false, launched_ = false;
};

/// A tensor of `sizes` over `base`'s storage at `offset` (elements), not an
/// autograd view: it can become a parameter's data or gradient, and the
/// storage's data can change under it.
at::Tensor alias(const at::Tensor& base, int64_t offset, at::IntArrayRef sizes);

/// The autograd node before a unit's outputs: all-gathers the unit's
/// parameters when backward reaches them (FSDP's pre-backward hook).
void route_through_pre_backward(Unit& unit, std::vector<at::Tensor>& outputs);

/// Queues the tree's end-of-backward callback once per backward.
void ensure_end_of_backward(const std::shared_ptr<Tree>& tree);

}  // namespace commgrad::fsdp::detail
