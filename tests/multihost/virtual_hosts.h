#pragma once
// Real hosts on one machine, for multi-node tests: N network namespaces, each
// joined to one bridge by a veth pair and given its own IPv4 address, and
// every command run inside a namespace under its own host name (commgrad's
// host identity is hostname + boot id, so a different host name makes a
// different host for its locality decisions: shm inside a host, Gloo across).
//
//   std::string why_not;
//   auto hosts = VirtualHosts::create(VirtualHostsOptions().hosts(2), &why_not);
//   if (!hosts) GTEST_SKIP() << why_not;
//   auto r = hosts->run(1, {launcher_path(), "--nnodes", "2", ...}, clean_env());
//
// Needs root, iproute2's `ip`, util-linux's `unshare`, bash and timeout. Link
// shaping needs `tc` and the kernel's netem; without netem the rate alone is
// shaped (tbf), without `tc` nothing, each with a note (shaping_note()).
// The destructor removes every namespace, veth and bridge this object made,
// also when the test failed or threw. Names carry the pid ("cgmh<pid>..."), so
// a crashed earlier run cannot collide, and remove_stale() deletes the
// leftovers of dead pids.

#include "harness/subprocess.h"

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace commgrad::testing {

/// How many hosts, and how their links are shaped.
struct VirtualHostsOptions {
  VirtualHostsOptions& hosts(int n) {
    hosts_ = n;
    return *this;
  }
  /// netem rate and delay on each host's link (both sides of the bridge see
  /// it once per direction), e.g. rate("10gbit").delay("50us"). Empty: unshaped.
  VirtualHostsOptions& rate(std::string r) {
    rate_ = std::move(r);
    return *this;
  }
  VirtualHostsOptions& delay(std::string d) {
    delay_ = std::move(d);
    return *this;
  }
  int hosts_ = 2;
  std::string rate_;
  std::string delay_;
};

/// N namespaces on one bridge (see the file comment). Not copyable; the
/// destructor tears everything down.
class VirtualHosts {
 public:
  /// Makes the hosts, or returns nullptr and sets `*why_not` (the command
  /// that failed and what it printed) when namespaces cannot be made here:
  /// not root, no `ip` or `unshare`, EPERM in a container.
  static std::unique_ptr<VirtualHosts> create(const VirtualHostsOptions& options, std::string* why_not);

  /// Deletes namespaces and links named "cgmh<pid>..." whose pid is not
  /// alive (a crashed or killed earlier run). Returns how many it removed.
  static int remove_stale();

  ~VirtualHosts();
  VirtualHosts(const VirtualHosts&) = delete;
  VirtualHosts& operator=(const VirtualHosts&) = delete;

  int size() const { return static_cast<int>(namespaces_.size()); }
  /// Host k's IPv4 address, e.g. "10.113.42.1" (host k is .k+1 of a /24).
  const std::string& address(int k) const { return addresses_.at(k); }
  /// An address in the hosts' subnet that nobody has.
  std::string unused_address() const;
  /// Host k's host name inside its commands ("mh<pid>-host<k>").
  const std::string& hostname(int k) const { return hostnames_.at(k); }
  /// Host k's network namespace ("cgmh<pid><c>-<k>").
  const std::string& netns(int k) const { return namespaces_.at(k); }
  /// Host k's network interface, inside its namespace (its end of the veth
  /// pair to the bridge): `ip link set <it> down` cuts the host off.
  const std::string& interface(int k) const { return interfaces_.at(k); }
  /// Empty when the links are shaped as asked (or shaping was not asked for);
  /// otherwise what was left out and why (no `tc`; no netem in the kernel,
  /// then only the rate is shaped, with tbf).
  const std::string& shaping_note() const { return shaping_note_; }

  /// argv wrapped to run inside host k under its host name:
  /// ip netns exec <ns> unshare --uts sh -c 'hostname "$0" && exec "$@"' <name> argv...
  std::vector<std::string> command(int k, const std::vector<std::string>& argv) const;

  /// run_process(command(k, argv), env, timeout).
  ProcessResult run(int k, const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                    std::chrono::milliseconds timeout = std::chrono::seconds(60)) const;

 private:
  VirtualHosts() = default;
  void set_up(const VirtualHostsOptions& options);
  void tear_down() noexcept;
  void shape_link(const std::string& ns, const std::string& dev, const VirtualHostsOptions& options, bool* failed);

  std::string bridge_;
  std::vector<std::string> namespaces_;
  std::vector<std::string> host_links_;  // the root-namespace ends of the veth pairs
  std::vector<std::string> interfaces_;  // the namespace ends
  std::vector<std::string> addresses_;
  std::vector<std::string> hostnames_;
  std::string subnet_;  // "10.x.y."
  std::string shaping_note_;
};

}  // namespace commgrad::testing
