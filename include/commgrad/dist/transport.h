#pragma once
// Creating the c10d transport (Gloo, NCCL, shm) that carries a group's traffic.

#include "commgrad/detail/torch_compat.h"

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace commgrad {

/// The backends this build can create: always "gloo" and "shm" (the
/// shared-memory backend, for groups on one host); "nccl" when LibTorch has
/// CUDA and NCCL.
std::vector<std::string> available_backends();

/// The transport of a group's CPU tensors, for a group whose members run on
/// `hosts` (one identity per member). "auto" (and "nccl", whose CPU tensors
/// travel like c10d's "cpu:gloo,cuda:nccl") is shm when every member is on
/// one host; "hierarchical" when they span hosts and some host has more than
/// one of them (all_reduce, all_gather and reduce_scatter as shm inside each
/// host and Gloo between hosts, everything else on Gloo); else Gloo. "gloo" and "shm" are checked (shm
/// needs one host) and returned as is; "hierarchical" becomes shm on one host
/// and Gloo with one member per host, where it would be either of them.
std::string resolve_backend(const std::string& requested, const std::vector<std::string>& hosts);

/// The transport of a group's CUDA tensors where the process sees
/// `cuda_devices` > 0 devices ("" where it sees none): for "auto", NCCL when
/// this build has it and every one of the `local_ranks` ranks of this host
/// has a GPU of its own (NCCL cannot put two ranks on one GPU), else Gloo,
/// which carries CUDA tensors through host memory; "nccl" insists on NCCL;
/// "gloo" and "shm" give Gloo.
std::string resolve_cuda_backend(const std::string& requested, int local_ranks, int cuda_devices);

/// This host's identity for locality decisions: hostname and boot id, or
/// COMMGRAD_HOST where set (ranks that share a machine but should be treated
/// as on different hosts, e.g. to test multi-host layouts on one machine).
std::string host_identity();

namespace detail {

/// The local address of the interface that the route to `host` leaves by
/// (where Gloo binds across hosts); empty when there is none.
std::string local_address_towards(const std::string& host);

/// What a transport can do beyond c10d's Backend interface. The layers above
/// ask this table, never the transport's type (NCCL's transports are tables of
/// functions in the same way); create_transport() fills it for the transport it
/// creates. An empty function means "not offered": use the plain c10d call.
/// The functions refer to the transport they came with and are valid while it lives.
struct TransportCapabilities {
  using AllreduceOut = std::function<WorkPtr(at::Tensor& in, at::Tensor& out, const c10d::AllreduceOptions&)>;
  using ReduceOut = std::function<WorkPtr(at::Tensor& in, at::Tensor& out, const c10d::ReduceOptions&)>;
  using ReduceScatter = std::function<WorkPtr(at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions&)>;
  using AllGather = std::function<WorkPtr(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions&)>;

  /// Reduces `in` into `out` (same shape and dtype, both contiguous): no staging copy.
  AllreduceOut allreduce_out;
  /// The same for reduce; only the root's `out` holds the result.
  ReduceOut reduce_out;
  /// Reduce-scatters contiguous `in` (n equal parts) into `out` (one part)
  /// natively, for floating-point dtypes and every reduction but PRODUCT.
  ReduceScatter reduce_scatter;
  /// Gathers every rank's contiguous `in` into contiguous `out` (n parts in
  /// rank order) natively: no list of n output views to build and check.
  AllGather all_gather;
  /// Reduces float16 and bfloat16 natively, accumulating in float32 (so a
  /// float32 copy would only cost time).
  bool reduces_16bit = false;
  /// Collectives below this many bytes are finished when the call returns
  /// (0: none are), so waiting for them later can overlap nothing.
  int64_t completes_on_call_below = 0;
};

/// A connected transport and what it can do.
struct Transport {
  TransportPtr backend;
  TransportCapabilities capabilities;
};

/// Everything a transport needs to connect its ranks.
struct TransportConfig {
  std::string backend;  // already resolved (no "auto")
  StorePtr store;       // prefixed for this group's transport
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  bool single_host = true;         // every member on this host
  std::vector<std::string> hosts;  // host identity of each member, by group rank
  std::string master_addr;         // the rendezvous host: Gloo binds where the route to it leaves
  std::string group_name;          // for error messages
  const char* op = "new_group";    // the call that creates it, for error messages
};

/// Creates and connects the transport; throws an error naming the group and
/// rank when the connection fails.
Transport create_transport(const TransportConfig& config);

/// NCCL's version (NCCL_VERSION_CODE, e.g. 23007 for 2.30.7) as commgrad
/// was compiled against (`header`) and as the library LibTorch loaded
/// reports it (`library`); both 0 in a build without NCCL. They must agree
/// in major and minor: c10d's NCCL options hold NCCL structs by value.
struct NcclVersions {
  int header = 0;
  int library = 0;
};
NcclVersions nccl_versions();

}  // namespace detail
}  // namespace commgrad
