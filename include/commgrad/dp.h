#pragma once
// commgrad data parallelism: DistributedDataParallel and its communication hooks.

#include "commgrad/dp/comm_hooks.h"
#include "commgrad/dp/distributed_data_parallel.h"
#include "commgrad/dp/distributed_sampler.h"
#include "commgrad/dp/mixed_precision.h"
#include "commgrad/dp/replicas.h"
