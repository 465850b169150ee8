#pragma once
// commgrad optimizers: ZeRO-1/2 sharded optimizer, global-norm clipping,
// dynamic loss scaling and access to torch::optim state by name.

#include "commgrad/optim/clip_grad.h"
#include "commgrad/optim/loss_scaler.h"
#include "commgrad/optim/param_state.h"
#include "commgrad/optim/zero_optimizer.h"
