// The gradient checker: one parallel run against one unsplit run.
//
// Steps (every rank of the group runs all of them, in the same order):
//   1. Local validation: layouts fit the inputs, every parallel parameter has
//      a reference counterpart of the right full shape (and the reverse).
//      Nothing is communicated before this passes, so a misuse is one clear
//      error on every rank rather than a broken collective.
//   2. Inputs: broadcast from group rank 0 (so "identical inputs" holds even
//      when a caller drew them per rank), then copied into two sets of
//      leaves, one per side.
//   3. Reference: forward, loss, backward, locally.
//   4. Parallel: split the inputs with Family 2 scatters (backward:
//      all_gather, so input gradients come back full), forward, gather the
//      output (backward: keep own chunk), the same loss, backward, then the
//      sequence-parallel gradient all-reduce.
//   5. Compare: full tensors on the parallel side are gathered shards
//      (ops::raw, not differentiable) or, for replicated ones, each rank's
//      own copy; per tensor max |p - r| and max |r| are taken on each rank,
//      then all-reduced with MAX, so every rank reports the same numbers and
//      a replica that drifted on one rank shows up.

#include "commgrad/check/gradient_check.h"

#include "commgrad/dist/check.h"
#include "commgrad/ops/raw.h"
#include "commgrad/tp/mappings.h"
#include "commgrad/tp/parallel_state.h"
#include "commgrad/util/names.h"
#include "commgrad/util/print.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/module.h>

#include <cmath>
#include <iomanip>
#include <limits>
#include <set>
#include <sstream>

namespace commgrad::check {
namespace {

constexpr const char* kOp = "check_gradients";
constexpr uint64_t kLossSeed = 0x5eed;

void default_tolerance(at::ScalarType dtype, double& atol, double& rtol) {
  switch (dtype) {
    case at::kDouble:
      atol = 1e-10;
      rtol = 1e-8;
      break;
    case at::kHalf:
    case at::kBFloat16:
      atol = 1e-2;
      rtol = 1e-2;
      break;
    default:
      atol = 1e-5;
      rtol = 1e-4;
  }
}

at::Tensor default_loss(const at::Tensor& out) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(kLossSeed);
  // Drawn on the CPU whatever the output's device, so both sides get the same weights.
  const auto weights = at::randn(out.sizes(), gen, out.options().device(at::kCPU).requires_grad(false));
  return (out * weights.to(out.device())).sum();
}

// A pair of tensors to compare: the parallel side's full tensor and the
// reference's.
struct Pair {
  TensorReport report;
  at::Tensor parallel;
  at::Tensor reference;
};

// Resolves the Layout's dim against a tensor (or errors).
int64_t layout_dim(const Group& g, const Layout& layout, const at::Tensor& t, const std::string& what) {
  const int64_t nd = t.dim();
  COMMGRAD_CHECK(nd > 0 && layout.dim >= -nd && layout.dim < nd, kOp, g, what, ": layout ", layout.describe(),
                 " does not fit ", shape_name(t.sizes()));
  COMMGRAD_CHECK(layout.stride == 1, kOp, g, what, ": strided layouts are for parameters, not inputs or outputs");
  const int64_t d = layout.dim < 0 ? layout.dim + nd : layout.dim;
  COMMGRAD_CHECK(t.size(d) % g.size() == 0, kOp, g, what, " ", shape_name(t.sizes()), ": dim ", d,
                 " is not divisible by the tensor-parallel size ", g.size());
  return d;
}

}  // namespace

bool GradCheckResult::ok() const {
  for (const auto& t : tensors) {
    if (!t.ok) return false;
  }
  return true;
}

const TensorReport& GradCheckResult::report(const std::string& name) const {
  for (const auto& t : tensors) {
    if (t.name == name) return t;
  }
  std::string names;
  for (const auto& t : tensors) names += (names.empty() ? "" : ", ") + t.name;
  TORCH_CHECK(false, "[commgrad] GradCheckResult: no tensor named '", name, "' (have: ", names, ")");
}

std::vector<std::string> GradCheckResult::failures() const {
  std::vector<std::string> out;
  for (const auto& t : tensors) {
    if (!t.ok) out.push_back(t.name);
  }
  return out;
}

