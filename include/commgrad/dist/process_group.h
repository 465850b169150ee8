#pragma once
// Starting and ending a distributed job: init_process_group(), the world
// group, sub-groups, destroy_process_group().

#include "commgrad/dist/environment.h"
#include "commgrad/dist/group.h"

#include <torch/arg.h>

#include <chrono>
#include <string>
#include <vector>

namespace commgrad {

/// Default collective and rendezvous timeout (overridden by the option or by
/// the COMMGRAD_TIMEOUT environment variable, in seconds).
constexpr std::chrono::milliseconds kDefaultTimeout = std::chrono::minutes(5);

/// Options of init_process_group().
struct InitOptions {
  /// "auto" (NCCL for CUDA builds, else shm on one host, else Gloo), "gloo", "nccl" or "shm".
  /// With "auto", the environment variable COMMGRAD_BACKEND decides when set.
  TORCH_ARG(std::string, backend) = "auto";
  /// Rendezvous and collective timeout; 0 means COMMGRAD_TIMEOUT or kDefaultTimeout.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::milliseconds(0);
  /// LibTorch intra-op threads (and OpenBLAS threads) for this rank; 0 leaves
  /// the libraries' defaults. One by default, because ranks usually outnumber cores.
  TORCH_ARG(int, intra_op_threads) = 1;
  /// A store to rendezvous on instead of a TCPStore at MASTER_ADDR:MASTER_PORT,
  /// with explicit rank and world size (like torch.distributed's `store=`).
  TORCH_ARG(detail::StorePtr, store) = {};
  TORCH_ARG(int, rank) = -1;
  TORCH_ARG(int, world_size) = -1;
  /// Install commgrad's terminate handler (dist/terminate_handler.h): when a
  /// transport thread ends the process with an exception nobody can catch, it
  /// names the last collective started and the likely cause first.
  TORCH_ARG(bool, terminate_handler) = true;
};

/// Joins the job described by the environment (see environment.h) and
/// returns the world group. Rank 0 hosts a c10d TCPStore at
/// MASTER_ADDR:MASTER_PORT; every rank joins it within the timeout or gets an
/// error saying how many joined and which are missing. Without launcher
/// variables the program runs as a world of one (with a one-line notice).
///
/// Example:
///   auto world = commgrad::init_process_group();
///   ... commgrad::ops::all_reduce(x) ...
///   commgrad::destroy_process_group();
Group init_process_group(const InitOptions& options = {});

/// Builds a world group like init_process_group(options) but does not make it
/// the process's world; install it per thread with ScopedWorld. This is how
/// in-process multi-rank harnesses run one rank per thread.
Group make_world_group(const InitOptions& options);

/// Options of connect_group().
struct ConnectOptions {
  /// "auto" (shm when every rank is on one host, hierarchical or Gloo when
  /// they span hosts), "gloo", "shm" or "hierarchical"; see resolve_backend().
  TORCH_ARG(std::string, backend) = "auto";
  /// Connect and collective timeout; 0 means COMMGRAD_TIMEOUT or kDefaultTimeout.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::milliseconds(0);
  /// The group's name in error messages.
  TORCH_ARG(std::string, name) = "world";
};

/// Builds a group of `size` ranks that meet in `store`, a store the caller
/// has already rendezvoused and prefixed for this group alone (as c10d does
/// for the backends it creates): the ranks exchange their host identities
/// there, "auto" becomes shm when they share a host (decided for this group,
/// as new_group() does), and the transport of CPU tensors connects. Unlike
/// make_world_group() it has no process-wide effects: it sets no thread
/// counts, no CUDA device and no terminate handler, and creates no transport
/// for CUDA tensors. This is the group behind the "commgrad" backend that
/// `import commgrad` registers with torch.distributed.
///
/// Example:
///   auto group = commgrad::connect_group(store, rank, size,
///                                        commgrad::ConnectOptions().name("tp0"));
///   group.transport().allreduce(tensors)->wait();
Group connect_group(const detail::StorePtr& store, int rank, int size, const ConnectOptions& options = {});

/// Leaves the job: waits for every rank (so rank 0 keeps the store alive until
/// the others are done) and releases the world and all sub-groups.
void destroy_process_group();

/// True between init_process_group() and destroy_process_group().
bool is_initialized();

/// The world group (this thread's ScopedWorld if any, else the process's).
/// Throws when init_process_group() has not been called.
Group world();

/// Shortcuts for world().rank() / world().size(), and the local rank/size of
/// the launch environment.
int rank();
int world_size();
int local_rank();
int local_world_size();

/// The launch environment the world was built from.
const LaunchEnvironment& launch_environment();

/// Options of new_group().
struct NewGroupOptions {
  /// Shown in errors; default "group<k>" for the k-th new_group call.
  TORCH_ARG(std::string, name) = "";
  /// Transport; empty means the world's backend.
  TORCH_ARG(std::string, backend) = "";
  /// 0 means the world's timeout.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::milliseconds(0);
};

/// Creates a sub-group of the world with the given global ranks (in that
/// order of group ranks). Every rank of the world must call it, with the
/// same arguments in the same order, as c10d requires; ranks outside `ranks`
/// get a handle with is_member() == false, and any op on it is an error.
///
/// Example:
///   auto pair = commgrad::new_group({0, 1}, commgrad::NewGroupOptions().name("pair"));
Group new_group(const std::vector<int>& ranks, const NewGroupOptions& options = {});

/// Makes `group` the world of the current thread while it lives (for
/// in-process harnesses that run one rank per thread).
class ScopedWorld {
 public:
  explicit ScopedWorld(Group group);
  ~ScopedWorld();
  ScopedWorld(const ScopedWorld&) = delete;
  ScopedWorld& operator=(const ScopedWorld&) = delete;

 private:
  Group previous_;
};

}  // namespace commgrad
