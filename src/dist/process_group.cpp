// init_process_group / new_group / destroy_process_group.
//
// Rendezvous: rank 0 hosts a c10d TCPStore at MASTER_ADDR:MASTER_PORT and
// writes its job id there (two jobs on one port refuse each other's ranks);
// every rank connects to it, claims its rank, writes its host identity under
// a join key and bumps a counter, then waits until the counter reaches the
// world size. Doing this ourselves (instead of TCPStore's own worker wait)
// lets a timeout say how many ranks joined and exactly which are missing, on
// every waiting rank: rank 0 leaves the verdict in the store for the others.
// The host identities tell each group whether all its members share a host
// (loopback devices, shm).
//
// Group creation ends with the same kind of store barrier among the members,
// after every transport has connected: a rank that dropped a group the moment
// it had connected could otherwise close its Gloo pairs while a slower member
// was still connecting to it (that member then fails with "Connection closed
// by peer" while the others carry on). PyTorch's new_group ends the same way.

#include "commgrad/dist/process_group.h"

#include "commgrad/dist/check.h"
#include "commgrad/dist/device.h"
#include "commgrad/dist/flight_recorder.h"
#include "commgrad/dist/terminate_handler.h"
#include "commgrad/dist/transport.h"
#include "commgrad/util/blas.h"
#include "commgrad/util/env.h"
#include "commgrad/util/logging.h"
#include "commgrad/util/print.h"
#include "commgrad/util/error.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