std::string GradCheckResult::table() const {
  size_t name_w = 6, shape_w = 5, layout_w = 6;
  for (const auto& t : tensors) {
    name_w = std::max(name_w, t.name.size());
    shape_w = std::max(shape_w, shape_name(t.shape).size());
    layout_w = std::max(layout_w, t.layout.size());
  }
  std::ostringstream os;
  os << "commgrad::check " << (title.empty() ? "" : title + " ") << "tp=" << tp_size << " " << dtype_name(dtype)
     << " (pass: max|p-r| <= atol + rtol*max|r|)\n";
  auto row = [&](const std::string& a, const std::string& b, const std::string& c, const std::string& d,
                 const std::string& e, const std::string& f, const std::string& g) {
    std::ostringstream line;
    line << "  " << std::left << std::setw(static_cast<int>(name_w)) << a << "  "
         << std::setw(static_cast<int>(shape_w)) << b << "  " << std::setw(static_cast<int>(layout_w)) << c << "  "
         << std::right << std::setw(10) << d << "  " << std::setw(10) << e << "  " << std::setw(13) << f << "  "
         << g;
    std::string text = line.str();
    text.erase(text.find_last_not_of(' ') + 1);
    os << text << "\n";
  };
  auto sci = [](double v, int digits = 2) {
    std::ostringstream s;
    if (std::isinf(v)) return std::string("inf");
    s << std::scientific << std::setprecision(digits) << v;
    return s.str();
  };
  row("tensor", "shape", "layout", "max abs", "max rel", "atol / rtol", "");
  for (const auto& t : tensors) {
    row(t.name, shape_name(t.shape), t.layout, sci(t.max_abs_error), sci(t.max_rel_error),
        sci(t.atol, 0) + " / " + sci(t.rtol, 0), t.ok ? "ok" : "MISMATCH" + (t.note.empty() ? "" : " (" + t.note + ")"));
  }
  const auto bad = failures();
  if (bad.empty()) {
    os << "  all " << tensors.size() << " tensors match\n";
  } else {
    os << "  " << bad.size() << " of " << tensors.size() << " tensors MISMATCH:";
    for (const auto& n : bad) os << " " << n;
    os << "\n";
  }
  return os.str();
}

std::ostream& operator<<(std::ostream& out, const GradCheckResult& result) { return out << result.table(); }

