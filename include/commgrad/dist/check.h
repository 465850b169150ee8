#pragma once
// Error checks that say which op, rank and group failed.

#include "commgrad/dist/group.h"

#include <c10/util/Exception.h>

/// COMMGRAD_CHECK(cond, "all_gather", group, "expected dim 0 divisible by ", n, ", got ", x.sizes())
/// throws c10::Error "[commgrad] all_gather rank 2/4 group 'tp0' (gloo): expected ...".
#define COMMGRAD_CHECK(cond, op, group, ...) \
  TORCH_CHECK((cond), "[commgrad] ", (op), " ", (group).describe(), ": ", __VA_ARGS__)

namespace commgrad {

/// Throws unless this process is a member of `group` (and `group` is defined).
void check_member(const char* op, const Group& group);

}  // namespace commgrad
