#pragma once
// ZeroOptimizer's state (internal): shared by zero_optimizer.cpp (layout,
// backward, step) and zero_state.cpp (the state for checkpoints).

#include "commgrad/optim/zero_optimizer.h"

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace commgrad::optim::detail {

constexpr const char* kZeroOp = "ZeroOptimizer";
constexpr const char* kMaster = "master";  // the state name of float32 master weights

// A contiguous alias of `numel` elements of `buffer` at `offset`, shaped
// `sizes` (not an autograd view, like DDP's bucket slots).
inline at::Tensor alias(const at::Tensor& buffer, int64_t offset, at::IntArrayRef sizes) {
  auto out = at::empty({0}, buffer.options());
  out.set_(buffer.storage(), buffer.storage_offset() + offset, sizes);
  return out;
}

inline int64_t bytes_of(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

}  // namespace commgrad::optim::detail

namespace commgrad::optim {

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
    at::ScalarType grad_dtype;       // of `grad`: the bucket's reduction dtype
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

  std::vector<GradientHook> gradient_hooks;
  bool hooks_ran = false;  // this step's hooks already ran (a clip partner's, from its main optimizer)

  void build_shards();
  void run_gradient_hooks(bool master);
  void check_tied() const;
  void sum_partial_gradients();
  void sum_tied_gradients();
  void install_hook();
  double local_squares(bool master) const;
  double clip();
  bool skip_for_loss_scaler();
  void all_gather_parameters();
  Shard* shard_with(const std::string& param, int64_t param_begin, size_t* segment);
  /// The state of a shard's range: the inner optimizer's, plus "master" for
  /// float32 master weights; nullopt before the first step.
  std::optional<ParamState> state_of(const Shard& s) const;
};

}  // namespace commgrad::optim
