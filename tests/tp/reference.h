#pragma once
// Unsplit references for the tensor-parallel layers, written with plain
// torch::nn modules (not with commgrad::tp at TP = 1), initialised from the
// same seeds through tp::init_linear / tp::init_embedding.

#include <commgrad/tp.h>
#include <torch/torch.h>
#include "harness/expect_error.h"

namespace commgrad::testing {

inline torch::nn::Linear reference_linear(int64_t in, int64_t out, bool bias, uint64_t seed) {
  torch::nn::Linear fc(torch::nn::LinearOptions(in, out).bias(bias));
  const auto w = tp::init_linear(in, out, bias, seed);
  torch::NoGradGuard no_grad;
  fc->weight.copy_(w.weight);
  if (bias) fc->bias.copy_(w.bias);
  return fc;
}

inline torch::nn::Embedding reference_embedding(int64_t vocab, int64_t dim, uint64_t seed) {
  torch::nn::Embedding emb(vocab, dim);
  torch::NoGradGuard no_grad;
  emb->weight.copy_(tp::init_embedding(vocab, dim, seed));
  return emb;
}

/// fc2(gelu(fc1(x))) with the parameters of tp::ParallelMLP(seed).
struct ReferenceMLPImpl : torch::nn::Module {
  ReferenceMLPImpl(int64_t hidden, int64_t ffn, bool bias, uint64_t seed) {
    fc1 = register_module("fc1", reference_linear(hidden, ffn, bias, seed));
    fc2 = register_module("fc2", reference_linear(ffn, hidden, bias, seed + 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(ReferenceMLP);

/// A seeded normal tensor (the same on every rank).
inline torch::Tensor seeded_randn(at::IntArrayRef sizes, uint64_t seed, torch::ScalarType dtype = torch::kFloat) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(sizes, gen).to(dtype);
}

}  // namespace commgrad::testing

namespace commgrad::testing {}  // namespace commgrad::testing
