#pragma once
// Faults on purpose, for the restart and preemption tests of gpt_train:
// GPT_TRAIN_FAULT names one (unset: none).
//
//   kill:N[:R]          rank 0 SIGKILLs itself as step N begins, on the
//                       job's first R starts (TORCHELASTIC_RESTART_COUNT < R;
//                       R defaults to 1: the restarted job runs through)
//   preempt:N           rank 0 sends SIGTERM to its launcher as step N begins
//                       (the launcher forwards it to every rank: a preemption)
//   preempt-twice:N     ... and a second SIGTERM as the save of the
//                       preemption begins (the launcher then SIGKILLs the ranks)
//   kill-node:N         on the job's first start, the last rank SIGKILLs its
//                       launcher as step N begins: the ranks of that node die
//                       with it (parent-death signal) and the node does not
//                       come back (commgrad-run --nnodes MIN:MAX goes on without it)
//   grad-scale:F[:NAME] every rank multiplies its pieces of every gradient (or
//                       of parameter NAME's alone) by F after the reductions
//                       and before clipping, at every step: a wrong gradient
//                       that --check must catch (the reference is untouched;
//                       F = nan makes the gradients NaN)

#include <commgrad/checkpoint/tensor_piece.h>

#include <string>
#include <vector>

namespace gpt {

class Faults {
 public:
  /// Reads GPT_TRAIN_FAULT; throws std::invalid_argument naming a bad value.
  static Faults from_environment();

  /// As step `step` (1-based) begins on rank `rank`.
  void step_begins(int step, int rank) const;
  /// As the save after a preemption begins on rank `rank`.
  void preemption_save_begins(int rank) const;
  /// grad-scale: scales the gradients (the trainer's GradientInspector).
  void scale_gradients(const std::vector<commgrad::checkpoint::TensorPiece>& gradients) const;
  /// True for grad-scale (the trainer must hand it the gradients).
  bool scales_gradients() const { return kind_ == "grad-scale"; }

 private:
  static Faults grad_scale(const char* text);
  void kill_node(int step, int rank) const;

  std::string kind_;
  int step_ = -1;
  int starts_ = 1;
  double factor_ = 1.0;
  std::string parameter_;  // grad-scale: the one parameter (empty: all)
};

}  // namespace gpt
