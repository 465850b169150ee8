#pragma once
// commgrad::tp: tensor parallelism (Megatron-style), Family 2 gradient
// semantics: one replicated loss per tensor-parallel group (DESIGN.md).
//
//   parallel_state.h  TP / PP / DP groups in Megatron's rank order
//   mappings.h        copy_to / reduce_from / scatter_to / gather_from the
//                     TP and sequence-parallel regions
//   linear.h          ColumnParallelLinear, RowParallelLinear
//   mlp.h             ParallelMLP (the Megatron FFN)
//   embedding.h       VocabParallelEmbedding
//   cross_entropy.h   vocab_parallel_cross_entropy
//   sharding.h        ShardSpec per parameter, full state dicts
//   random.h          tensor-parallel random streams, tp::dropout
//   attention.h       ParallelSelfAttention
//   transformer_layer.h  ParallelTransformerLayer
//   reference.h       the layers' unsplit, single-rank references
//
// Example:
//   commgrad::init_process_group();
//   commgrad::tp::initialize_model_parallel(2);
//   commgrad::tp::ParallelMLP mlp(commgrad::tp::ParallelMLPOptions(1024, 4096).seed(42));
//   auto y = mlp(x);

#include "commgrad/tp/cross_entropy.h"
#include "commgrad/tp/embedding.h"
#include "commgrad/tp/linear.h"
#include "commgrad/tp/mappings.h"
#include "commgrad/tp/mlp.h"
#include "commgrad/tp/parallel_state.h"
#include "commgrad/tp/sharding.h"
#include "commgrad/tp/random.h"
#include "commgrad/tp/attention.h"
#include "commgrad/tp/transformer_layer.h"
#include "commgrad/tp/reference.h"
