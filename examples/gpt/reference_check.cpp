#include "gpt/reference_check.h"

#include "gpt/gathered.h"

#include <cmath>
#include <cstdio>

namespace gpt {

namespace {

// |a - b| / |b|; NaN stays NaN (and fails).
double relative(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

// The tensor whose max |p - r| is largest against its reference's largest element.
struct Worst {
  std::string name;
  double error = 0;
};

// Keeps (name, error) when it is worse than `worst` (a NaN is the worst).
void keep_worst(Worst& worst, const std::string& name, double error) {
  const bool worse = std::isnan(error) ? !std::isnan(worst.error) : error > worst.error;
  if (worst.name.empty() || worse) worst = {name, error};
}

// Gradients: max |p - r| over the reference's largest element.
Worst worst_of(const NamedTensors& parallel, const NamedTensors& reference) {
  Worst worst;
  for (const auto& [name, r] : reference) {
    const double largest = r.abs().max().item<double>();
    const double off = (parallel.at(name).to(at::kDouble) - r.to(at::kDouble)).abs().max().item<double>();
    keep_worst(worst, name, off == 0 ? 0 : off / std::max(largest, 1e-30));
  }
  return worst;
}

// Parameters: how far apart the two trainings moved them, against how far
// the reference moved them (L2 over the elements of `compared`). AdamW
// normalises each element's step, so an element whose gradients are small
// follows rounding differences further than its neighbours; this measure
// weighs them by the movement they are part of.
Worst worst_movement(const NamedTensors& parallel, const NamedTensors& reference, const NamedTensors& initial,
                     const NamedTensors& compared) {
  Worst worst;
  for (const auto& [name, r] : reference) {
    const auto mask = compared.at(name);
    const auto ref = r.to(at::kDouble);
    const double moved = ((ref - initial.at(name).to(at::kDouble)) * mask).norm().item<double>();
    const double off = ((parallel.at(name).to(at::kDouble) - ref) * mask).norm().item<double>();
    keep_worst(worst, name, off == 0 ? 0 : off / std::max(moved, 1e-30));
  }
  return worst;
}

// "gradients of step 1: 38 tensors, the worst 'x' off by 3e-07 of its largest element (tolerance 1e-05): ok"
bool report(const char* what, size_t count, const Worst& worst, const char* measure, double tolerance, bool print) {
  const bool ok = worst.error <= tolerance;  // NaN fails
  if (print) {
    std::printf("%s: %zu tensors, the worst '%s' off by %.2g %s (tolerance %.0e): %s\n", what, count,
                worst.name.c_str(), worst.error, measure, tolerance, ok ? "ok" : "MISMATCH");
  }
  return ok;
}

// The elements whose gradient stayed clear of AdamW's epsilon (1e-8) at
// every step: 1e-5 and above. Near epsilon an update is lr g / (|g| + eps),
// so rounding noise in g (about 1e-8 here) moves it by a good part of lr;
// the key bias's gradient, for one, is zero in exact arithmetic (a constant
// added to all of a query's scores leaves its softmax alone).
NamedTensors away_from_epsilon(const NamedTensors& smallest, int64_t* left_out) {
  NamedTensors mask;
  for (const auto& [name, g] : smallest) {
    mask[name] = (g >= 1e-5).to(at::kDouble);
    *left_out += g.numel() - static_cast<int64_t>(mask[name].sum().item<double>());
  }
  return mask;
}

}  // namespace

std::string step_list(const std::vector<int>& steps) {
  std::string text;
  for (int s : steps) {
    if (!text.empty()) text += ' ';
    text += std::to_string(s);
  }
  return text.empty() ? "none" : text;
}

CheckTolerance check_tolerance(const std::string& precision) {
  // Parameters: AdamW divides each gradient element by its own size, so the
  // 1e-7 rounding differences of float32 reductions grow, over a few steps,
  // into differences of 1e-5 to 1e-4 of the movement (measured); a shard
  // stepped wrongly or not at all moves by a good fraction of it.
  // bfloat16 rounds to 2^-8 = 3.9e-3 relative: losses stay within about
  // one rounding, the norm within a few (7.5e-3 measured), single gradient
  // elements within tens (3.6e-2 measured at TP2 x DP2 FSDP), and AdamW
  // turns that into parameter movements 0.2-0.3 apart after four steps;
  // a gradient off by a factor still fails (its elements by 0.5 and more).
  if (precision == "bf16") return {5e-3, 2e-2, 1e-1, 5e-1};
  // float16 rounds to 2^-11 = 4.9e-4.
  if (precision == "fp16") return {1e-3, 5e-3, 5e-2, 3e-1};
  // Gradient norms of later steps carry the parameters' drift too (1e-5
  // seen after an elastic resume): 1e-4.
  return {1e-5, 1e-4, 1e-5, 1e-3};
}

bool reference_models(const GptConfig& config, const std::string& precision) {
  return (precision == "fp32" || precision == "bf16" || precision == "fp16") && unmodelled(config).empty();
}

ReferenceCheck::ReferenceCheck(const Trainer& trainer, const GptConfig& config, std::string precision,
                               double loss_scale, commgrad::Group world)
    : config_(config),
      precision_(std::move(precision)),
      loss_scale_(loss_scale),
      world_(std::move(world)),
      shapes_(parameter_shapes(config)) {
  initial_ = gather_pieces(trainer.parameter_pieces(), shapes_, world_);
}

void ReferenceCheck::compare_gradients_of(const Trainer& trainer, int step) {
  gradient_step_ = step;
  if (step > 1) resumed_ = gather_pieces(trainer.parameter_pieces(), shapes_, world_);
}

void ReferenceCheck::capture(int step, const std::vector<commgrad::checkpoint::TensorPiece>& gradients) {
  if (step != gradient_step_) return;
  for (auto piece : gradients) {
    piece.tensor = piece.tensor.detach().clone();
    piece.source = torch::Tensor();
    gradients_.push_back(std::move(piece));
  }
}

// The losses and gradient norms of the steps this run trained (a step both
// sides skipped has no norm, and agrees); fills the curve's reference.
bool ReferenceCheck::compare_steps(const Trainer& trainer, const std::vector<ReferenceStep>& expected,
                                   std::vector<CurvePoint>& curve) const {
  const bool print = world_.rank() == 0;
  const auto tol = check_tolerance(precision_);
  const int steps = static_cast<int>(expected.size());
  double worst_loss = 0, worst_norm = 0;
  for (auto& point : curve) {
    const auto& r = expected.at(point.step - 1);
    point.reference = r.loss;
    const auto& norms = trainer.grad_norms();
    const double norm = norms.count(point.step) ? norms.at(point.step) : std::nan("");
    const double loss_error = relative(point.loss, r.loss);
    const double norm_error = std::isnan(norm) && r.skipped ? 0.0 : relative(norm, r.grad_norm);
    worst_loss = std::isnan(loss_error) ? loss_error : std::max(worst_loss, loss_error);
    worst_norm = std::isnan(norm_error) ? norm_error : std::max(worst_norm, norm_error);
    if (print) {
      std::printf("check step %d/%d: loss %.6f (one rank %.6f), gradient norm %.6f (one rank %.6f)\n", point.step,
                  steps, point.loss, r.loss, norm, r.grad_norm);
    }
  }
  const bool losses_ok = worst_loss <= tol.loss, norms_ok = worst_norm <= tol.grad_norm;
  if (print) {
    std::printf("max relative difference from one rank %.2g (tolerance %.0e): %s\n", worst_loss, tol.loss,
                losses_ok ? "ok" : "MISMATCH");
    std::printf("gradient norms: max relative difference %.2g (tolerance %.0e): %s\n", worst_norm, tol.grad_norm,
                norms_ok ? "ok" : "MISMATCH");
  }
  return losses_ok && norms_ok;
}

// fp16: the steps the loss scaler skipped, on both sides, from the first this run trained.
bool ReferenceCheck::compare_skipped(const Trainer& trainer, const std::vector<ReferenceStep>& expected) const {
  if (precision_ != "fp16") return true;
  std::vector<int> reference;
  for (int s = gradient_step_; s <= static_cast<int>(expected.size()); ++s) {
    if (expected[s - 1].skipped) reference.push_back(s);
  }
  const auto& skipped = trainer.skipped_steps();
  const bool same = reference == skipped;
  if (world_.rank() == 0) {
    std::printf("skipped steps %s, one rank %s: %s\n", step_list(skipped).c_str(), step_list(reference).c_str(),
                same ? "the same" : "MISMATCH");
  }
  return same;
}

bool ReferenceCheck::compare(const Trainer& trainer, const Corpus& corpus, int64_t batch, int steps,
                             std::vector<CurvePoint>& curve) {
  const bool print = world_.rank() == 0;
  const NamedTensors gradients = gather_pieces(gradients_, shapes_, world_);
  const NamedTensors parameters = gather_pieces(trainer.parameter_pieces(), shapes_, world_);

  ReferenceGpt reference(config_, initial_, compute_dtype(precision_), loss_scale_);
  std::vector<ReferenceStep> expected;
  NamedTensors expected_gradients;
  for (int k = 0; k < steps; ++k) {
    const auto [x, y] = corpus.batch(k, batch, config_.sequence);
    if (k + 1 == gradient_step_ && !resumed_.empty()) {  // at the parameters the run resumed with
      ReferenceGpt at_resume(config_, resumed_, compute_dtype(precision_), reference.loss_scale());
      at_resume.step(x, y);
      expected_gradients = at_resume.gradients();
    }
    expected.push_back(reference.step(x, y));
    if (k + 1 == gradient_step_ && resumed_.empty()) expected_gradients = reference.gradients();
  }
  const auto tol = check_tolerance(precision_);
  if (print) {
    std::printf(
        "check against the one-process reference (LibTorch functions and torch::optim, no commgrad code), "
        "%s tolerances: loss %.0e, gradient norm %.0e, gradients %.0e, parameters %.0e\n",
        precision_.c_str(), tol.loss, tol.grad_norm, tol.gradient, tol.parameter);
  }
  const bool steps_ok = compare_steps(trainer, expected, curve);
  const bool skips_ok = compare_skipped(trainer, expected);
  bool grads_ok = true;
  const std::string grads_title = c10::str("gradients of step ", gradient_step_, " (before clipping)");
  if (expected.at(gradient_step_ - 1).skipped) {
    if (print) std::printf("%s: skipped by the loss scaler (inf/NaN), not compared\n", grads_title.c_str());
  } else {
    grads_ok = report(grads_title.c_str(), expected_gradients.size(), worst_of(gradients, expected_gradients),
                      "of its largest element", tol.gradient, print);
  }
  int64_t left_out = 0;
  const auto compared = away_from_epsilon(reference.smallest_gradients(), &left_out);
  const std::string params_title = c10::str("parameters after step ", steps, " (", left_out,
                                            " elements whose gradient came near AdamW's epsilon left out)");
  const bool params_ok = report(params_title.c_str(), parameters.size(),
                                worst_movement(parameters, reference.parameters(), initial_, compared),
                                "of the reference's movement (L2)", tol.parameter, print);
  return steps_ok && skips_ok && grads_ok && params_ok;
}

}  // namespace gpt
