#pragma once
// commgrad::tp: tensor parallelism (Megatron-style), Family 2 gradient
// semantics: one replicated loss per tensor-parallel group (docs/design.md).
//
//   parallel_state.h  how layers find their TP group (the layout itself is
//                     dist/parallel_state.h)
//   mappings.h        copy_to / reduce_from / scatter_to / gather_from the
//                     TP and sequence-parallel regions
//   linear.h          ColumnParallelLinear, RowParallelLinear
//   mlp.h             ParallelMLP (the Megatron FFN)
//   embedding.h       VocabParallelEmbedding
//   cross_entropy.h   vocab_parallel_cross_entropy
//   sharding.h        ShardSpec per parameter, full state dicts
//   wiring_checks.h   a module's TP group against a wrapper's groups
//   replica_check.h   TP-replicated parameters still equal (COMMGRAD_DEBUG)
//   random.h          tensor-parallel random streams, tp::dropout
//   attention.h       ParallelSelfAttention
//   transformer_layer.h  ParallelTransformerLayer
//   weight_gradients.h   deferred weight gradients (the zero-bubble W step)
//   reference.h       the layers' unsplit, single-rank references
//
// Example:
//   commgrad::init_process_group();
//   commgrad::initialize_model_parallel(2);
//   commgrad::tp::ParallelMLP mlp(commgrad::tp::ParallelMLPOptions(1024, 4096).seed(42));
//   auto y = mlp(x);

#include "commgrad/tp/cross_entropy.h"
#include "commgrad/tp/embedding.h"
#include "commgrad/tp/linear.h"
#include "commgrad/tp/mappings.h"
#include "commgrad/tp/mlp.h"
#include "commgrad/tp/parallel_state.h"
#include "commgrad/tp/sharding.h"
#include "commgrad/tp/wiring_checks.h"
#include "commgrad/tp/replica_check.h"
#include "commgrad/tp/random.h"
#include "commgrad/tp/recompute.h"
#include "commgrad/tp/attention.h"
#include "commgrad/tp/transformer_layer.h"
#include "commgrad/tp/weight_gradients.h"
#include "commgrad/tp/reference.h"
