// Version-specific bits of detail/torch_compat.h.

#include "commgrad/detail/torch_compat.h"

namespace commgrad::detail {

void wait_work(const WorkPtr& work) { work->wait(); }

}  // namespace commgrad::detail
