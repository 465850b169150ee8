#pragma once
// The experts one rank of an expert-parallel group holds: E / ep small MLPs
// (fc1 -> GELU -> fc2, Switch's expert), run one after the other on the
// tokens the dispatcher sorted by local expert.
//
// A loop over the local experts, not padded batched matmuls: each expert's
// GEMM is [n_e, h] x [h, ffn] with exactly its own n_e tokens (0 included:
// an expert that receives no tokens runs on an empty batch and gets zero
// gradients, so every parameter has a gradient on every step and DDP needs
// no find_unused_parameters). Padding every expert to the largest count
// (one bmm) wastes compute proportional to the imbalance and, with dropless
// routing, has no bound; a grouped GEMM would be the fast form of the loop
// on GPUs. On a CPU rank with one thread the loop is what the GEMMs cost.
//
// Rank r of an ep group holds global experts [r * E/ep, (r + 1) * E/ep).
// Expert e is built from init_linear(h, ffn, bias, seed + 2e) and
// init_linear(ffn, h, bias, seed + 2e + 1) and named "expert<e>" by its
// global index, so the experts, their names and checkpoints do not depend
// on ep: the one-rank layer holds all of them under the same names.

#include "commgrad/dist/group.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <vector>

namespace commgrad::moe {

/// Options of Experts.
///
/// Example:
///   moe::ExpertsOptions(64, 128, 8, ep_group).seed(11)
struct ExpertsOptions {
  ExpertsOptions(int64_t hidden_size, int64_t ffn_hidden_size, int64_t num_experts, Group group)
      : hidden_size_(hidden_size),
        ffn_hidden_size_(ffn_hidden_size),
        num_experts_(num_experts),
        group_(std::move(group)) {}
  TORCH_ARG(int64_t, hidden_size);
  TORCH_ARG(int64_t, ffn_hidden_size);
  /// All experts of the layer (divisible by the group size).
  TORCH_ARG(int64_t, num_experts);
  /// The expert-parallel group that splits them.
  TORCH_ARG(Group, group);
  /// The ranks that split each sequence (sequence parallelism: the TP group;
  /// undefined: none). They hold the same experts and route different
  /// tokens to them, so each expert's parameters enter forward through
  /// tp::copy_to_tp_region, whose backward sums their gradients over the
  /// group: after backward every rank of it holds the whole gradient.
  TORCH_ARG(Group, sequence_parallel_group);
  TORCH_ARG(bool, bias) = true;
  TORCH_ARG(uint64_t, seed) = 0;
};

/// One expert: fc2(gelu(fc1(x))), exact (erf) GELU; fc1 from
/// init_linear(h, ffn, bias, seed), fc2 from init_linear(ffn, h, bias, seed + 1).
///
/// Example:
///   moe::ExpertMLP expert(64, 128, true, 7);
///   auto y = expert(x);   // [n, 64] -> [n, 64]
namespace detail {
/// The size checks Experts and MoELayer share: `op` on the expert-parallel
/// group `g`, positive sizes, experts divisible by the group's size.
void check_expert_sizes(const char* op, const Group& g, int64_t hidden, int64_t ffn, int64_t experts);
}  // namespace detail

class ExpertMLPImpl : public torch::nn::Cloneable<ExpertMLPImpl> {
 public:
  ExpertMLPImpl(int64_t hidden_size, int64_t ffn_hidden_size, bool bias, uint64_t seed);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  at::Tensor forward(const at::Tensor& x);

  torch::nn::Linear fc1{nullptr}, fc2{nullptr};

 private:
  int64_t hidden_size_, ffn_hidden_size_;
  bool bias_;
  uint64_t seed_;
};
TORCH_MODULE(ExpertMLP);

/// This rank's experts (see the file comment).
///
/// Example:
///   moe::Experts experts(moe::ExpertsOptions(64, 128, 8, ep_group).seed(11));
///   auto y = experts(sorted_tokens, {3, 0, 5, 1});   // tokens of local experts 0..3, in that order
class ExpertsImpl : public torch::nn::Cloneable<ExpertsImpl> {
 public:
  explicit ExpertsImpl(ExpertsOptions options);
  void reset() override;
  /// "commgrad::moe::Experts(hidden=64, ffn=128, experts=8, local=[4, 8))".
  void pretty_print(std::ostream& stream) const override;

  /// x: [sum(counts), hidden], the rows of local expert l after those of
  /// l - 1; counts: one per local expert. Returns the experts' outputs in
  /// the same order.
  at::Tensor forward(const at::Tensor& x, const std::vector<int64_t>& counts);

  int64_t num_local_experts() const { return static_cast<int64_t>(local_.size()); }
  /// The global index of this rank's first expert.
  int64_t first_expert() const { return first_; }
  /// Local expert l.
  ExpertMLP& local(int64_t l) { return local_.at(l); }

  ExpertsOptions options;

 private:
  int64_t first_ = 0;
  std::vector<ExpertMLP> local_;
};
TORCH_MODULE(Experts);

}  // namespace commgrad::moe
