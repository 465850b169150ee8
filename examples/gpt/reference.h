#pragma once
// The GPT of model.h on one process, written for `gpt_train --check` with
// LibTorch's tensor functions and torch::optim alone: no commgrad layer,
// wrapper, optimizer, group or collective. The parallel run is compared with
// it, so a mistake that does not depend on the group size (a wrong divisor,
// a gradient summed once too often) cannot cancel as it would against the
// same code run at world 1.
//
// It holds each parameter whole, by the name the parallel model gives it
// ("layer3.attention.qkv.weight"; experts by their global index,
// "layer1.mlp.experts.expert2.fc1.weight"), starts from the parallel
// model's initial weights (gathered, examples/gpt/gathered.h), and trains
// the global batch in one pass: embedding plus positions, pre-LayerNorm
// blocks (textbook causal attention over the whole sequence, an erf-GELU MLP
// or, for MoE layers, a dense loop over the experts each token chose), the
// final norm, the tied output layer, cross entropy over every token; then
// the global gradient norm, clipping at 1 and AdamW. Under bf16 every
// weight is cast to bfloat16 where it is used (float32 masters, as the
// parallel run keeps); the loss is taken in float32.
//
// Under fp16 the same in float16, with dynamic loss scaling written out:
// the loss times the scale S goes backward, the float32 gradients are
// multiplied by 1/S (as float32), a step with any inf/NaN is skipped (no
// clipping, no update) and, after `hysteresis` (2) such steps in a row
// since the last growth, every further one halves S (not below 1); S
// doubles after `growth_interval` (1000) good steps in a row: the defaults
// of commgrad's DynamicLossScalerOptions, which the Trainer keeps.
//
// MoE layers (softmax scores, top-k, no renormalisation, dropless): the
// per-sequence load-balancing loss (Switch, f_i and P_i over each
// sequence's tokens, the mean over sequences, times coeff * E) joins the
// gradient, not the logged loss, as the parallel layer injects it.

#include "gpt/model.h"

#include <torch/torch.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace gpt {

/// Whole tensors by parameter name.
using NamedTensors = std::map<std::string, torch::Tensor>;

/// The names and whole shapes of the parameters of the model `config`
/// describes (the tied model: no "output.weight").
std::map<std::string, std::vector<int64_t>> parameter_shapes(const GptConfig& config);

/// What of `config` the reference does not model ("the z-loss", ...), or
/// empty when it models all of it: softmax top-k routing with the
/// per-sequence balancing loss, dropless.
std::string unmodelled(const GptConfig& config);

/// What a reference step gave.
struct ReferenceStep {
  double loss = 0;       ///< cross entropy, the mean over every token of the batch
  double grad_norm = 0;  ///< the global L2 norm of the gradients, before clipping (NaN when skipped)
  bool skipped = false;  ///< fp16: the loss scaler found inf/NaN and skipped the update
};

class ReferenceGpt {
 public:
  /// `initial`: a whole tensor for every name of parameter_shapes(config)
  /// (copied into float32 masters). `compute_dtype`: bfloat16, or none for
  /// float32; float16 with loss scaling from `loss_scale` (its initial
  /// scale). Errors on a missing or misshapen weight, and on what the
  /// reference does not model (sigmoid scores, top-k renormalisation,
  /// z-loss, expert bias, a capacity).
  ReferenceGpt(const GptConfig& config, const NamedTensors& initial, c10::optional<at::ScalarType> compute_dtype,
               double loss_scale = 65536.0);

  /// One step on the global batch (token ids and targets [B, s]): forward,
  /// backward, clipping at max_grad_norm, AdamW(lr, weight decay).
  ReferenceStep step(const torch::Tensor& ids, const torch::Tensor& targets);

  /// The parameters (float32 masters).
  const NamedTensors& parameters() const { return params_; }
  /// The gradients of the last step, before clipping.
  const NamedTensors& gradients() const { return grads_; }
  /// fp16: the loss scale the next step uses (1 otherwise).
  double loss_scale() const { return scale_; }
  /// Elementwise, the smallest |gradient| (before clipping) of every step so far.
  const NamedTensors& smallest_gradients() const { return smallest_; }

 private:
  torch::Tensor weight(const std::string& name) const;
  torch::Tensor forward(const torch::Tensor& ids, torch::Tensor& aux_loss) const;
  torch::Tensor attention(const std::string& prefix, const torch::Tensor& x) const;
  torch::Tensor mlp(const std::string& prefix, const torch::Tensor& x) const;
  torch::Tensor experts(const std::string& prefix, const torch::Tensor& x, torch::Tensor& aux_loss) const;
  double clip_gradients();
  bool unscale_and_check();
  void update_scale(bool found_inf);

  GptConfig config_;
  c10::optional<at::ScalarType> dtype_;
  NamedTensors params_;
  NamedTensors grads_;
  NamedTensors smallest_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  // fp16's loss scaler.
  double scale_ = 1.0;
  int64_t good_steps_ = 0;
  int64_t hysteresis_left_ = 2;
};

}  // namespace gpt
