#pragma once
// commgrad: differentiable collectives, tensor and data parallelism for LibTorch.
// This umbrella header includes every public header (like torch/torch.h).

#include "commgrad/config.h"
#include "commgrad/dist/check.h"
#include "commgrad/dist/environment.h"
#include "commgrad/dist/group.h"
#include "commgrad/dist/process_group.h"
#include "commgrad/dist/transport.h"
#include "commgrad/util/logging.h"
#include "commgrad/util/print.h"
