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
         << std::right << std::setw(10) << d << "  " << std::setw(10) << e << "  " << std::setw(13) << f << "  " << g;
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
        sci(t.atol, 0) + " / " + sci(t.rtol, 0),
        t.ok ? "ok" : "MISMATCH" + (t.note.empty() ? "" : " (" + t.note + ")"));
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

namespace {

// One run of the checker: each step of the file comment is one method.
class GradientCheck {
 public:
  GradientCheck(const Subject& parallel, const Subject& reference, const std::vector<at::Tensor>& inputs,
                const GradCheckOptions& options)
      : parallel_(parallel),
        reference_(reference),
        inputs_(inputs),
        options_(options),
        g_(tp::resolve_tp_group(options.group(), kOp)),
        loss_fn_(options.loss() ? options.loss() : LossFn(default_loss)) {}

  GradCheckResult run() {
    check_arguments();
    match_parameters();
    make_inputs();
    run_reference();
    run_parallel();
    return compare();
  }

 private:
  Layout input_layout(size_t i) const {
    return options_.input_layouts().empty() ? Layout::replicated() : options_.input_layouts()[i];
  }
  void check_arguments() const;
  void match_parameters();
  void make_inputs();
  void run_reference();
  void run_parallel();
  std::vector<Pair> pairs();
  GradCheckResult compare();

