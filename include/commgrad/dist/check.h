#pragma once
// Error checks that say which op, rank and group failed, as typed errors
// (util/error.h).

#include "commgrad/dist/group.h"
#include "commgrad/util/error.h"

#include <c10/util/Exception.h>

/// COMMGRAD_CHECK(cond, "all_gather", group, "expected dim 0 divisible by ", n, ", got ", x.sizes())
/// throws commgrad::InvalidArgumentError (a c10::Error)
/// "[commgrad] all_gather rank 2/4 group 'tp0' (gloo): expected ...".
#define COMMGRAD_CHECK(cond, op, group, ...) \
  COMMGRAD_CHECK_AS(::commgrad::ErrorKind::kInvalidArgument, cond, op, group, __VA_ARGS__)

/// COMMGRAD_CHECK with another kind of error (ErrorKind::kMismatch, ...).
#define COMMGRAD_CHECK_AS(kind, cond, op, group, ...)                             \
  do {                                                                            \
    if (C10_UNLIKELY(!(cond))) {                                                  \
      COMMGRAD_THROW((kind), ::commgrad::error_site((op), (group)), __VA_ARGS__); \
    }                                                                             \
  } while (false)

namespace commgrad {

/// The site of an error raised by `op` on `group` (and its collective #`collective`).
ErrorSite error_site(const std::string& op, const Group& group, int64_t collective = -1);

/// Throws unless this process is a member of `group` (and `group` is defined).
void check_member(const char* op, const Group& group);

}  // namespace commgrad
