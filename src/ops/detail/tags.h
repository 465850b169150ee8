#pragma once
// What raw.cpp offers the other ops sources beyond ops/raw.h: the tag spaces
// of point-to-point messages and the backward halves of send/recv.

#include "commgrad/ops/raw.h"

#include <c10/core/ScalarType.h>

namespace commgrad::ops::detail {

/// Tag spaces of the point-to-point messages: user tags, and gradients
/// (which so never match a forward message). Debug headers travel on their
/// message's own tag, just before it.
constexpr int kMaxUserTag = 1 << 24;
constexpr int kGradTagBase = 1 << 25;

/// Sends / receives the gradient of the differentiable send/recv pair.
raw::Pending send_gradient(const at::Tensor& grad, int dst, int tag, const Group& group);
raw::Pending recv_gradient(at::IntArrayRef sizes, at::ScalarType dtype, int src, int tag, const Group& group);

}  // namespace commgrad::ops::detail
