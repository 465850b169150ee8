#pragma once
// commgrad::checkpoint: sharded, crash-safe checkpoints that reshard across
// tensor- and data-parallel layouts (docs/checkpoints.md).
//
//   tensor_piece.h  TensorPiece: one rank's box / flat range of a named tensor
//   save.h          save(): each rank writes its pieces (safetensors + index.json)
//   load.h          load(): fills pieces from any saved layout
//   directory.h     step directories and the `latest` pointer
//   module_state.h  module_pieces(): a (tensor-parallel) module's parameters and buffers
//   rng_state.h     rng_pieces() / restore_rng(): the TP RNG tracker's streams
//   optimizer_state.h  optimizer_pieces() / restore_optimizer(): a ZeroOptimizer's sharded state
//   loss_scaler_state.h  loss_scaler_pieces() / restore_loss_scaler(): a DynamicLossScaler's state
//   training_state.h  save_training_state() / load_training_state(): all of the above in one call
//   preemption.h    Preemption: SIGTERM / SIGUSR1 to "finish the step, save, exit 75"
//
// Example:
//   auto pieces = checkpoint::module_pieces(*model);
//   checkpoint::save("ckpt", step, pieces, {{"epoch", epoch}});
//   ...
//   auto result = checkpoint::load("ckpt", checkpoint::module_pieces(*model));  // any TP size

#include "commgrad/checkpoint/async_save.h"
#include "commgrad/checkpoint/directory.h"
#include "commgrad/checkpoint/fsdp_state.h"
#include "commgrad/checkpoint/load.h"
#include "commgrad/checkpoint/loss_scaler_state.h"
#include "commgrad/checkpoint/module_state.h"
#include "commgrad/checkpoint/optimizer_state.h"
#include "commgrad/checkpoint/preemption.h"
#include "commgrad/checkpoint/rng_state.h"
#include "commgrad/checkpoint/safetensors_file.h"
#include "commgrad/checkpoint/save.h"
#include "commgrad/checkpoint/tensor_piece.h"
#include "commgrad/checkpoint/training_state.h"
