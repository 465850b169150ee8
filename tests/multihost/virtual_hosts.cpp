#include "multihost/virtual_hosts.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <set>
#include <sstream>
#include <stdexcept>

namespace commgrad::testing {
namespace {

constexpr const char* kPrefix = "cgmh";
constexpr auto kCommandTimeout = std::chrono::seconds(20);

std::string join(const std::vector<std::string>& argv) {
  std::string s;
  for (const auto& a : argv) s += (s.empty() ? "" : " ") + a;
  return s;
}

// Runs one setup command; throws with the command and its output on failure.
std::string must(const std::vector<std::string>& argv) {
  auto r = run_process(argv, {}, kCommandTimeout);
  if (r.exit_code != 0) {
    std::string why = r.err.empty() ? r.out : r.err;
    while (!why.empty() && std::isspace(static_cast<unsigned char>(why.back()))) why.pop_back();
    throw std::runtime_error("`" + join(argv) + "` failed (exit " + std::to_string(r.exit_code) +
                             (r.timed_out ? ", timed out" : "") + "): " + why);
  }
  return r.out;
}

bool quietly(const std::vector<std::string>& argv) { return run_process(argv, {}, kCommandTimeout).exit_code == 0; }

bool found_in_path(const std::string& tool) {
  return run_process({"sh", "-c", "command -v \"$0\"", tool}, {}, kCommandTimeout).exit_code == 0;
}

// The pid in "cgmh<pid>...", or -1 for other names.
long owner_pid(const std::string& name) {
  if (name.rfind(kPrefix, 0) != 0) return -1;
  size_t i = std::string(kPrefix).size();
  long pid = 0;
  size_t digits = 0;
  while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i])) && digits < 9) {
    pid = pid * 10 + (name[i++] - '0');
    ++digits;
  }
  return digits == 0 ? -1 : pid;
}

bool dead(long pid) { return pid > 0 && kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH; }

// First word of each line of `text` (`ip netns list` and `ip -o link` output).
std::vector<std::string> names_in(const std::string& text, bool link_list) {
  std::vector<std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string w;
    if (link_list) words >> w;  // "7: name@peer: <...>"
    if (!(words >> w)) continue;
    w = w.substr(0, w.find_first_of("@:"));
    out.push_back(w);
  }
  return out;
}

}  // namespace

std::unique_ptr<VirtualHosts> VirtualHosts::create(const VirtualHostsOptions& options, std::string* why_not) {
  auto fail = [&](const std::string& why) {
    if (why_not != nullptr) *why_not = "cannot make virtual hosts (network namespaces): " + why;
    return nullptr;
  };
  if (geteuid() != 0) return fail("not running as root (ip netns add needs CAP_SYS_ADMIN and CAP_NET_ADMIN)");
  for (const char* tool : {"ip", "unshare", "hostname", "bash", "timeout"}) {
    if (!found_in_path(tool)) return fail(std::string("`") + tool + "` is not installed");
  }
  if (options.hosts_ < 1 || options.hosts_ > 9) return fail("hosts must be 1-9, got " + std::to_string(options.hosts_));
  remove_stale();
  std::unique_ptr<VirtualHosts> hosts(new VirtualHosts());
  try {
    hosts->set_up(options);
  } catch (const std::exception& e) {
    hosts->tear_down();
    return fail(e.what());
  }
  return hosts;
}

void VirtualHosts::set_up(const VirtualHostsOptions& options) {
  static std::atomic<int> instances{0};
  const long pid = getpid();
  // Interface names have at most 15 characters: "cgmh" + pid (<= 7 digits)
  // + instance letter + role letter + host digit.
  const std::string base = kPrefix + std::to_string(pid) + static_cast<char>('a' + instances++ % 26);
  // Each namespace has its own routing table, so the subnet only has to be
  // unique for readers of logs; derive it from the pid anyway.
  subnet_ = "10." + std::to_string(100 + (pid / 250) % 150) + "." + std::to_string(pid % 250) + ".";

  bridge_ = base + "b";
  must({"ip", "link", "add", bridge_, "type", "bridge"});
  must({"ip", "link", "set", bridge_, "up"});
  const bool shape = !options.rate_.empty() || !options.delay_.empty();
  const bool have_tc = shape && found_in_path("tc");
  if (shape && !have_tc) shaping_note_ = "links not shaped: `tc` is not installed";
  bool shaping_failed = false;

  for (int k = 0; k < options.hosts_; ++k) {
    const std::string ns = base + "-" + std::to_string(k);
    const std::string outer = base + "h" + std::to_string(k);
    const std::string inner = base + "n" + std::to_string(k);
    must({"ip", "netns", "add", ns});
    namespaces_.push_back(ns);
    must({"ip", "link", "add", outer, "type", "veth", "peer", "name", inner});
    host_links_.push_back(outer);
    must({"ip", "link", "set", outer, "master", bridge_});
    must({"ip", "link", "set", outer, "up"});
    must({"ip", "link", "set", inner, "netns", ns});
    interfaces_.push_back(inner);
    addresses_.push_back(subnet_ + std::to_string(k + 1));
    must({"ip", "-n", ns, "addr", "add", addresses_.back() + "/24", "dev", inner});
    must({"ip", "-n", ns, "link", "set", inner, "up"});
    must({"ip", "-n", ns, "link", "set", "lo", "up"});
    hostnames_.push_back("mh" + std::to_string(pid) + "-host" + std::to_string(k));
    if (have_tc && !shaping_failed) shape_link(ns, inner, options, &shaping_failed);
  }
  while (!shaping_note_.empty() && std::isspace(static_cast<unsigned char>(shaping_note_.back()))) {
    shaping_note_.pop_back();
  }
  // Can host k reach host 0 through the bridge? A connection to a closed port
  // is refused at once when it can; a bridge whose traffic is filtered
  // (br_netfilter with a dropping FORWARD chain) lets it time out.
  for (int k = 1; k < options.hosts_; ++k) {
    auto r = run_process({"ip", "netns", "exec", namespaces_[k], "timeout", "5", "bash", "-c",
                          "exec 3<>/dev/tcp/" + addresses_[0] + "/9"},
                         {}, kCommandTimeout);
    if (r.err.find("refused") == std::string::npos) {
      throw std::runtime_error(
          "host " + std::to_string(k) + " cannot reach host 0 (" + addresses_[0] + ") through bridge " + bridge_ +
          " (is bridged traffic filtered? br_netfilter): " + (r.err.empty() ? "no answer within 5 s" : r.err));
    }
  }
}

