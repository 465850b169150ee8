#pragma once
// Internals shared by the tp sources: carrying a Group through an autograd
// context, and the checks every mapping and layer makes.

#include "commgrad/dist/check.h"
#include "commgrad/dist/group.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <string>

namespace commgrad::tp::detail {

/// A Group in an IValue (ctx->saved_data holds IValues only).
struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(Group g) : group(std::move(g)) {}
  Group group;
};

inline void save_group(torch::autograd::AutogradContext* ctx, const Group& group) {
  ctx->saved_data["group"] = at::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(group));
}

inline Group saved_group(torch::autograd::AutogradContext* ctx) {
  auto capsule = ctx->saved_data["group"].toCapsule();
  return static_cast<GroupCapsule*>(capsule.get())->group;
}

/// "float32[4, 3]".
std::string describe(const at::Tensor& x);

/// Checks that x is a defined dense tensor with at least one dim and wraps
/// `dim` into [0, x.dim()); errors name `op` and the group.
int64_t check_dim(const char* op, const Group& group, const at::Tensor& x, int64_t dim);

/// Checks that dim `dim` of x divides by `parts` (the group size).
void check_divisible(const char* op, const Group& group, const at::Tensor& x, int64_t dim, int64_t parts);

}  // namespace commgrad::tp::detail
