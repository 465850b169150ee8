// Experts: the loop over this rank's expert MLPs (experts.h says why a loop).
//
// forward() cuts the dispatcher's sorted tokens into one block per local
// expert (narrow: views, no copy), runs each expert on its block, empty
// blocks included, and concatenates the results in the same order. The
// linears are tp::deferrable_linear: under a zero-bubble schedule the
// weights' gradients wait for W (an empty block defers a zero one). Under
// sequence parallelism each expert's parameters pass through
// copy_to_tp_region (four small all-reduces per expert in backward; the
// reducers could do it once per step, as they do for partial_grad
// parameters, at the price of the expert optimizer knowing about it).

#include "commgrad/moe/experts.h"

#include "commgrad/dist/check.h"
#include "commgrad/tp/linear.h"
#include "commgrad/tp/mappings.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/activation.h>

#include <numeric>
#include <string>

namespace commgrad::moe {
namespace {

torch::nn::Linear make_linear(int64_t in, int64_t out, bool bias, uint64_t seed) {
  torch::nn::Linear layer(torch::nn::LinearOptions(in, out).bias(bias));
  const auto full = tp::init_linear(in, out, bias, seed);
  torch::NoGradGuard no_grad;
  layer->weight.copy_(full.weight);
  if (bias) layer->bias.copy_(full.bias);
  return layer;
}

// The expert on this rank's share of tokens that the ranks of `sp` split:
// its parameters through copy_to_tp_region (identity; backward: the gradient
// summed over sp), then what ExpertMLP::forward computes.
at::Tensor forward_split(ExpertMLPImpl& expert, const at::Tensor& x, const Group& sp) {
  auto summed = [&sp](const at::Tensor& p) { return p.defined() ? tp::copy_to_tp_region(p, sp) : p; };
  const at::Tensor h = tp::deferrable_linear(x, summed(expert.fc1->weight), summed(expert.fc1->bias));
  return tp::deferrable_linear(at::gelu(h), summed(expert.fc2->weight), summed(expert.fc2->bias));
}

}  // namespace

// ~~~ ExpertMLP ~~~

ExpertMLPImpl::ExpertMLPImpl(int64_t hidden_size, int64_t ffn_hidden_size, bool bias, uint64_t seed)
    : hidden_size_(hidden_size), ffn_hidden_size_(ffn_hidden_size), bias_(bias), seed_(seed) {
  reset();
}

void ExpertMLPImpl::reset() {
  fc1 = register_module("fc1", make_linear(hidden_size_, ffn_hidden_size_, bias_, seed_));
  fc2 = register_module("fc2", make_linear(ffn_hidden_size_, hidden_size_, bias_, seed_ + 1));
}

void ExpertMLPImpl::pretty_print(std::ostream& stream) const {
  stream << "commgrad::moe::ExpertMLP(hidden=" << hidden_size_ << ", ffn=" << ffn_hidden_size_ << ")";
}

// Under a zero-bubble schedule's tp::DeferWeightGradients the weights'
// gradients wait for W, as the dense linear layers' do.
at::Tensor ExpertMLPImpl::forward(const at::Tensor& x) {
  const at::Tensor h = tp::deferrable_linear(x, fc1->weight, fc1->bias);
  return tp::deferrable_linear(at::gelu(h), fc2->weight, fc2->bias);
}

// ~~~ Experts ~~~

ExpertsImpl::ExpertsImpl(ExpertsOptions options_) : options(std::move(options_)) { reset(); }

void detail::check_expert_sizes(const char* op, const Group& g, int64_t hidden, int64_t ffn, int64_t experts) {
  check_member(op, g);
  COMMGRAD_CHECK(hidden > 0 && ffn > 0, op, g, "hidden and ffn sizes must be positive, got ", hidden, " and ", ffn);
  COMMGRAD_CHECK(experts > 0 && experts % g.size() == 0, op, g, "the number of experts (", experts,
                 ") must be positive and divisible by the expert-parallel size ", g.size());
}

void ExpertsImpl::reset() {
  const char* op = "moe::Experts";
  const Group& g = options.group();
  const int64_t e = options.num_experts();
  detail::check_expert_sizes(op, g, options.hidden_size(), options.ffn_hidden_size(), e);
  if (options.sequence_parallel_group().defined()) check_member(op, options.sequence_parallel_group());
  const int64_t local = e / g.size();
  first_ = g.rank() * local;
  local_.clear();
  for (int64_t l = 0; l < local; ++l) {
    const int64_t global = first_ + l;
    const uint64_t seed = options.seed() + 2 * static_cast<uint64_t>(global);
    local_.push_back(
        register_module("expert" + std::to_string(global),
                        ExpertMLP(options.hidden_size(), options.ffn_hidden_size(), options.bias(), seed)));
  }
}

void ExpertsImpl::pretty_print(std::ostream& stream) const {
  stream << "commgrad::moe::Experts(hidden=" << options.hidden_size() << ", ffn=" << options.ffn_hidden_size()
         << ", experts=" << options.num_experts() << ", local=[" << first_ << ", " << first_ + num_local_experts()
         << "))";
}

at::Tensor ExpertsImpl::forward(const at::Tensor& x, const std::vector<int64_t>& counts) {
  const Group& g = options.group();
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  COMMGRAD_CHECK(static_cast<int64_t>(counts.size()) == num_local_experts(), "moe::Experts", g, "expected ",
                 num_local_experts(), " counts (one per local expert), got ", counts.size());
  COMMGRAD_CHECK(x.dim() == 2 && x.size(0) == total && x.size(1) == options.hidden_size(), "moe::Experts", g,
                 "expected tokens [", total, ", ", options.hidden_size(), "], got ", tensor_name(x));
  const Group& sp = options.sequence_parallel_group();
  const bool split = sp.defined() && sp.size() > 1;
  std::vector<at::Tensor> outputs;
  outputs.reserve(counts.size());
  int64_t begin = 0;
  for (size_t l = 0; l < counts.size(); ++l) {
    const at::Tensor rows = x.narrow(0, begin, counts[l]);
    outputs.push_back(split ? forward_split(*local_[l], rows, sp) : local_[l]->forward(rows));
    begin += counts[l];
  }
  return at::cat(outputs, 0);
}

}  // namespace commgrad::moe
