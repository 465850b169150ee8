#pragma once
// commgrad fully sharded data parallelism: fully_shard (ZeRO-3 / FSDP2)
// over the data-parallel group, with a mixed-precision policy.

#include "commgrad/dp/mixed_precision.h"
#include "commgrad/fsdp/fully_shard.h"
