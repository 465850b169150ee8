#pragma once
// gpt_train --check-recompute: the same layout trained without recompute,
// with selective and with full recompute, compared bit for bit.
//
// Activation recomputation replays every random stream (tp/recompute.h),
// so with dropout on the three trainings must give the same losses and
// the same parameters, to the last bit, at every layout and schedule: a
// mask drawn anew in the rerun, a weight gradient lost or counted twice, a
// collective re-issued out of order would each change them. Each training
// is a fresh Trainer (the dropout streams seeded again) over the same
// groups; each rank compares its own parameters (FNV-1a over their bytes)
// and the verdict is agreed over the world.

#include "corpus.h"
#include "model.h"
#include "trainer.h"

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace gpt {

/// 64-bit FNV-1a over the names, shapes, dtypes and bytes of `module`'s parameters.
uint64_t parameter_digest(const torch::nn::Module& module);

/// Each transformer layer of `model` with its recomputation, in order:
/// "layer0 full, layer1 none".
std::string layer_recomputation(const torch::nn::Module& model);

/// Trains `steps` steps of `config` under `recompute` with a fresh Trainer
/// on every rank of `world`, once per granularity (none, selective, full;
/// config.recompute_layers applies to the last two); rank 0 prints one
/// line per granularity. True on every rank when every loss and every
/// rank's parameters equal those without recompute, bit for bit.
bool recompute_matches(const TrainerOptions& options, const GptConfig& config, const Layout& layout,
                       const Corpus& corpus, int steps, const commgrad::Group& world);

}  // namespace gpt
