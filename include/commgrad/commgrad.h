#pragma once
// commgrad: differentiable collectives, tensor and data parallelism for LibTorch.
// This umbrella header includes every public header (like torch/torch.h).

#include "commgrad/config.h"
#include "commgrad/dist/build_info.h"
#include "commgrad/dist/check.h"
#include "commgrad/dist/device.h"
#include "commgrad/dist/environment.h"
#include "commgrad/dist/group.h"
#include "commgrad/dist/parallel_state.h"
#include "commgrad/dist/process_group.h"
#include "commgrad/dist/transport.h"
#include "commgrad/dist/uncaught_error.h"
#include "commgrad/util/blas.h"
#include "commgrad/util/buffer_pool.h"
#include "commgrad/util/error.h"
#include "commgrad/util/logging.h"
#include "commgrad/util/print.h"

// The layers built as separate libraries (see CMakeLists.txt), bottom up.
#include "commgrad/backend.h"
#include "commgrad/ops.h"
#include "commgrad/cp.h"
#include "commgrad/tp.h"
#include "commgrad/dp.h"
#include "commgrad/optim.h"
#include "commgrad/fsdp.h"
#include "commgrad/moe.h"
#include "commgrad/pp.h"
#include "commgrad/check.h"
#include "commgrad/checkpoint.h"