namespace commgrad {
namespace {

std::mutex g_mutex;
Group g_world;               // the process's world
thread_local Group t_world;  // a ScopedWorld's world, for in-process harnesses

std::chrono::milliseconds resolve_timeout(std::chrono::milliseconds requested) {
  if (requested.count() > 0) return requested;
  if (const auto v = env::get("COMMGRAD_TIMEOUT")) {
    char* end = nullptr;
    const double seconds = std::strtod(v->c_str(), &end);
    TORCH_CHECK(end != v->c_str() && *end == '\0' && seconds > 0, "[commgrad] init_process_group: COMMGRAD_TIMEOUT='",
                *v, "' is not a positive number of seconds");
    return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  }
  return kDefaultTimeout;
}

std::string seconds(std::chrono::milliseconds ms) { return c10::str(ms.count() / 1000.0, "s"); }

// "[commgrad] init_process_group rank r/n: ", for errors before the world group exists.
std::string init_prefix(const LaunchEnvironment& env) {
  return c10::str("[commgrad] init_process_group rank ", env.rank, "/", env.world_size, ": ");
}

detail::StorePtr connect_store(const LaunchEnvironment& env, std::chrono::milliseconds timeout) {
  if (env.world_size == 1) return c10::make_intrusive<c10d::HashStore>();
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(env.master_port);
  opts.isServer = env.rank == 0;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
  } catch (const std::exception& e) {
    if (env.rank == 0) {
      COMMGRAD_THROW_MESSAGE(::commgrad::ErrorKind::kPeerFailed, init_prefix(env),
                             "could not host the rendezvous store at ", env.master_addr, ":", env.master_port,
                             " (is the port in use?): ", e.what());
    }
    COMMGRAD_THROW_MESSAGE(::commgrad::ErrorKind::kPeerFailed, init_prefix(env),
                           "could not reach the rendezvous store at ", env.master_addr, ":", env.master_port,
                           " within ", seconds(timeout), " (did rank 0 start?): ", e.what());
  }
}

// Store barrier: rank `rank` of `size` writes `payload` under `key`/<rank>
// and waits until all `size` have (the last to arrive sets `key`/done, which
// the others wait for in the store: no polling). Returns every rank's
// payload, by rank, or the ranks missing at the deadline (`missing`
// non-empty, nothing returned).
std::vector<std::string> arrive_and_wait(const detail::StorePtr& store, const std::string& key, int rank, int size,
                                         const std::string& payload, std::chrono::milliseconds timeout,
                                         std::vector<int>& missing) {
  auto rank_key = [&](int r) { return c10::str(key, "/", r); };
  store->set(rank_key(rank), std::vector<uint8_t>(payload.begin(), payload.end()));
  if (store->add(key + "/count", 1) == size) store->set(key + "/done", std::vector<uint8_t>{1});
  try {
    store->wait({key + "/done"}, timeout);
  } catch (const std::exception&) {
    for (int r = 0; r < size; ++r) {
      if (!store->check({rank_key(r)})) missing.push_back(r);
    }
    if (!missing.empty()) return {};
    store->wait({key + "/done"}, timeout);  // everyone arrived just now
  }
  std::vector<std::string> payloads;
  for (int r = 0; r < size; ++r) {
    const auto bytes = store->get(rank_key(r));
    payloads.emplace_back(bytes.begin(), bytes.end());
  }
  return payloads;
}

// Rank 0 hosts the store: when the join times out, it tells the waiting
// ranks which ranks are missing (under key/verdict, then it sets key/done to
// wake them) and keeps the store up until they have read it, at most this
// long. The others wait this much longer than rank 0, so that rank 0 judges.
constexpr std::chrono::milliseconds kVerdictWait(5000);

std::vector<int> absent_ranks(const detail::StorePtr& store, const std::string& key, int size) {
  std::vector<int> missing;
  for (int r = 0; r < size; ++r) {
    if (!store->check({c10::str(key, "/", r)})) missing.push_back(r);
  }
  return missing;
}

// arrive_and_wait for the world's join: every rank that waits learns which
// ranks are missing (`missing`), or that the store went away (`lost`: why).
std::vector<std::string> join_barrier(const detail::StorePtr& store, const std::string& key, int rank, int size,
                                      const std::string& payload, std::chrono::milliseconds timeout,
                                      std::vector<int>& missing, std::string& lost) {
  const std::string done = key + "/done";
  const std::string verdict = key + "/verdict";
  store->set(c10::str(key, "/", rank), std::vector<uint8_t>(payload.begin(), payload.end()));
  if (store->add(key + "/count", 1) == size) store->set(done, std::vector<uint8_t>{1});
  try {
    store->wait({done}, rank == 0 ? timeout : timeout + kVerdictWait);
  } catch (const std::exception& e) {
    try {
      missing = absent_ranks(store, key, size);
    } catch (const std::exception&) {
      lost = std::string(e.what()).substr(0, 200);
      return {};
    }
    if (!missing.empty() && rank == 0) {
      std::string list;
      for (int r : missing) list += c10::str(r, " ");
      store->set(verdict, std::vector<uint8_t>(list.begin(), list.end()));
      store->set(done, std::vector<uint8_t>{1});
      const auto give_up = std::chrono::steady_clock::now() + kVerdictWait;
      const int64_t readers = size - static_cast<int64_t>(missing.size()) - 1;
      while (store->add(key + "/verdict-read", 0) < readers && std::chrono::steady_clock::now() < give_up) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    if (!missing.empty()) return {};
    store->wait({done}, timeout);  // everyone arrived just now
  }
  if (rank != 0 && store->check({verdict})) {
    const auto bytes = store->get(verdict);
    std::istringstream in(std::string(bytes.begin(), bytes.end()));
    for (int r; in >> r;) missing.push_back(r);
    store->add(key + "/verdict-read", 1);
    return {};
  }
  std::vector<std::string> payloads;
  for (int r = 0; r < size; ++r) {
    const auto bytes = store->get(c10::str(key, "/", r));
    payloads.emplace_back(bytes.begin(), bytes.end());
  }
  return payloads;
}

// Two jobs started on one port must not join each other's world: rank 0
// writes its job's id (TORCHELASTIC_RUN_ID, which commgrad-run sets, or
// torchrun's --rdzv-id) into the store it hosts, every other rank compares
// its own with it, and each rank claims its rank number once.
void check_job(const detail::StorePtr& store, const LaunchEnvironment& env, const std::string& job,
               std::chrono::milliseconds timeout) {
  const std::string where = c10::str(" (store ", env.master_addr, ":", env.master_port, ")");
  const std::string key = "commgrad/world/job";
  const std::string mine = "id:" + job;
  if (env.rank == 0) {
    store->set(key, std::vector<uint8_t>(mine.begin(), mine.end()));
  } else {
    store->wait({key}, timeout);
    const auto bytes = store->get(key);
    const std::string theirs(bytes.begin(), bytes.end());
    if (!job.empty() && theirs.size() > 3 && theirs != mine) {
      COMMGRAD_THROW_MESSAGE(::commgrad::ErrorKind::kPeerFailed, init_prefix(env),
                             "the rendezvous store belongs to another job (its job id '", theirs.substr(3),
                             "', this rank's '", job, "')", where,
                             ": two jobs on one --master-port? Give each job its own port");
    }
  }
  const std::string claim = c10::str("commgrad/world/claim/", env.rank);
  if (store->add(claim, 1) > 1) {
    COMMGRAD_THROW_MESSAGE(
        ::commgrad::ErrorKind::kPeerFailed, init_prefix(env), "another process already joined as rank ", env.rank,
        where, ": two jobs on one --master-port? Give each job its own port (or its own TORCHELASTIC_RUN_ID)");
  }
}

// What each rank says of itself at the join: its host identity and its
// address towards the rendezvous host (errors name the ranks behind an address).
struct Joined {
  std::vector<std::string> hosts;
  std::vector<std::string> addresses;
};

// Waits until every rank has joined. `job`: this rank's job id ("" to not check).
Joined join(const detail::StorePtr& store, const LaunchEnvironment& env, std::chrono::milliseconds timeout,
            const std::string& job = "") {
  check_job(store, env, job, timeout);
  std::vector<int> missing;
  std::string lost;
  const std::string me = host_identity() + "\n" + detail::local_address_towards(env.master_addr);
  auto said = join_barrier(store, "commgrad/world/join", env.rank, env.world_size, me, timeout, missing, lost);
  if (!lost.empty()) {
    COMMGRAD_THROW_MESSAGE(::commgrad::ErrorKind::kPeerFailed, init_prefix(env),
                           "rendezvous failed: the store's host (rank 0) went away before every rank joined (store ",
                           env.master_addr, ":", env.master_port, "): ", lost);
  }
  if (!missing.empty()) {
    COMMGRAD_THROW_MESSAGE(::commgrad::ErrorKind::kTimeout, init_prefix(env), "rendezvous timed out after ",
                           seconds(timeout), ": ", env.world_size - missing.size(), " of ", env.world_size,
                           " ranks joined; missing ranks: ", format_ranks(missing), " (store ", env.master_addr, ":",
                           env.master_port, ")");
  }
  Joined joined;
  for (const auto& s : said) {
    const auto cut = s.find('\n');
    joined.hosts.push_back(s.substr(0, cut));
    joined.addresses.push_back(cut == std::string::npos ? "" : s.substr(cut + 1));
  }
  return joined;
}

// The state of a world group: every rank that joined, in rank order, on the
// transport `requested_backend` resolves to for their hosts.
std::shared_ptr<detail::GroupState> world_state(std::string name, const LaunchEnvironment& env, const Joined& joined,
                                                std::chrono::milliseconds timeout, const detail::StorePtr& root,
                                                const std::string& requested_backend) {
  auto state = std::make_shared<detail::GroupState>();
  state->name = std::move(name);
  state->rank = env.rank;
  state->global_rank = env.rank;
  for (int r = 0; r < env.world_size; ++r) state->ranks.push_back(r);
  state->hosts = joined.hosts;
  state->addresses = joined.addresses;
  state->timeout = timeout;
  state->root_store = root;
  state->store = c10::make_intrusive<c10d::PrefixStore>("commgrad/world", root);
  state->launch = env;
  state->requested_backend = requested_backend;
  state->backend = resolve_backend(requested_backend, joined.hosts);
  return state;
}

bool all_same(const std::vector<std::string>& v) {
  return std::all_of(v.begin(), v.end(), [&](const std::string& s) { return s == v.front(); });
}

// Connects a member's transports: the one of CPU tensors (state.backend) and,
// with `cuda` where this process sees CUDA devices, the one of CUDA tensors
// (Gloo's object is shared when it carries both), as state.requested_backend
// asks; `prefix` keys the transports' stores. Returns once every member has
// connected (see the top of the file).
void connect_transports(detail::GroupState& state, const std::string& prefix, const char* op, bool cuda = true) {
  detail::TransportConfig config;
  config.backend = state.backend;
  config.store = c10::make_intrusive<c10d::PrefixStore>(prefix + "/transport", state.root_store);
  config.rank = state.rank;
  config.size = static_cast<int>(state.ranks.size());
  config.timeout = state.timeout;
  config.single_host = all_same(state.hosts);
  config.hosts = state.hosts;
  config.master_addr = state.launch.master_addr;
  config.group_name = state.name;
  config.op = op;
  auto cpu = detail::create_transport(config);
  state.transport = cpu.backend;
  state.capabilities = cpu.capabilities;

  if (cuda) {
    state.cuda_backend =
        resolve_cuda_backend(state.requested_backend, state.launch.local_world_size, cuda_device_count());
  }
  if (state.cuda_backend == state.backend) {
    state.cuda_transport = state.transport;
    state.cuda_capabilities = state.capabilities;
  } else if (!state.cuda_backend.empty()) {
    config.backend = state.cuda_backend;
    config.store = c10::make_intrusive<c10d::PrefixStore>(prefix + "/cuda-transport", state.root_store);
    auto cuda = detail::create_transport(config);
    state.cuda_transport = cuda.backend;
    state.cuda_capabilities = cuda.capabilities;
  }

  std::vector<int> missing;
  arrive_and_wait(state.root_store, prefix + "/connected", state.rank, config.size, "", state.timeout, missing);
  if (!missing.empty()) {
    COMMGRAD_THROW_MESSAGE(::commgrad::ErrorKind::kTimeout, "[commgrad] ", op, " ", detail::describe(state),
                           ": group ranks ", format_ranks(missing), " did not finish connecting within ",
                           seconds(state.timeout));
  }
}

}  // namespace

Group make_world_group(const InitOptions& options) {
  LaunchEnvironment env;
  if (options.store()) {
    TORCH_CHECK(options.rank() >= 0 && options.world_size() >= 1 && options.rank() < options.world_size(),
                "[commgrad] init_process_group: an explicit store needs rank in [0, world_size) and "
                "world_size >= 1; got rank ",
                options.rank(), ", world_size ", options.world_size());
    env.rank = options.rank();
    env.world_size = options.world_size();
    env.local_rank = env.rank;
    env.local_world_size = env.world_size;
  } else {
    TORCH_CHECK(options.rank() < 0 && options.world_size() < 0,
                "[commgrad] init_process_group: rank and world_size options need an explicit store; without one they "
                "come from the "
                "launcher's environment");
    env = LaunchEnvironment::from_env();
    if (env.launcher == Launcher::kNone) {
      std::cerr
          << "[commgrad] init_process_group: no launcher variables (RANK/WORLD_SIZE, OMPI_COMM_WORLD_*, SLURM_*); "
             "running as a single process (world size 1)\n";
    }
  }
  const auto timeout = resolve_timeout(options.timeout());
  if (options.intra_op_threads() > 0) {
    at::set_num_threads(options.intra_op_threads());
    set_blas_threads(options.intra_op_threads());  // OpenBLAS's own pool is not reached by the line above
  }

  detail::StorePtr root = options.store() ? options.store() : connect_store(env, timeout);
  root->setTimeout(timeout);
  std::string job;
  if (!options.store()) {
    job = env::get("TORCHELASTIC_RUN_ID").value_or("");
    if (job == "none") job.clear();  // torchrun's default --rdzv-id
  }
  auto joined = join(root, env, timeout, job);

  // COMMGRAD_BACKEND lets a launch script pick the transport of an unchanged program.
  std::string backend = options.backend();
  if (backend == "auto") backend = env::get("COMMGRAD_BACKEND").value_or(backend);
  auto state = world_state("world", env, joined, timeout, root, backend);
  detail::select_cuda_device(env.local_rank);
  if (options.terminate_handler()) install_terminate_handler();
  install_flight_recorder_signal();  // COMMGRAD_TRACE_SIGNAL (default SIGUSR2) dumps the flight record
  connect_transports(*state, "commgrad/world", "init_process_group");
  return Group(std::move(state));
}

Group connect_group(const detail::StorePtr& store, int rank, int size, const ConnectOptions& options) {
  TORCH_CHECK(store, "[commgrad] connect_group '", options.name(), "': the store is null");
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "[commgrad] connect_group '", options.name(),
              "': needs rank in [0, size) and size >= 1; got rank ", rank, ", size ", size);
  LaunchEnvironment env;
  env.rank = rank;
  env.world_size = size;
  env.local_rank = rank;
  env.local_world_size = size;
  const auto timeout = resolve_timeout(options.timeout());
  auto joined = join(store, env, timeout);

