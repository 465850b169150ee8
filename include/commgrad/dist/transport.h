#pragma once
// Creating the c10d transport (Gloo, NCCL, shm) that carries a group's traffic.

#include "commgrad/detail/torch_compat.h"

#include <chrono>
#include <string>
#include <vector>

namespace commgrad {

/// The backends this build can create: always "gloo" and "shm" (the
/// shared-memory backend, for groups on one host); "nccl" when LibTorch has
/// CUDA and NCCL.
std::vector<std::string> available_backends();

/// Resolves "auto" for a group whose members run on `hosts` (one identity per
/// member): NCCL when this build and machine have it, else shm when every
/// member is on one host, else Gloo. Any other name is checked (shm needs
/// one host) and returned as is.
std::string resolve_backend(const std::string& requested, const std::vector<std::string>& hosts);

/// This host's identity for locality decisions: hostname and boot id.
std::string host_identity();

namespace detail {

/// Everything a transport needs to connect its ranks.
struct TransportConfig {
  std::string backend;                 // already resolved (no "auto")
  StorePtr store;                      // prefixed for this group's transport
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  bool single_host = true;             // every member on this host
  std::string group_name;              // for error messages
};

/// Creates and connects the transport; throws an error naming the group and
/// rank when the connection fails.
TransportPtr create_transport(const TransportConfig& config);

}  // namespace detail
}  // namespace commgrad
