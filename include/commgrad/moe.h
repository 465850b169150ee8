#pragma once
// commgrad::moe: mixture of experts with expert parallelism (docs/moe.md).
//
//   router.h            TopKRouter: gating linear, top-k over softmax, the
//                       switch load-balancing loss and z-loss injected into backward
//   experts.h           Experts: this rank's expert MLPs, run in a loop
//   token_dispatcher.h  tokens to the ranks of their experts and back
//                       (differentiable all-to-all; all-gather for comparison)
//   moe_layer.h         MoELayer: the block the transformer's FFN becomes
//   expert_data_parallel.h  which group reduces which gradient (dense: data x
//                       context; experts: expert-data, divided by data x context)
//
// Example:
//   auto state = commgrad::make_model_parallel(commgrad::ModelParallelOptions().expert_parallel_size(2));
//   commgrad::moe::MoELayer moe(commgrad::moe::MoELayerOptions(64, 128, 4, 2, state.expert_parallel_group()));
//   auto y = moe(x);

#include "commgrad/moe/router.h"
#include "commgrad/moe/experts.h"
#include "commgrad/moe/token_dispatcher.h"
#include "commgrad/moe/moe_layer.h"
#include "commgrad/moe/expert_data_parallel.h"
