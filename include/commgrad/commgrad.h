#pragma once
// commgrad: differentiable collectives, tensor and data parallelism for LibTorch.
// This umbrella header includes every public header (like torch/torch.h).

#include "commgrad/config.h"
#include "commgrad/dist/build_info.h"
#include "commgrad/dist/check.h"
#include "commgrad/dist/device.h"
#include "commgrad/dist/environment.h"
#include "commgrad/dist/group.h"
#include "commgrad/dist/process_group.h"
#include "commgrad/dist/transport.h"
#include "commgrad/util/blas.h"
#include "commgrad/util/buffer_pool.h"
#include "commgrad/util/logging.h"
#include "commgrad/util/print.h"

// Layers that are built as separate libraries (see CMakeLists.txt).
#if __has_include("commgrad/backend.h")
#include "commgrad/backend.h"
#endif
#if __has_include("commgrad/ops.h")
#include "commgrad/ops.h"
#endif
#if __has_include("commgrad/tp.h")
#include "commgrad/tp.h"
#endif
#if __has_include("commgrad/dp.h")
#include "commgrad/dp.h"
#endif
#if __has_include("commgrad/optim.h")
#include "commgrad/optim.h"
#endif
#if __has_include("commgrad/pp.h")
#include "commgrad/pp.h"
#endif
#if __has_include("commgrad/check.h")
#include "commgrad/check.h"
#endif
#if __has_include("commgrad/checkpoint.h")
#include "commgrad/checkpoint.h"
#endif
