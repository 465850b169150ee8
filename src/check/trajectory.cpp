// check_trajectory: two training loops side by side (see the header). Per
// step: the parallel step, its loss averaged over the data-parallel group
// (one all-reduce of one float64), the reference step. At the end: the
// parallel parameters gathered into full tensors and compared by name. The
// errors are computed from values every rank has (the averaged losses, the
// gathered tensors, the reference run), so the result is the same on every
// rank without more communication.

#include "commgrad/check/trajectory.h"

#include "commgrad/dist/parallel_state.h"
#include "commgrad/ops/raw.h"
#include "commgrad/tp/sharding.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>

namespace commgrad::check {
namespace {

bool within(double error, double reference, const TrajectoryOptions& o) {
  return std::isfinite(error) && error <= o.atol() + o.rtol() * reference;
}

TensorReport compare_parameter(const std::string& name, const at::Tensor* parallel, const at::Tensor* reference,
                               const TrajectoryOptions& o) {
  TensorReport r;
  r.name = name;
  r.layout = "full";
  r.atol = o.atol();
  r.rtol = o.rtol();
  if (parallel == nullptr || reference == nullptr) {
    r.note = parallel == nullptr ? "missing in the parallel model" : "missing in the reference model";
    return r;
  }
  r.shape = reference->sizes().vec();
  if (parallel->sizes() != reference->sizes()) {
    r.note = "shapes differ";
    return r;
  }
  const auto p = parallel->detach().to(at::kDouble), q = reference->detach().to(at::kDouble);
  r.max_abs_ref = q.numel() ? q.abs().max().item<double>() : 0.0;
  r.max_abs_error = q.numel() ? (p - q).abs().max().item<double>() : 0.0;
  r.max_rel_error = r.max_abs_ref > 0 ? r.max_abs_error / r.max_abs_ref : r.max_abs_error;
  r.ok = within(r.max_abs_error, r.max_abs_ref, o);
  return r;
}

std::vector<TensorReport> compare_parameters(const torch::nn::Module& parallel, const torch::nn::Module& reference,
                                             const TrajectoryOptions& o) {
  const auto full = tp::gather_full_state_dict(parallel);  // collective over the TP groups
  const auto mine = reference.named_parameters();
  std::vector<TensorReport> out;
  for (const auto& item : mine) out.push_back(compare_parameter(item.key(), full.find(item.key()), &item.value(), o));
  for (const auto& item : parallel.named_parameters()) {
    if (mine.find(item.key()) == nullptr) out.push_back(compare_parameter(item.key(), &item.value(), nullptr, o));
  }
  return out;
}

}  // namespace

bool TrajectoryResult::ok() const {
  return first_divergent_step < 0 &&
         std::all_of(parameters.begin(), parameters.end(), [](const TensorReport& r) { return r.ok; });
}

std::string TrajectoryResult::table() const {
  std::ostringstream os;
  os << "commgrad::check trajectory " << (title.empty() ? "" : title + " ") << "(" << losses.size()
     << " steps against one rank)\n";
  for (size_t k = 0; k < losses.size(); ++k) {
    os << "  step " << k + 1 << ": loss " << std::setprecision(9) << losses[k] << " (one rank " << reference_losses[k]
       << ")" << (static_cast<int>(k) == first_divergent_step ? "  DIVERGES" : "") << "\n";
  }
  for (const auto& p : parameters) {
    os << "  " << p.name << ": max abs " << std::scientific << std::setprecision(2) << p.max_abs_error << ", max rel "
       << p.max_rel_error << std::defaultfloat
       << (p.ok ? "  ok" : "  MISMATCH" + (p.note.empty() ? std::string() : " (" + p.note + ")")) << "\n";
  }
  os << (ok() ? "  all steps and parameters agree" : "  the runs differ") << "\n";
  return os.str();
}

std::ostream& operator<<(std::ostream& out, const TrajectoryResult& result) { return out << result.table(); }

TrajectoryResult check_trajectory(const StepFn& parallel_step, const torch::nn::Module& parallel_model,
                                  const StepFn& reference_step, const torch::nn::Module& reference_model,
                                  const TrajectoryOptions& options) {
  TORCH_CHECK(parallel_step && reference_step, "[commgrad] check_trajectory: a step function is empty");
  TORCH_CHECK(options.steps() >= 1, "[commgrad] check_trajectory: steps must be >= 1, got ", options.steps());
  const Group dp =
      options.data_parallel_group().defined() ? options.data_parallel_group() : default_data_parallel_group();
  TrajectoryResult result;
  result.title = options.title();
  for (int k = 0; k < options.steps(); ++k) {
    const double mine = parallel_step(k);
    const auto mean =
        ops::raw::all_reduce(at::full({1}, mine, at::kDouble), ops::AllReduceOptions().op(ReduceOp::kAvg), dp).wait();
    result.losses.push_back(mean.item<double>());
    result.reference_losses.push_back(reference_step(k));
    const double error = std::abs(result.losses.back() - result.reference_losses.back());
    if (result.first_divergent_step < 0 && !within(error, std::abs(result.reference_losses.back()), options)) {
      result.first_divergent_step = k;
    }
  }
  result.parameters = compare_parameters(parallel_model, reference_model, options);
  return result;
}

}  // namespace commgrad::check
