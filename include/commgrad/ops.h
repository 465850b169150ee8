#pragma once
// commgrad::ops: Family 1 differentiable collectives (summed per-rank
// losses), their asynchronous forms and the raw building blocks under them.

#include "commgrad/ops/async.h"
#include "commgrad/ops/collectives.h"
#include "commgrad/ops/debug.h"
#include "commgrad/ops/options.h"
#include "commgrad/ops/raw.h"
#include "commgrad/ops/reduce_op.h"