  auto state = world_state(options.name(), env, joined, timeout, store, options.backend());
  connect_transports(*state, "commgrad/world", "connect_group", /*cuda=*/false);
  return Group(std::move(state));
}

Group init_process_group(const InitOptions& options) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    TORCH_CHECK(!g_world.defined(), "[commgrad] init_process_group: called twice; call destroy_process_group() first");
  }
  Group world = make_world_group(options);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_world = world;
  set_log_rank(world.rank());
  COMMGRAD_LOG(kInfo, "joined ", world.describe(), " — ", world.state()->launch.describe());
  return world;
}

void destroy_process_group() {
  Group world;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    world = g_world;
  }
  if (!world.defined()) return;
  // Keep rank 0 (the store's host) alive until every rank is done with it.
  try {
    world.transport().barrier()->wait();
  } catch (const std::exception& e) {
    COMMGRAD_LOG(kWarn, "destroy_process_group: final barrier failed (a peer may have exited): ", e.what());
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  g_world = Group();
  set_log_rank(-1);
}

bool is_initialized() {
  if (t_world.defined()) return true;
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_world.defined();
}

Group world() {
  if (t_world.defined()) return t_world;
  std::lock_guard<std::mutex> lock(g_mutex);
  TORCH_CHECK(g_world.defined(),
              "[commgrad] world: the process group is not initialised; call commgrad::init_process_group() first");
  return g_world;
}

