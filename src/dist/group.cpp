#include "commgrad/dist/check.h"
#include "commgrad/dist/group.h"
#include "commgrad/util/print.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>

namespace commgrad {

const detail::GroupState& Group::checked() const {
  TORCH_CHECK(state_ != nullptr,
              "[commgrad] use of an empty Group handle; get one from init_process_group(), world() or new_group()");
  return *state_;
}

bool Group::is_member() const { return checked().rank >= 0; }
int Group::rank() const { return checked().rank; }
int Group::size() const { return static_cast<int>(checked().ranks.size()); }
const std::string& Group::name() const { return checked().name; }
const std::string& Group::backend_name() const { return checked().backend; }
const std::vector<int>& Group::ranks() const { return checked().ranks; }
std::chrono::milliseconds Group::timeout() const { return checked().timeout; }
const detail::StorePtr& Group::store() const { return checked().store; }

int Group::global_rank(int group_rank) const {
  const auto& s = checked();
  TORCH_CHECK(group_rank >= 0 && group_rank < static_cast<int>(s.ranks.size()), "[commgrad] ", describe(),
              ": group rank ", group_rank, " is out of range (group size ", s.ranks.size(), ")");
  return s.ranks[group_rank];
}

int Group::group_rank_of(int global_rank) const {
  const auto& r = checked().ranks;
  auto it = std::find(r.begin(), r.end(), global_rank);
  return it == r.end() ? -1 : static_cast<int>(it - r.begin());
}

bool Group::single_host() const {
  const auto& hosts = checked().hosts;
  return std::all_of(hosts.begin(), hosts.end(), [&](const std::string& h) { return h == hosts.front(); });
}

detail::TransportBase& Group::transport() const { return *transport_ptr(); }

const detail::TransportPtr& Group::transport_ptr() const {
  const auto& s = checked();
  TORCH_CHECK(s.transport, "[commgrad] ", describe(), ": this rank is not a member of the group");
  return s.transport;
}

detail::TransportBase& Group::transport(c10::DeviceType device) const {
  detail::TransportBase& cpu = transport();  // throws for a rank outside the group
  if (device != c10::DeviceType::CUDA) return cpu;
  const auto& s = checked();
  TORCH_CHECK(s.cuda_transport, "[commgrad] ", describe(),
              ": got a CUDA tensor, but this process saw no CUDA device when the group was created");
  return *s.cuda_transport;
}

const detail::TransportCapabilities& Group::capabilities(c10::DeviceType device) const {
  transport(device);  // the same checks: a member, with a transport for `device`
  const auto& s = checked();
  return device == c10::DeviceType::CUDA ? s.cuda_capabilities : s.capabilities;
}

const std::string& Group::cuda_backend_name() const { return checked().cuda_backend; }

uint64_t Group::next_sequence() const { return state_->sequence.fetch_add(1); }

std::string Group::describe() const { return state_ ? detail::describe(*state_) : std::string("(no group)"); }

std::string detail::describe(const GroupState& s) {
  if (s.rank < 0) {
    return c10::str("rank ", s.global_rank, " (not a member) group '", s.name, "' of ranks ", format_ranks(s.ranks));
  }
  const bool own_cuda = !s.cuda_backend.empty() && s.cuda_backend != s.backend;
  const std::string transports = own_cuda ? c10::str(s.backend, ", cuda: ", s.cuda_backend) : s.backend;
  return c10::str("rank ", s.rank, "/", s.ranks.size(), " group '", s.name, "' (", transports, ")");
}

}  // namespace commgrad
