#pragma once
// A process group: the ranks that take part in a collective, and the
// transport (Gloo, NCCL, shm) that carries it.

#include "commgrad/detail/torch_compat.h"
#include "commgrad/dist/environment.h"
#include "commgrad/dist/transport.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace commgrad {

namespace detail {
/// What a Group shares between its copies. Not part of the public API.
struct GroupState {
  std::string name;
  std::string backend;                 // the transport of CPU tensors: "gloo" or "shm"
  std::string requested_backend;       // what was asked for ("auto", "nccl", ...); sub-groups inherit it
  int rank = -1;                       // rank within the group; -1 when not a member
  int global_rank = -1;                // this process's rank in the world
  std::vector<int> ranks;              // global ranks of the members, in group-rank order
  std::vector<std::string> hosts;      // host identity of each member, by group rank
  std::vector<std::string> addresses;  // each member's address towards the rendezvous host ("" unknown)
  std::chrono::milliseconds timeout{0};
  StorePtr store;                      // prefixed for this group
  StorePtr root_store;                 // the job's store, unprefixed (sub-groups prefix it)
  LaunchEnvironment launch;            // the world's launch environment
  TransportPtr transport;              // null when not a member
  TransportCapabilities capabilities;  // what `transport` offers beyond c10d
  // Where this process has CUDA devices: the transport of CUDA tensors
  // ("nccl" when every local rank has a GPU of its own, else "gloo", which
  // carries CUDA tensors too; c10d 2.x also keeps one backend per device type).
  std::string cuda_backend;     // empty without CUDA devices
  TransportPtr cuda_transport;  // may be `transport` itself (Gloo)
  TransportCapabilities cuda_capabilities;
  std::atomic<uint64_t> sequence{0};   // collectives issued on this group
  std::atomic<uint64_t> subgroups{0};  // new_group calls made on this (world) group
};

/// Group::describe() of a group's state.
std::string describe(const GroupState& state);
}  // namespace detail

/// A handle to a process group; cheap to copy (copies share the group).
///
/// Example:
///   commgrad::Group world = commgrad::init_process_group();
///   std::cout << world.describe();   // "rank 0/4 group 'world' (gloo)"
class Group {
 public:
  /// An empty handle (no group).
  Group() = default;
  explicit Group(std::shared_ptr<detail::GroupState> state) : state_(std::move(state)) {}

  /// True when this handle refers to a group.
  bool defined() const { return state_ != nullptr; }
  /// True when this process is one of the group's ranks.
  bool is_member() const;
  /// This process's rank within the group (-1 when not a member).
  int rank() const;
  /// Number of ranks in the group.
  int size() const;
  /// The group's name ("world", "tp0", ...), used in every error message.
  const std::string& name() const;
  /// The transport of CPU tensors: "gloo" or "shm".
  const std::string& backend_name() const;
  /// Global (world) ranks of the members, in group-rank order.
  const std::vector<int>& ranks() const;
  /// Global rank of the member with group rank `group_rank`.
  int global_rank(int group_rank) const;
  /// Group rank of global rank `global_rank`, or -1 when it is not a member.
  int group_rank_of(int global_rank) const;
  /// True when every member runs on this host.
  bool single_host() const;
  /// How long a collective on this group may take before it fails.
  std::chrono::milliseconds timeout() const;

  /// The c10d transport of CPU tensors (Gloo/shm). Throws when this rank is not a member.
  detail::TransportBase& transport() const;
  const detail::TransportPtr& transport_ptr() const;
  /// The transport of tensors on `device`: CUDA tensors travel on the
  /// group's CUDA transport (see cuda_backend_name()), all others on transport().
  detail::TransportBase& transport(c10::DeviceType device) const;
  /// What the transport of tensors on `device` offers beyond c10d's
  /// interface (out-of-place reductions, ...): ask this, not the transport's type.
  const detail::TransportCapabilities& capabilities(c10::DeviceType device = c10::DeviceType::CPU) const;
  /// "nccl" or "gloo": what carries this group's CUDA tensors; empty where
  /// the process sees no CUDA device.
  const std::string& cuda_backend_name() const;
  /// The group's key-value store (prefixed, shared by its members).
  const detail::StorePtr& store() const;

  /// Counts one more collective issued on this group and returns its number
  /// (0, 1, ...): the same on every member as long as they call the same ops.
  uint64_t next_sequence() const;

  /// "rank 2/4 group 'tp0' (gloo)" — the context every error message carries;
  /// "(shm, cuda: nccl)" where CUDA tensors have a transport of their own.
  std::string describe() const;

  bool operator==(const Group& other) const { return state_ == other.state_; }
  bool operator!=(const Group& other) const { return state_ != other.state_; }

  /// For the layers above (new_group, backends); not needed by users.
  const std::shared_ptr<detail::GroupState>& state() const { return state_; }

 private:
  const detail::GroupState& checked() const;
  std::shared_ptr<detail::GroupState> state_;
};

}  // namespace commgrad