// netem with the rate and delay asked for; where the kernel has no netem
// (sch_netem is a module many container kernels lack), tbf for the rate
// alone, and a note that says so.
void VirtualHosts::shape_link(const std::string& ns, const std::string& dev, const VirtualHostsOptions& options,
                              bool* failed) {
  const std::vector<std::string> qdisc = {"ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root"};
  auto netem = qdisc;
  netem.push_back("netem");
  if (!options.rate_.empty()) netem.insert(netem.end(), {"rate", options.rate_});
  if (!options.delay_.empty()) netem.insert(netem.end(), {"delay", options.delay_});
  auto r = run_process(netem, {}, kCommandTimeout);
  if (r.exit_code == 0) return;
  std::string why = "`" + join(netem) + "` failed: " + r.err;
  while (!why.empty() && std::isspace(static_cast<unsigned char>(why.back()))) why.pop_back();
  if (!options.rate_.empty()) {
    auto tbf = qdisc;
    tbf.insert(tbf.end(), {"tbf", "rate", options.rate_, "burst", "4mb", "latency", "10ms"});
    if (run_process(tbf, {}, kCommandTimeout).exit_code == 0) {
      shaping_note_ = "links shaped by rate only (tbf " + options.rate_ + ", no delay): " + why;
      return;
    }
  }
  shaping_note_ = "links not shaped: " + why;
  *failed = true;
}

void VirtualHosts::tear_down() noexcept {
  // Deleting a namespace destroys the veth end inside it, and with it the
  // pair; the explicit link deletes cover a namespace that was never made.
  try {
    for (const auto& ns : namespaces_) quietly({"ip", "netns", "del", ns});
    for (const auto& link : host_links_) quietly({"ip", "link", "del", link});
    if (!bridge_.empty()) quietly({"ip", "link", "del", bridge_});
  } catch (...) {
    // Best effort: remove_stale() gets whatever is left on the next run.
  }
  namespaces_.clear();
  host_links_.clear();
  bridge_.clear();
}

VirtualHosts::~VirtualHosts() { tear_down(); }

int VirtualHosts::remove_stale() {
  int removed = 0;
  auto netns = run_process({"ip", "netns", "list"}, {}, kCommandTimeout);
  for (const auto& name : names_in(netns.out, false)) {
    if (dead(owner_pid(name)) && quietly({"ip", "netns", "del", name})) ++removed;
  }
  auto links = run_process({"ip", "-o", "link", "show"}, {}, kCommandTimeout);
  // Bridges last: their ports go first.
  std::vector<std::string> bridges;
  for (const auto& name : names_in(links.out, true)) {
    if (!dead(owner_pid(name))) continue;
    if (name.back() == 'b') {
      bridges.push_back(name);
    } else if (quietly({"ip", "link", "del", name})) {
      ++removed;
    }
  }
  for (const auto& b : bridges) removed += quietly({"ip", "link", "del", b}) ? 1 : 0;
  return removed;
}

std::string VirtualHosts::unused_address() const { return subnet_ + "200"; }

std::vector<std::string> VirtualHosts::command(int k, const std::vector<std::string>& argv) const {
  std::vector<std::string> cmd = {
      "ip", "netns", "exec", netns(k), "unshare", "--uts", "sh", "-c", "hostname \"$0\" && exec \"$@\"", hostname(k)};
  cmd.insert(cmd.end(), argv.begin(), argv.end());
  return cmd;
}

ProcessResult VirtualHosts::run(int k, const std::vector<std::string>& argv,
                                const std::map<std::string, std::string>& env,
                                std::chrono::milliseconds timeout) const {
  return run_process(command(k, argv), env, timeout);
}

}  // namespace commgrad::testing
