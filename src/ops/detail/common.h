#pragma once
// Internals shared by the ops sources: the state behind raw::Pending, the
// per-call context, argument checks, the debug fingerprint exchange and the
// mapping of dtypes onto what the transport can carry.

#include "commgrad/detail/torch_compat.h"
#include "commgrad/dist/check.h"
#include "commgrad/ops/raw.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

namespace commgrad::ops::detail {

/// What a raw::Pending refers to: the transport's work handles and the local
/// step that turns their buffers into the result.
struct PendingState {
  const char* op = "";
  Group group;
  uint64_t sequence = 0;
  std::vector<commgrad::detail::WorkPtr> works;
  std::function<at::Tensor()> finish;  // runs once, after every work finished
  at::Tensor result;                   // set by finish (or directly)
  bool done = false;
  std::string error;                   // set when a work failed
};

/// The context of one raw call: op name, resolved group, rank, size, and the
/// sequence number taken once the local checks passed.
struct Call {
  Call(const char* op, const Group& group);
  const char* op;
  Group group;
  int rank;
  int size;
  uint64_t sequence = 0;

  /// Takes the sequence number: call after every local check.
  void start();
  /// The transport that carries tensors on x's device (CUDA tensors may have their own).
  commgrad::detail::TransportBase& transport(const at::Tensor& x) const { return group.transport(x.device().type()); }
  /// A Pending that is already complete with `result`.
  raw::Pending ready(at::Tensor result) const;
  /// A Pending for `works`, finished by `finish` (may be empty: `result`).
  raw::Pending pending(std::vector<commgrad::detail::WorkPtr> works, std::function<at::Tensor()> finish) const;
};

/// How the fingerprints of the ranks must relate beyond equal text.
enum class CrossCheck {
  kNone,        // lists unused
  kEqualLists,  // `a` (per-rank sizes) is the same list on every rank
  kTransposed,  // all_to_all: a (input splits) of rank r [s] == b (output splits) of rank s [r]
};

/// Debug mode: exchanges "<signature>" and the sequence number with every
/// member and throws on every rank, showing both sides, when they disagree.
/// A no-op when debug checks are off.
void check_fingerprint(const Call& call, const std::string& signature, const std::vector<int64_t>& a = {},
                       const std::vector<int64_t>& b = {}, CrossCheck cross = CrossCheck::kNone);

/// Debug mode for send/recv: both sides exchange a header (sizes, dtype,
/// requires_grad, tag) and throw when it differs.
void check_p2p_header(const Call& call, int peer, int tag, bool sending, at::IntArrayRef sizes,
                      at::ScalarType dtype, bool requires_grad);

/// "float32[4, 3]"; with `wild_dim` >= 0 that size prints as '*'.
std::string describe_tensor(const at::Tensor& x, int64_t wild_dim = -1);

/// Checks that x is defined and dense; returns nothing.
void check_tensor(const Call& call, const at::Tensor& x);
/// Wraps `dim` into [0, x.dim()) or throws naming the op and shape.
int64_t check_dim(const Call& call, const at::Tensor& x, int64_t dim);
/// Checks a group rank named by an option ("src", "dst").
void check_peer(const Call& call, const char* what, int peer);
/// Checks a per-rank list: one entry per rank, none negative; with
/// `total` >= 0 they must add up to it.
void check_sizes(const Call& call, const char* what, const std::vector<int64_t>& sizes, int64_t total,
                 const at::Tensor& x, int64_t dim);

/// True when the transport moves this dtype natively (else it travels as bytes).
bool wire_native(at::ScalarType dtype);
/// A flat 1-D view of contiguous `t` in a dtype the transport carries.
at::Tensor wire(const at::Tensor& t);
/// Elements of wire(t) per element of t.
int64_t wire_scale(at::ScalarType dtype);
/// The dtype a reduction runs in (float32 for half and bfloat16).
at::ScalarType reduce_dtype(const Call& call, at::ScalarType dtype, ReduceOp op);
/// The c10d reduction that implements `op` (AVG runs as SUM).
c10d::ReduceOp to_c10d(ReduceOp op);

/// The backward halves of the differentiable send/recv pair: the gradient
/// travels in its own tag space, so it never matches a forward message.
raw::Pending send_gradient(const at::Tensor& grad, int dst, int tag, const Group& group);
raw::Pending recv_gradient(at::IntArrayRef sizes, at::ScalarType dtype, int src, int tag, const Group& group);

/// Tag spaces of the point-to-point messages.
constexpr int kMaxUserTag = 1 << 24;
constexpr int kHeaderTagBase = 1 << 24;
constexpr int kGradTagBase = 1 << 25;

}  // namespace commgrad::ops::detail
