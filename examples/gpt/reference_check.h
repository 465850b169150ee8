#pragma once
// `gpt_train --check` against the one-process reference (reference.h): what
// the parallel run is compared on, and the report.
//
// Training depends on more than the losses (AdamW hardly moves when every
// gradient is off by the same factor, and clipping removes one), so the
// check compares, besides the loss of every step:
//   - every parameter's whole gradient of the first step this run trains,
//     after every reduction and before clipping (gathered from the TP, CP,
//     PP, FSDP, ZeRO and EP pieces of every rank);
//   - the global gradient norm of every step, before clipping;
//   - every parameter after the last step.
// A gradient or parameter passes when max |p - r| <= tol * max |r| (per
// tensor); the report names the worst one. Tolerances by compute dtype:
// float32 1e-5 (reduction orders differ); check_tolerance() gives each.
//
// The reference starts from the parallel model's initial weights (gathered
// before a resume loads anything) and trains every step from the first.

#include "gpt/corpus.h"
#include "gpt/loss_curve.h"
#include "gpt/reference.h"
#include "gpt/trainer.h"

#include <commgrad/commgrad.h>

#include <optional>
#include <string>
#include <vector>

namespace gpt {

/// The tolerances of one compute dtype (relative to the reference's largest element or value).
struct CheckTolerance {
  double loss = 1e-5;
  double grad_norm = 1e-5;
  double gradient = 1e-5;
  double parameter = 1e-5;
};
/// "fp32", "bf16" or "fp16".
CheckTolerance check_tolerance(const std::string& precision);

/// Steps as "1 2 5", or "none".
std::string step_list(const std::vector<int>& steps);

/// True when the reference models this configuration (else --check
/// compares with the same program at one rank).
bool reference_models(const GptConfig& config, const std::string& precision);

class ReferenceCheck {
 public:
  /// Gathers `trainer`'s initial weights (collective over `world`). Call
  /// before any step and before a resume loads.
  /// `loss_scale`: fp16's initial loss scale (the trainer's).
  ReferenceCheck(const Trainer& trainer, const GptConfig& config, std::string precision, double loss_scale,
                 commgrad::Group world);

  /// The gradients of step `step` (1-based) are the ones compared: the
  /// first step this run trains. After a resume (step > 1) this gathers
  /// the parameters the run resumed with (collective over the world), and
  /// the reference's gradients of that step are taken at them: a few steps
  /// of AdamW carry float32 rounding differences into the parameters, which
  /// would otherwise show in the gradients.
  void compare_gradients_of(const Trainer& trainer, int step);
  /// For the trainer's GradientInspector: keeps copies of the pieces of the
  /// step compared.
  void capture(int step, const std::vector<commgrad::checkpoint::TensorPiece>& gradients);

  /// Trains the reference for `steps` steps on global batches of `batch`
  /// rows of `corpus`, compares (collective over the
  /// world: gathers the gradients and the final parameters), fills
  /// `curve`'s reference losses and prints the report on rank 0. True when
  /// everything is within its tolerance.
  bool compare(const Trainer& trainer, const Corpus& corpus, int64_t batch, int steps, std::vector<CurvePoint>& curve);

 private:
  bool compare_steps(const Trainer& trainer, const std::vector<ReferenceStep>& expected,
                     std::vector<CurvePoint>& curve) const;
  bool compare_skipped(const Trainer& trainer, const std::vector<ReferenceStep>& expected) const;

  GptConfig config_;
  std::string precision_;
  double loss_scale_ = 65536.0;
  commgrad::Group world_;
  std::map<std::string, std::vector<int64_t>> shapes_;
  NamedTensors initial_;
  NamedTensors resumed_;  // the parameters a resumed run started from
  int gradient_step_ = 1;
  std::vector<commgrad::checkpoint::TensorPiece> gradients_;
};

}  // namespace gpt
