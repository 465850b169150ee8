// Membership checks shared by every layer (dist/check.h).

#include "commgrad/dist/check.h"

#include "commgrad/util/print.h"

namespace commgrad {

void check_member(const char* op, const Group& group) {
  TORCH_CHECK(group.defined(), "[commgrad] ", op, ": the group handle is empty (was init_process_group() called?)");
  COMMGRAD_CHECK(group.is_member(), op, group, "this rank is not a member of the group; only ranks ",
                 format_ranks(group.ranks()), " may call collectives on it");
}

}  // namespace commgrad