int rank() { return world().rank(); }
int world_size() { return world().size(); }
int local_rank() { return world().state()->launch.local_rank; }
int local_world_size() { return world().state()->launch.local_world_size; }

const LaunchEnvironment& launch_environment() { return world().state()->launch; }

Group new_group(const std::vector<int>& ranks, const NewGroupOptions& options) {
  Group parent = world();
  const int n = parent.size();
  const uint64_t index = parent.state()->subgroups.fetch_add(1);
  const std::string name = options.name().empty() ? c10::str("group", index) : options.name();
  TORCH_CHECK(!ranks.empty(), "[commgrad] new_group '", name, "' on ", parent.describe(), ": the rank list is empty");
  std::set<int> seen;
  for (int r : ranks) {
    TORCH_CHECK(r >= 0 && r < n, "[commgrad] new_group '", name, "' on ", parent.describe(), ": rank ", r,
                " is outside the world (0..", n - 1, "); ranks ", format_ranks(ranks));
    TORCH_CHECK(seen.insert(r).second, "[commgrad] new_group '", name, "' on ", parent.describe(), ": rank ", r,
                " appears twice in ", format_ranks(ranks));
  }

  const auto& ps = *parent.state();
  auto state = std::make_shared<detail::GroupState>();
  state->name = name;
  state->global_rank = ps.global_rank;
  state->ranks = ranks;
  const auto me = std::find(ranks.begin(), ranks.end(), ps.global_rank);
  state->rank = me == ranks.end() ? -1 : static_cast<int>(me - ranks.begin());
  for (int r : ranks) {
    state->hosts.push_back(ps.hosts[r]);
    state->addresses.push_back(ps.addresses.empty() ? "" : ps.addresses[r]);
  }
  state->timeout = options.timeout().count() > 0 ? options.timeout() : ps.timeout;
  state->root_store = ps.root_store;
  // Keyed by the call index, not the name, so equal names cannot collide.
  const std::string prefix = c10::str("commgrad/group/", index);
  state->store = c10::make_intrusive<c10d::PrefixStore>(prefix, ps.root_store);
  state->launch = ps.launch;
  state->requested_backend = options.backend().empty() ? ps.requested_backend : options.backend();
  // Decided per group: a group inside one host of a job that spans hosts
  // still gets shm from "auto".
  state->backend = resolve_backend(state->requested_backend, state->hosts);
  if (state->rank >= 0) connect_transports(*state, prefix, "new_group");
  return Group(std::move(state));
}

ScopedWorld::ScopedWorld(Group group) : previous_(t_world) { t_world = std::move(group); }
ScopedWorld::~ScopedWorld() { t_world = previous_; }

}  // namespace commgrad
