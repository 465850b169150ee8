#pragma once
// The distributed gradient checker: runs a tensor-parallel module on its
// group and its unsplit reference on each rank, from identical full inputs
// and the same loss, and compares the output, the loss, every input gradient,
// and every parameter and parameter gradient (shards gathered into full
// tensors) against stated tolerances.
//
// How the two sides are run:
//   reference  out = reference.forward(inputs); loss(out).backward()
//   parallel   each input is given to the parallel module as `input_layouts`
//              says (replicated, or this rank's chunk of a dim, split with a
//              Family 2 scatter so its gradient is the full one again);
//              the output is gathered as `output_layout` says (backward: keep
//              own chunk), so the SAME loss runs on the full output on every
//              rank (Family 2: one replicated loss); backward; then, by
//              default, tp::allreduce_sequence_parallel_grads().
// Parameters are matched by name (named_parameters(); `reference_names`
// renames), and gathered with the layout their module declares
// (tp::ShardedModule; others are replicated and compared rank by rank).
//
// A tensor passes when max|p - r| <= atol + rtol * max|r| (over the whole
// tensor, on every rank). Errors are maxima over the ranks, so every rank
// gets the same result. Writing your own parallel layer: derive it from
// tp::ShardedModule and declare each split parameter's ShardSpec; the checker
// then needs nothing else.
//
// Example:
//   auto result = check::check_gradients(
//       check::subject(parallel_mlp), check::subject(reference_mlp), {x},
//       check::GradCheckOptions(tp_group).title("ParallelMLP"));
//   if (rank == 0) std::cout << result;
//   if (!result.ok()) return 1;

#include "commgrad/dist/group.h"
#include "commgrad/tp/sharding.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <functional>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace commgrad::check {

/// How the parallel side receives an input or returns its output.
using Layout = tp::ShardSpec;

/// Runs one side of the comparison on its inputs.
using ForwardFn = std::function<at::Tensor(const std::vector<at::Tensor>& inputs)>;
/// Turns the full output into a scalar loss (the same on every rank).
using LossFn = std::function<at::Tensor(const at::Tensor& output)>;
/// Parameter names: parallel -> reference.
using NameMap = std::map<std::string, std::string>;

/// One side of a comparison: the module whose parameters are compared (may
/// be null for a function without parameters) and how to run it.
struct Subject {
  std::shared_ptr<torch::nn::Module> module;
  ForwardFn forward;
};

/// A Subject for a module holder whose forward takes one tensor.
///
/// Example:
///   auto s = check::subject(tp::ParallelMLP(tp::ParallelMLPOptions(64, 256, g)));
template <typename Holder>
Subject subject(Holder holder) {
  auto module = holder.ptr();
  return Subject{module,
                 [holder](const std::vector<at::Tensor>& inputs) mutable { return holder->forward(inputs.at(0)); }};
}

/// Options of check_gradients().
///
/// Example:
///   check::GradCheckOptions(tp_group)
///       .input_layouts({check::Layout::partitioned(0)})   // the module takes a sequence chunk
///       .output_layout(check::Layout::partitioned(0))
///       .atol(1e-5).rtol(1e-4)
struct GradCheckOptions {
  /* implicit */ GradCheckOptions(Group group = Group()) : group_(std::move(group)) {}
  /// The tensor-parallel group of the parallel side; empty: the current
  /// parallel state's.
  TORCH_ARG(Group, group);
  /// Per input: replicated (default) or this rank's chunk of a dim.
  TORCH_ARG(std::vector<Layout>, input_layouts) = {};
  /// How the parallel output is split (default: replicated).
  TORCH_ARG(Layout, output_layout) = Layout::replicated();
  /// The loss; default: sum(output * R) with R drawn from a fixed seed, so
  /// every output element gets a distinct, non-trivial gradient.
  TORCH_ARG(LossFn, loss) = nullptr;
  /// Absolute and relative tolerance; negative: by dtype (float32: 1e-5 and
  /// 1e-4, float64: 1e-10 and 1e-8, half types: 1e-2 and 1e-2).
  TORCH_ARG(double, atol) = -1;
  TORCH_ARG(double, rtol) = -1;
  /// Reference parameter name for a parallel one, where they differ.
  TORCH_ARG(NameMap, reference_names) = {};
  /// Sum partial (sequence-parallel) gradients across the group after
  /// backward, as a training step must (tp::allreduce_sequence_parallel_grads()).
  TORCH_ARG(bool, sync_sequence_parallel_grads) = true;
  /// Heading of the printed table.
  TORCH_ARG(std::string, title) = "";
  /// Where the parallel run happens (e.g. a rank's GPU, commgrad::device()):
  /// its input leaves are copied there, and its module must already be
  /// there. The reference runs where the inputs are; tensors are compared on
  /// the CPU.
  TORCH_ARG(c10::Device, parallel_device) = c10::Device(c10::DeviceType::CPU);
};

/// The comparison of one tensor.
struct TensorReport {
  std::string name;            // "output", "loss", "input.grad", "fc1.weight", "fc1.weight.grad"
  std::vector<int64_t> shape;  // full shape
  std::string layout;          // how the parallel side holds it
  double max_abs_error = 0;    // max |p - r|, over elements and ranks
  double max_rel_error = 0;    // max_abs_error / max |r|
  double max_abs_ref = 0;      // max |r|
  double atol = 0;
  double rtol = 0;
  bool ok = false;
  std::string note;  // why it failed beyond the numbers (shape, missing gradient)
};

/// What check_gradients() found; the same on every rank.
struct GradCheckResult {
  std::string title;
  int tp_size = 1;
  at::ScalarType dtype = at::kFloat;
  std::vector<TensorReport> tensors;

  /// True when every tensor passed.
  bool ok() const;
  /// The report named `name` (error when there is none).
  const TensorReport& report(const std::string& name) const;
  /// Names of the tensors that failed.
  std::vector<std::string> failures() const;
  /// The readable table (one line per tensor, a verdict line at the end).
  std::string table() const;
};

/// Prints result.table().
std::ostream& operator<<(std::ostream& out, const GradCheckResult& result);

/// Compares `parallel` (on options.group()) with `reference` (on each rank),
/// from the full `inputs` (values taken from group rank 0, so every rank uses
/// the same; memory layout kept, so a transposed input reaches both sides
/// transposed; floating-point inputs get gradients). Collective over the
/// group. Parameter gradients of both modules are reset first (and hold
/// this run's gradients afterwards). Errors, before running anything, when a
/// parallel parameter has no reference counterpart (or the reverse) or the
/// layouts do not fit.
///
/// Example:
///   auto r = check::check_gradients(check::subject(par), check::subject(ref), {x},
///                                   check::GradCheckOptions(tp_group));
///   EXPECT_TRUE(r.ok()) << r;
GradCheckResult check_gradients(const Subject& parallel, const Subject& reference,
                                const std::vector<at::Tensor>& inputs, const GradCheckOptions& options = {});

/// Builds both sides with one factory: the parallel one on options.group()
/// and the reference on commgrad::self_group() (the same layer at TP = 1,
/// which holds the full, unsplit parameters when layers initialise from a
/// seed), then compares them.
///
/// Example:
///   auto r = check::check_gradients(
///       [](const Group& g) { return check::subject(tp::ParallelMLP(tp::ParallelMLPOptions(52, 68, g).seed(3))); },
///       {x}, check::GradCheckOptions(tp_group));
GradCheckResult check_gradients(const std::function<Subject(const Group& tp_group)>& factory,
                                const std::vector<at::Tensor>& inputs, const GradCheckOptions& options = {});

}  // namespace commgrad::check
