// Transport factory: maps a backend name to a connected c10d transport.

#include "commgrad/dist/transport.h"

#include "commgrad/backend/shm_process_group.h"
#include "commgrad/config.h"
#include "commgrad/dist/build_info.h"
#include "commgrad/backend/hierarchical_transport.h"
#include "commgrad/util/env.h"
#include "commgrad/util/error.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#if COMMGRAD_HAVE_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <arpa/inet.h>
#include <dlfcn.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>

namespace commgrad {
namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

bool all_same(const std::vector<std::string>& v) {
  return std::all_of(v.begin(), v.end(), [&](const std::string& s) { return s == v.front(); });
}

detail::TransportPtr create_gloo(const detail::TransportConfig& c) {
  auto options = c10d::ProcessGroupGloo::Options::create(c.timeout);
  // GLOO_SOCKET_IFNAME picks interfaces as in PyTorch; a single-host group
  // stays on loopback (works without a resolvable hostname); otherwise bind
  // to the address the route to the rendezvous host leaves by (every host
  // reaches the master, so that interface reaches the others too), and only
  // without one to the address this host's name resolves to, as c10d does.
  if (const auto ifnames = env::get("GLOO_SOCKET_IFNAME")) {
    for (const auto& name : split(*ifnames, ',')) {
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
    }
  } else if (c.single_host) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else if (const auto address = detail::local_address_towards(c.master_addr); !address.empty()) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(address));
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  return c10::make_intrusive<c10d::ProcessGroupGloo>(c.store, c.rank, c.size, options);
}

// The shm transport and the table of what it offers beyond c10d.
detail::Transport create_shm(const detail::TransportConfig& c) {
  auto shm = c10::make_intrusive<backend::ShmProcessGroup>(
      c.store, c.rank, c.size, backend::ShmOptions().timeout(c.timeout).group_name(c.group_name));
  backend::ShmProcessGroup* pg = shm.get();  // owned by the Transport returned with the table
  detail::TransportCapabilities caps;
  caps.allreduce_out = [pg](at::Tensor& in, at::Tensor& out, const c10d::AllreduceOptions& o) {
    return pg->allreduce_out(in, out, o);
  };
  caps.reduce_out = [pg](at::Tensor& in, at::Tensor& out, const c10d::ReduceOptions& o) {
    return pg->reduce_out(in, out, o);
  };
  caps.reduce_scatter = [pg](at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& o) {
    return pg->_reduce_scatter_base(out, in, o);
  };
  caps.all_gather = [pg](at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) {
    return pg->_allgather_base(out, in, o);
  };
  caps.reduces_16bit = true;  // shm_reduce.cpp accumulates float16/bfloat16 in float32
  caps.completes_on_call_below = pg->options().async_bytes();
  return {std::move(shm), std::move(caps)};
}

// "[commgrad] <op> rank r/n group 'g' (<backend>): " for a transport being created.
std::string connect_prefix(const detail::TransportConfig& c) {
  return c10::str("[commgrad] ", c.op, " rank ", c.rank, "/", c.size, " group '", c.group_name, "' (", c.backend,
                  "): ");
}

// Members of each host, by group rank, hosts in order of their first member.
std::vector<std::vector<int>> members_by_host(const std::vector<std::string>& hosts) {
  std::vector<std::string> order;
  std::vector<std::vector<int>> members;
  for (int r = 0; r < static_cast<int>(hosts.size()); ++r) {
    const auto it = std::find(order.begin(), order.end(), hosts[r]);
    if (it == order.end()) {
      order.push_back(hosts[r]);
      members.push_back({r});
    } else {
      members[it - order.begin()].push_back(r);
    }
  }
  return members;
}

// Shm inside each host, Gloo between the first members of the hosts, flat
// Gloo for the rest (backend/hierarchical_transport.h).
detail::Transport create_hierarchical(const detail::TransportConfig& c) {
  const auto hosts = members_by_host(c.hosts);
  int host = 0;
  while (std::find(hosts[host].begin(), hosts[host].end(), c.rank) == hosts[host].end()) ++host;
  const auto& mine = hosts[host];
  const int local_rank = static_cast<int>(std::find(mine.begin(), mine.end(), c.rank) - mine.begin());

  backend::HierarchyParts parts;
  parts.hosts = static_cast<int>(hosts.size());
  parts.local_size = static_cast<int>(mine.size());
  parts.host = host;
  parts.members = hosts;
  parts.group_name = c.group_name;
  detail::TransportConfig flat = c;
  flat.store = c10::make_intrusive<c10d::PrefixStore>("flat", c.store);
  parts.flat = create_gloo(flat);
  if (parts.local_size > 1) {
    parts.local = c10::make_intrusive<backend::ShmProcessGroup>(
        c10::make_intrusive<c10d::PrefixStore>(c10::str("local", host), c.store), local_rank, parts.local_size,
        backend::ShmOptions().timeout(c.timeout).group_name(c.group_name + "/local"));
  }
  if (local_rank == 0) {
    detail::TransportConfig leaders = c;
    leaders.store = c10::make_intrusive<c10d::PrefixStore>("leaders", c.store);
    leaders.rank = host;
    leaders.size = parts.hosts;
    parts.leaders = create_gloo(leaders);
  }
  auto hierarchical = c10::make_intrusive<backend::HierarchicalTransport>(c.rank, c.size, std::move(parts));
  backend::HierarchicalTransport* pg = hierarchical.get();  // owned by the Transport returned with the table
  detail::TransportCapabilities caps;
  caps.reduce_scatter = [pg](at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& o) {
    return pg->_reduce_scatter_base(out, in, o);
  };
  return {std::move(hierarchical), std::move(caps)};
}

}  // namespace

