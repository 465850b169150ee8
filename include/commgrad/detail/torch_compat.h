#pragma once
// The one place that knows which LibTorch it is compiled against.
//
// c10d changed shape between LibTorch 1.13 and 2.x: in 1.13 a transport
// (ProcessGroupGloo) *is* a c10d::ProcessGroup; from 2.0 on it is a
// c10d::Backend wrapped by a ProcessGroup, and the Dist*Error exception types
// appeared. Everything else in commgrad talks to the aliases and helpers
// below and contains no version #if.

#include <torch/version.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

#include <string>

namespace commgrad::detail {

#if TORCH_VERSION_MAJOR >= 2
/// The c10d class a transport implements (c10d::Backend in LibTorch 2.x).
using TransportBase = c10d::Backend;
#define COMMGRAD_TORCH_HAS_BACKEND 1
#else
/// The c10d class a transport implements (c10d::ProcessGroup in LibTorch 1.13).
using TransportBase = c10d::ProcessGroup;
#define COMMGRAD_TORCH_HAS_BACKEND 0
#endif

using TransportPtr = c10::intrusive_ptr<TransportBase>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using StorePtr = c10::intrusive_ptr<c10d::Store>;

/// Throws the most specific distributed error type this LibTorch has
/// (c10::DistBackendError in 2.1+, c10::Error otherwise).
[[noreturn]] void throw_dist_error(const std::string& message);

/// Throws a timeout error (c10::DistNetworkError-like in 2.1+, c10::Error otherwise).
[[noreturn]] void throw_timeout_error(const std::string& message);

/// Waits for a work handle; the transport's own timeout applies.
void wait_work(const WorkPtr& work);

}  // namespace commgrad::detail
