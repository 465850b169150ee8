// Version-specific bits of detail/torch_compat.h.

#include "commgrad/detail/torch_compat.h"

#include <c10/util/Exception.h>

namespace commgrad::detail {

void throw_dist_error(const std::string& message) {
#if COMMGRAD_TORCH_AT_LEAST(2, 1)
  C10_THROW_ERROR(DistBackendError, message);
#else
  TORCH_CHECK(false, message);
#endif
}

void throw_timeout_error(const std::string& message) {
#if COMMGRAD_TORCH_AT_LEAST(2, 1)
  C10_THROW_ERROR(DistNetworkError, message);
#else
  TORCH_CHECK(false, message);
#endif
}

void wait_work(const WorkPtr& work) { work->wait(); }

}  // namespace commgrad::detail