std::vector<std::string> available_backends() { return build_info().transports; }

std::string resolve_backend(const std::string& requested, const std::vector<std::string>& hosts) {
  const auto all = available_backends();
  TORCH_CHECK(
      requested == "auto" || requested == "hierarchical" || std::find(all.begin(), all.end(), requested) != all.end(),
      "[commgrad] resolve_backend: backend '", requested, "' is not available in this build; available: auto, ",
      c10::Join(", ", all));
  if (requested == "auto" || requested == "nccl" || requested == "hierarchical") {
    if (all_same(hosts)) return "shm";
    return members_by_host(hosts).size() < hosts.size() ? "hierarchical" : "gloo";
  }
  TORCH_CHECK(
      requested != "shm" || all_same(hosts),
      "[commgrad] resolve_backend: backend 'shm' needs every rank of the group on one host, but its ranks run on ",
      std::set<std::string>(hosts.begin(), hosts.end()).size(), " hosts; use 'gloo' (or 'auto')");
  return requested;
}

std::string resolve_cuda_backend(const std::string& requested, int local_ranks, int cuda_devices) {
  if (cuda_devices == 0) {
    TORCH_CHECK(requested != "nccl",
                "[commgrad] resolve_cuda_backend: backend 'nccl' needs a CUDA device, and this process sees none");
    return "";
  }
  if (requested == "nccl") {
    TORCH_CHECK(
        COMMGRAD_HAVE_NCCL,
        "[commgrad] resolve_cuda_backend: backend 'nccl' is not available in this build (its LibTorch has no NCCL)");
    TORCH_CHECK(local_ranks <= cuda_devices,
                "[commgrad] resolve_cuda_backend: backend 'nccl' needs a GPU for each of the ", local_ranks,
                " ranks on this host, but this process sees ", cuda_devices,
                "; use 'auto' to carry CUDA tensors over Gloo instead");
    return "nccl";
  }
  if (requested == "auto" && COMMGRAD_HAVE_NCCL && local_ranks <= cuda_devices) return "nccl";
  return "gloo";
}

std::string host_identity() {
  if (const auto forced = env::get("COMMGRAD_HOST"); forced && !forced->empty()) return *forced;
  char name[256] = {0};
  gethostname(name, sizeof(name) - 1);
  std::string boot_id;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot_id);
  return std::string(name) + "/" + boot_id;
}

namespace detail {

// A UDP socket "connected" to the host sends nothing; its local end is the answer.
std::string local_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (host.empty() || getaddrinfo(host.c_str(), "9", &hints, &found) != 0) return "";
  std::string address;
  for (addrinfo* a = found; a != nullptr && address.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0) {
      char text[INET6_ADDRSTRLEN] = {0};
      const void* raw = local.ss_family == AF_INET6
                            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
                            : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
      if (inet_ntop(local.ss_family, raw, text, sizeof(text)) != nullptr) address = text;
    }
    close(fd);
  }
  freeaddrinfo(found);
  return address;
}

NcclVersions nccl_versions() {
  NcclVersions v;
#if COMMGRAD_HAVE_NCCL
  v.header = NCCL_VERSION_CODE;
  // The library libtorch_cuda linked (loaded with it), looked up at run time.
  using GetVersion = int (*)(int*);
  if (auto get = reinterpret_cast<GetVersion>(dlsym(RTLD_DEFAULT, "ncclGetVersion"))) get(&v.library);
#endif
  return v;
}

Transport create_transport(const TransportConfig& c) {
  try {
    if (c.backend == "gloo") return {create_gloo(c), {}};
    if (c.backend == "shm") return create_shm(c);
    if (c.backend == "hierarchical") return create_hierarchical(c);
#if COMMGRAD_HAVE_NCCL
    if (c.backend == "nccl") {
      // The communicator is created on the first collective, on the device
      // of its tensors (init_process_group() made cuda:LOCAL_RANK current).
      // NCCL's own watchdog enforces the group's timeout.
      auto options = c10d::ProcessGroupNCCL::Options::create();
      options->timeout = c.timeout;
      return {c10::make_intrusive<c10d::ProcessGroupNCCL>(c.store, c.rank, c.size, options), {}};
    }
#endif
  } catch (const c10::Error& e) {
    // The cause says whether it was the timeout (a settings mismatch is not).
    COMMGRAD_THROW_MESSAGE(::commgrad::ErrorKind::kPeerFailed, connect_prefix(c), "could not connect its ", c.backend,
                           " transport to the other ", c.size - 1, " ranks: ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    COMMGRAD_THROW_MESSAGE(::commgrad::ErrorKind::kPeerFailed, connect_prefix(c), "could not connect its ", c.backend,
                           " transport to the other ", c.size - 1, " ranks: ", e.what());
  }
  TORCH_CHECK(false, connect_prefix(c), "unknown backend '", c.backend, "'");
}

}  // namespace detail
}  // namespace commgrad