  const Subject& parallel_;
  const Subject& reference_;
  const std::vector<at::Tensor>& inputs_;
  const GradCheckOptions& options_;
  const Group g_;
  const LossFn loss_fn_;
  torch::OrderedDict<std::string, tp::ParameterShard> par_specs_;
  torch::OrderedDict<std::string, at::Tensor> par_params_, ref_params_;
  std::vector<std::string> ref_names_;  // the reference name of each parallel parameter
  std::vector<at::Tensor> ref_in_, par_leaves_, par_in_;
  at::Tensor ref_out_, ref_loss_, par_out_, par_loss_;
};

void GradientCheck::check_arguments() const {
  COMMGRAD_CHECK(parallel_.forward && reference_.forward, kOp, g_, "both subjects need a forward function");
  COMMGRAD_CHECK(options_.input_layouts().empty() || options_.input_layouts().size() == inputs_.size(), kOp, g_,
                 options_.input_layouts().size(), " input layouts for ", inputs_.size(), " inputs");
  for (size_t i = 0; i < inputs_.size(); ++i) {
    COMMGRAD_CHECK(inputs_[i].defined(), kOp, g_, "input ", i, " is undefined");
    if (input_layout(i).is_partitioned()) layout_dim(g_, input_layout(i), inputs_[i], c10::str("input ", i));
  }
}

// 1. Parameter names and shapes, locally; then no gradient is left from an
// earlier backward (it would be added to this one).
void GradientCheck::match_parameters() {
  if (parallel_.module) par_specs_ = tp::shard_specs(*parallel_.module);
  if (reference_.module) ref_params_ = reference_.module->named_parameters();
  if (parallel_.module) par_params_ = parallel_.module->named_parameters();
  std::set<std::string> used;
  for (const auto& p : par_params_) {
    auto it = options_.reference_names().find(p.key());
    const std::string rname = it == options_.reference_names().end() ? p.key() : it->second;
    const at::Tensor* r = ref_params_.find(rname);
    COMMGRAD_CHECK(r != nullptr, kOp, g_, "parallel parameter '", p.key(), "' has no reference parameter '", rname,
                   "' (map names with GradCheckOptions::reference_names)");
    const tp::ParameterShard& s = par_specs_[p.key()];
    auto full = p.value().sizes().vec();
    if (s.spec.is_partitioned()) {
      const int64_t d = s.spec.dim < 0 ? s.spec.dim + p.value().dim() : s.spec.dim;
      full[d] *= s.group.defined() ? s.group.size() : g_.size();
    }
    COMMGRAD_CHECK(at::IntArrayRef(full) == r->sizes(), kOp, g_, "parallel parameter '", p.key(), "' ",
                   shape_name(p.value().sizes()), " (", s.spec.describe(), ") is ", shape_name(full),
                   " in full, but reference '", rname, "' is ", shape_name(r->sizes()));
    ref_names_.push_back(rname);
    used.insert(rname);
  }
  for (const auto& r : ref_params_) {
    COMMGRAD_CHECK(used.count(r.key()) == 1, kOp, g_, "reference parameter '", r.key(),
                   "' has no parallel counterpart");
  }
  for (auto* params : {&par_params_, &ref_params_}) {
    for (auto& p : *params) p.value().mutable_grad() = at::Tensor();
  }
}

// 2. Inputs from group rank 0, then one set of leaves per side.
void GradientCheck::make_inputs() {
  for (size_t i = 0; i < inputs_.size(); ++i) {
    const at::Tensor x =
        ops::raw::broadcast(inputs_[i].detach(), ops::BroadcastOptions().src(0), g_).wait().view(inputs_[i].sizes());
    const bool grad = x.is_floating_point();
    // Leaves keep the caller's memory layout: a transposed input reaches
    // both modules transposed.
    auto leaf = [&](const c10::Device& dev) {
      return inputs_[i].detach().clone(at::MemoryFormat::Preserve).copy_(x).to(dev).requires_grad_(grad);
    };
    ref_in_.push_back(leaf(inputs_[i].device()));
    par_leaves_.push_back(leaf(options_.parallel_device()));
    const Layout layout = input_layout(i);
    par_in_.push_back(layout.is_partitioned() ? tp::detail::split_along(par_leaves_.back(), layout.dim, g_, kOp)
                                              : par_leaves_.back());
  }
}

// 3. Reference.
void GradientCheck::run_reference() {
  ref_out_ = reference_.forward(ref_in_);
  COMMGRAD_CHECK(ref_out_.defined(), kOp, g_, "the reference returned an undefined tensor");
  ref_loss_ = loss_fn_(ref_out_);
  if (ref_loss_.requires_grad()) ref_loss_.backward();
}

// 4. Parallel.
void GradientCheck::run_parallel() {
  const at::Tensor out = parallel_.forward(par_in_);
  COMMGRAD_CHECK(out.defined(), kOp, g_, "the parallel module returned an undefined tensor");
  par_out_ = out;
  if (options_.output_layout().is_partitioned()) {
    const int64_t nd = out.dim();
    const int64_t d = options_.output_layout().dim;
    COMMGRAD_CHECK(nd > 0 && d >= -nd && d < nd && options_.output_layout().stride == 1, kOp, g_, "output layout ",
                   options_.output_layout().describe(), " does not fit the parallel output ", shape_name(out.sizes()));
    par_out_ = tp::detail::gather_along(out, options_.output_layout().dim, g_, kOp);
  }
  par_loss_ = loss_fn_(par_out_);
  if (par_loss_.requires_grad()) par_loss_.backward();
  if (options_.sync_sequence_parallel_grads() && parallel_.module) {
    tp::allreduce_sequence_parallel_grads(*parallel_.module);
  }
}

// 5a. Full tensors, pairwise: outputs, loss, input gradients, parameters
// and their gradients (shards gathered; every rank takes part in each
// gather, with or without a gradient).
std::vector<Pair> GradientCheck::pairs() {
  std::vector<Pair> out;
  auto add = [&](const std::string& name, const std::string& layout, const at::Tensor& p, const at::Tensor& r) {
    Pair e;
    e.report.name = name;
    e.report.layout = layout;
    e.parallel = p.defined() ? p.detach().cpu() : p;
    e.reference = r.defined() ? r.detach().cpu() : r;
    out.push_back(std::move(e));
  };
  add("output", options_.output_layout().describe(), par_out_, ref_out_);
  add("loss", "replicated", par_loss_, ref_loss_);
  for (size_t i = 0; i < inputs_.size(); ++i) {
    if (!ref_in_[i].is_floating_point()) continue;
    const std::string name = inputs_.size() == 1 ? "input.grad" : c10::str("input[", i, "].grad");
    add(name, input_layout(i).describe(), par_leaves_[i].grad(), ref_in_[i].grad());
  }
  size_t k = 0;
  for (const auto& p : par_params_) {
    const tp::ParameterShard& s = par_specs_[p.key()];
    const Group pg = s.group.defined() ? s.group : g_;
    const at::Tensor& rp = ref_params_[ref_names_[k++]];
    at::Tensor grad = p.value().grad();
    const bool has_grad = grad.defined();
    if (!has_grad) grad = at::zeros_like(p.value());
    add(p.key(), s.spec.describe(), tp::gather_shards(p.value(), s.spec, pg), rp);
    add(p.key() + ".grad", s.spec.describe(), tp::gather_shards(grad, s.spec, pg),
        rp.grad().defined() ? rp.grad() : at::zeros_like(rp));
    if (!has_grad && rp.grad().defined()) out.back().report.note = "no gradient on the parallel side";
  }
  return out;
}

// 5b. Local numbers, then the maximum over ranks.
GradCheckResult GradientCheck::compare() {
  std::vector<Pair> all = pairs();
  std::vector<double> local;
  for (auto& e : all) {
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
      ops::raw::all_reduce(at::tensor(local, at::kDouble), ops::AllReduceOptions().op(ReduceOp::kMax), g_).wait();
  GradCheckResult result;
  result.title = options_.title();
  result.tp_size = g_.size();
  result.dtype = ref_out_.scalar_type();
  double def_atol = 0, def_rtol = 0;
  default_tolerance(result.dtype, def_atol, def_rtol);
  const double atol = options_.atol() < 0 ? def_atol : options_.atol();
  const double rtol = options_.rtol() < 0 ? def_rtol : options_.rtol();
  for (size_t i = 0; i < all.size(); ++i) {
    auto& rep = all[i].report;
    rep.max_abs_error = maxima[2 * i].item<double>();
    rep.max_abs_ref = maxima[2 * i + 1].item<double>();
    rep.max_rel_error =
        rep.max_abs_ref > 0 ? rep.max_abs_error / rep.max_abs_ref : (rep.max_abs_error > 0 ? INFINITY : 0);
    rep.atol = atol;
    rep.rtol = rtol;
    rep.ok = rep.note.empty() && rep.max_abs_error <= atol + rtol * rep.max_abs_ref;
    result.tensors.push_back(rep);
  }
  return result;
}

}  // namespace

GradCheckResult check_gradients(const Subject& parallel, const Subject& reference,
                                const std::vector<at::Tensor>& inputs, const GradCheckOptions& options) {
  return GradientCheck(parallel, reference, inputs, options).run();
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
