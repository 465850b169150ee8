// Membership checks and error sites shared by every layer (dist/check.h).

#include "commgrad/dist/check.h"

#include "commgrad/util/print.h"

namespace commgrad {

ErrorSite error_site(const std::string& op, const Group& group, int64_t collective) {
  ErrorSite site = make_site(op, group.describe());
  site.collective = collective;
  if (group.defined()) {
    site.group = group.name();
    site.group_size = group.size();
    if (group.is_member()) site.rank = group.rank();
  }
  return site;
}

void check_member(const char* op, const Group& group) {
  if (!group.defined()) {
    COMMGRAD_THROW(ErrorKind::kInvalidArgument, make_site(op),
                   "the group handle is empty (was init_process_group() called?)");
  }
  COMMGRAD_CHECK(group.is_member(), op, group, "this rank is not a member of the group; only ranks ",
                 format_ranks(group.ranks()), " may call collectives on it");
}

}  // namespace commgrad
