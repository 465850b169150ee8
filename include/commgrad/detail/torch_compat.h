#pragma once
// The one place that knows which LibTorch it is compiled against.
//
// Every difference between the LibTorch lines commgrad supports (1.13 and
// 2.x) lives here or in src/util/torch_compat.cpp, with the release where it
// changed; everything else talks to the aliases and helpers below and
// contains no version #if. The differences:
//   2.0   a transport (ProcessGroupGloo) is a c10d::Backend wrapped by a
//         ProcessGroup; in 1.13 it *is* a c10d::ProcessGroup.
//   2.1   the c10::Dist*Error exception types.
//   2.3   c10::Allocator::allocate() lost its const and copy_data() became
//         pure virtual (AllocatorBase).
//   2.13  autograd nodes are owned by c10::intrusive_ptr instead of
//         std::shared_ptr (NodePtr, make_node; pytorch#181782).
//   2.14  the headers need C++20 (CMakeLists.txt picks the standard).
// Not a version difference but a packaging one: no torch wheel ships Gloo's
// headers, which c10d/ProcessGroupGloo.hpp includes; Debian's libgloo-dev
// provides them on both lines (commgrad only holds Gloo objects through
// shared_ptr, so their layout never enters its code).

#include <torch/version.h>

#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

#include <memory>
#include <string>
#include <type_traits>
#include <utility>

/// True when compiling against LibTorch `major.minor` or later.
#define COMMGRAD_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

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

/// The c10 classes commgrad's errors derive from (util/error.h): a failed
/// transport is a c10::DistBackendError and a timeout a c10::DistNetworkError
/// from 2.1 on (LibTorch translates both to torch.distributed's classes in
/// Python); 1.13 has neither, and both are c10::Error there.
#if COMMGRAD_TORCH_AT_LEAST(2, 1)
using DistErrorBase = c10::DistBackendError;
using TimeoutErrorBase = c10::DistNetworkError;
#else
using DistErrorBase = c10::Error;
using TimeoutErrorBase = c10::Error;
#endif

/// Waits for a work handle; the transport's own timeout applies.
void wait_work(const WorkPtr& work);

/// An owning pointer to an autograd node: std::shared_ptr up to 2.12,
/// c10::intrusive_ptr from 2.13 on (detected from the types themselves).
constexpr bool kIntrusiveNodes = std::is_base_of_v<c10::intrusive_ptr_target, torch::autograd::Node>;
using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

/// Creates an autograd node of type T owned the way this LibTorch owns nodes.
template <class T, class... Args>
auto make_node(Args&&... args) {
  if constexpr (kIntrusiveNodes) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  } else {
    return std::make_shared<T>(std::forward<Args>(args)...);
  }
}

/// A c10::Allocator written once for every line: implement allocate_bytes().
/// (2.3 made c10::Allocator::allocate() non-const and copy_data() pure virtual.)
struct AllocatorBase : c10::Allocator {
  virtual c10::DataPtr allocate_bytes(size_t n) const = 0;
#if COMMGRAD_TORCH_AT_LEAST(2, 3)
  c10::DataPtr allocate(size_t n) override { return allocate_bytes(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
#else
  c10::DataPtr allocate(size_t n) const override { return allocate_bytes(n); }
#endif
};

}  // namespace commgrad::detail