GradCheckResult check_gradients(const Subject& parallel, const Subject& reference, const std::vector<at::Tensor>& inputs,
                                const GradCheckOptions& options) {
  const Group g = tp::resolve_tp_group(options.group(), kOp);
  COMMGRAD_CHECK(parallel.forward && reference.forward, kOp, g, "both subjects need a forward function");
  COMMGRAD_CHECK(options.input_layouts().empty() || options.input_layouts().size() == inputs.size(), kOp, g,
                 options.input_layouts().size(), " input layouts for ", inputs.size(), " inputs");
  const auto input_layout = [&](size_t i) {
    return options.input_layouts().empty() ? Layout::replicated() : options.input_layouts()[i];
  };
  for (size_t i = 0; i < inputs.size(); ++i) {
    COMMGRAD_CHECK(inputs[i].defined(), kOp, g, "input ", i, " is undefined");
    if (input_layout(i).is_partitioned()) layout_dim(g, input_layout(i), inputs[i], c10::str("input ", i));
  }

  // 1. Parameter names and shapes, locally.
  const auto par_specs = parallel.module ? tp::shard_specs(*parallel.module)
                                         : torch::OrderedDict<std::string, tp::ParameterShard>();
  torch::OrderedDict<std::string, at::Tensor> ref_params;
  if (reference.module) ref_params = reference.module->named_parameters();
  torch::OrderedDict<std::string, at::Tensor> par_params;
  if (parallel.module) par_params = parallel.module->named_parameters();
  std::vector<std::string> ref_names;
  std::set<std::string> used;
  for (const auto& p : par_params) {
    auto it = options.reference_names().find(p.key());
    const std::string rname = it == options.reference_names().end() ? p.key() : it->second;
    const at::Tensor* r = ref_params.find(rname);
    COMMGRAD_CHECK(r != nullptr, kOp, g, "parallel parameter '", p.key(), "' has no reference parameter '", rname,
                   "' (map names with GradCheckOptions::reference_names)");
    const tp::ParameterShard& s = par_specs[p.key()];
    auto full = p.value().sizes().vec();
    if (s.spec.is_partitioned()) {
      const int64_t d = s.spec.dim < 0 ? s.spec.dim + p.value().dim() : s.spec.dim;
      full[d] *= s.group.defined() ? s.group.size() : g.size();
    }
    COMMGRAD_CHECK(at::IntArrayRef(full) == r->sizes(), kOp, g, "parallel parameter '", p.key(), "' ",
                   shape_name(p.value().sizes()), " (", s.spec.describe(), ") is ", shape_name(full),
                   " in full, but reference '", rname, "' is ", shape_name(r->sizes()));
    ref_names.push_back(rname);
    used.insert(rname);
  }
  for (const auto& r : ref_params) {
    COMMGRAD_CHECK(used.count(r.key()) == 1, kOp, g, "reference parameter '", r.key(),
                   "' has no parallel counterpart");
  }

  // Gradients left from earlier backward passes would be added to this one.
  for (auto* params : {&par_params, &ref_params}) {
    for (auto& p : *params) p.value().mutable_grad() = at::Tensor();
  }

  // 2. Inputs from group rank 0, then one set of leaves per side.
  std::vector<at::Tensor> ref_in, par_leaves, par_in;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor x =
        ops::raw::broadcast(inputs[i].detach(), ops::BroadcastOptions().src(0), g).wait().view(inputs[i].sizes());
    const bool grad = x.is_floating_point();
    // Leaves keep the caller's memory layout: a transposed input reaches
    // both modules transposed.
    auto leaf = [&](const c10::Device& dev) {
      return inputs[i].detach().clone(at::MemoryFormat::Preserve).copy_(x).to(dev).requires_grad_(grad);
    };
    ref_in.push_back(leaf(inputs[i].device()));
    par_leaves.push_back(leaf(options.parallel_device()));
    const Layout layout = input_layout(i);
    par_in.push_back(layout.is_partitioned() ? tp::detail::split_along(par_leaves.back(), layout.dim, g, kOp)
                                             : par_leaves.back());
  }
  const LossFn loss_fn = options.loss() ? options.loss() : LossFn(default_loss);

  // 3. Reference.
  const at::Tensor ref_out = reference.forward(ref_in);
  COMMGRAD_CHECK(ref_out.defined(), kOp, g, "the reference returned an undefined tensor");
  const at::Tensor ref_loss = loss_fn(ref_out);
  if (ref_loss.requires_grad()) ref_loss.backward();

  // 4. Parallel.
  const at::Tensor par_out_local = parallel.forward(par_in);
  COMMGRAD_CHECK(par_out_local.defined(), kOp, g, "the parallel module returned an undefined tensor");
  at::Tensor par_out = par_out_local;
  if (options.output_layout().is_partitioned()) {
    const int64_t nd = par_out_local.dim();
    const int64_t d = options.output_layout().dim;
    COMMGRAD_CHECK(nd > 0 && d >= -nd && d < nd && options.output_layout().stride == 1, kOp, g, "output layout ",
                   options.output_layout().describe(), " does not fit the parallel output ",
                   shape_name(par_out_local.sizes()));
    par_out = tp::detail::gather_along(par_out_local, options.output_layout().dim, g, kOp);
  }
  const at::Tensor par_loss = loss_fn(par_out);
  if (par_loss.requires_grad()) par_loss.backward();
  if (options.sync_sequence_parallel_grads() && parallel.module) tp::allreduce_sequence_parallel_grads(*parallel.module);

  // 5. Full tensors, pairwise.
  GradCheckResult result;
  result.title = options.title();
  result.tp_size = g.size();
  result.dtype = ref_out.scalar_type();
  std::vector<Pair> pairs;
  auto add = [&](const std::string& name, const std::string& layout, const at::Tensor& p, const at::Tensor& r) {
    Pair e;
    e.report.name = name;
    e.report.layout = layout;
    e.parallel = p.defined() ? p.detach().cpu() : p;
    e.reference = r.defined() ? r.detach().cpu() : r;
    pairs.push_back(std::move(e));
  };
  add("output", options.output_layout().describe(), par_out, ref_out);
  add("loss", "replicated", par_loss, ref_loss);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!ref_in[i].is_floating_point()) continue;
    const std::string name = inputs.size() == 1 ? "input.grad" : c10::str("input[", i, "].grad");
    add(name, input_layout(i).describe(), par_leaves[i].grad(), ref_in[i].grad());
  }
  size_t k = 0;
  for (const auto& p : par_params) {
    const tp::ParameterShard& s = par_specs[p.key()];
    const Group pg = s.group.defined() ? s.group : g;
    const at::Tensor& rp = ref_params[ref_names[k++]];
    const at::Tensor value = tp::gather_shards(p.value(), s.spec, pg);
    at::Tensor grad = p.value().grad();
    // Every rank takes part in the gather, with or without a gradient.
    const bool has_grad = grad.defined();
    if (!has_grad) grad = at::zeros_like(p.value());
    grad = tp::gather_shards(grad, s.spec, pg);
    add(p.key(), s.spec.describe(), value, rp);
    add(p.key() + ".grad", s.spec.describe(), grad, rp.grad().defined() ? rp.grad() : at::zeros_like(rp));
    if (!has_grad && rp.grad().defined()) pairs.back().report.note = "no gradient on the parallel side";
  }

  // Local numbers, then the maximum over ranks.
  std::vector<double> local;
  for (auto& e : pairs) {
    auto& rep = e.report;
    rep.shape = e.reference.defined() ? e.reference.sizes().vec() : std::vector<int64_t>{};
    double abs_err = std::numeric_limits<double>::infinity();
    double ref_max = 0;
    if (!e.parallel.defined() || !e.reference.defined()) {
      if (rep.note.empty()) rep.note = e.parallel.defined() ? "undefined on the reference side" : "undefined";
    } else if (e.parallel.sizes() != e.reference.sizes()) {
      rep.note = c10::str("shape ", shape_name(e.parallel.sizes()), " vs ", shape_name(e.reference.sizes()));
    } else {
      const auto r = e.reference.to(at::kDouble);
      abs_err = e.parallel.numel() == 0 ? 0.0 : (e.parallel.to(at::kDouble) - r).abs().max().item<double>();
      ref_max = r.numel() == 0 ? 0.0 : r.abs().max().item<double>();
      if (std::isnan(abs_err)) abs_err = std::numeric_limits<double>::infinity();
    }
    local.push_back(abs_err);
    local.push_back(ref_max);
  }
  const at::Tensor maxima =
      ops::raw::all_reduce(at::tensor(local, at::kDouble), ops::AllReduceOptions().op(ReduceOp::kMax), g).wait();
  double atol = options.atol(), rtol = options.rtol();
  double def_atol = 0, def_rtol = 0;
  default_tolerance(result.dtype, def_atol, def_rtol);
  if (atol < 0) atol = def_atol;
  if (rtol < 0) rtol = def_rtol;
  for (size_t i = 0; i < pairs.size(); ++i) {
    auto& rep = pairs[i].report;
    rep.max_abs_error = maxima[2 * i].item<double>();
    rep.max_abs_ref = maxima[2 * i + 1].item<double>();
    rep.max_rel_error = rep.max_abs_ref > 0 ? rep.max_abs_error / rep.max_abs_ref : (rep.max_abs_error > 0 ? INFINITY : 0);
    rep.atol = atol;
    rep.rtol = rtol;
    rep.ok = rep.note.empty() && rep.max_abs_error <= atol + rtol * rep.max_abs_ref;
    result.tensors.push_back(rep);
  }
  return result;
}

GradCheckResult check_gradients(const std::function<Subject(const Group& tp_group)>& factory,
                                const std::vector<at::Tensor>& inputs, const GradCheckOptions& options) {
  const Group g = tp::resolve_tp_group(options.group(), kOp);
  const Subject parallel = factory(g);
  const Subject reference = factory(commgrad::self_group());
  GradCheckOptions o = options;
  o.group(g);
  return check_gradients(parallel, reference, inputs, o);
}

}  // namespace commgrad::check
