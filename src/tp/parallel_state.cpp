// The tensor-parallel side of the parallel layout (dist/parallel_state.h):
// how layers find their group.

#include "commgrad/tp/parallel_state.h"

#include "commgrad/dist/check.h"

#include <c10/util/Exception.h>

namespace commgrad::tp {

Group resolve_tp_group(const Group& group, const char* op) {
  if (group.defined()) {
    check_member(op, group);
    return group;
  }
  TORCH_CHECK(model_parallel_is_initialized(), "[commgrad] ", op,
              ": no tensor-parallel group given and model parallelism is not initialised; pass the group "
              "(e.g. in the options) or call commgrad::initialize_model_parallel(tp_size) first");
  return parallel_state().tensor_parallel_group();
}

}  // namespace commgrad::tp
