// The flight recorder (see the header): a ring of the last N collectives of
// this process, and the JSON files commgrad-trace reads.
//
// Cost. A collective takes the recorder's mutex three times (issued, posted,
// finished: uncontended, the ranks of a job are processes), reads the coarse
// clock three times and writes one slot of ~130 bytes: about 70 ns more than
// the terminate handler's record alone (docs/flight_recorder.md). The ring is
// allocated on the first collective.
//
// Threads as ranks. Every record names the world rank that issued it, so a
// process that runs several ranks (the in-process test harness) writes one
// file per rank, each with its own collectives.
//
// Dump format (version 1), one object per file:
//   {"format": "commgrad-flight-recorder", "version": 1, "rank": 1, "pid": ..,
//    "host": "..", "reason": "..", "dumped_us": .., "buffer_size": 2000,
//    "entries": [{"record": 12, "op": "all_reduce", "group": "world",
//                 "group_ranks": [0, 1], "group_rank": 1, "seq": 5,
//                 "dtype": "float32", "sizes": [8], "state": "started",
//                 "queued_us": .., "posted_us": .., "finished_us": null}, ...]}
// Entries run oldest first; times are microseconds of the system clock.

#include "commgrad/dist/flight_recorder.h"

#include "commgrad/dist/group.h"
#include "commgrad/util/env.h"
#include "commgrad/util/names.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <ctime>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

namespace commgrad {
namespace {

constexpr int64_t kDefaultBufferSize = 2000;
constexpr int kMaxDims = 6;  // more dims are cut (the dump says how many there were)

enum class State : uint8_t { kQueued, kPosted, kFinished, kFailed, kTimedOut };

const char* state_name(State s) {
  switch (s) {
    case State::kQueued:
      return "queued";
    case State::kPosted:
      return "started";
    case State::kFinished:
      return "finished";
    case State::kFailed:
      return "failed";
    case State::kTimedOut:
      return "timed_out";
  }
  return "?";
}

struct Entry {
  uint64_t record = 0;
  const char* op = nullptr;  // null: an empty slot
  uint64_t sequence = 0;
  std::weak_ptr<detail::GroupState> group;  // not kept alive by the record
  int global_rank = -1;
  bool has_tensor = false;
  at::ScalarType dtype = at::kFloat;
  int ndim = 0;
  std::array<int64_t, kMaxDims> sizes{};
  State state = State::kQueued;
  int64_t queued_us = 0;
  int64_t posted_us = 0;
  int64_t finished_us = 0;
};

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The system clock at the kernel's tick (1-4 ms): a fifth of the cost of
// now_us() on the path of every collective; a hang is measured in seconds.
int64_t coarse_now_us() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME_COARSE, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

// What the dump says of a group: kept from its first collective on, so that
// a group destroyed before the dump is still named.
struct GroupInfo {
  std::string name;
  std::vector<int> ranks;
  int rank = -1;
};
using GroupKey = std::weak_ptr<detail::GroupState>;  // compared by owner: unique while any copy lives

bool same_owner(const GroupKey& a, const std::shared_ptr<detail::GroupState>& b) {
  return !a.owner_before(b) && !b.owner_before(a);
}

// The recorder of this process.
struct Recorder {
  std::mutex mutex;
  bool configured = false;
  std::vector<Entry> ring;  // empty when off
  uint64_t next_record = 0;
  // The collective started last (the terminate handler's): its record, and
  // its entry itself when the ring is off.
  uint64_t last_record = 0;
  bool last_valid = false;
  Entry last;

  // Every group a collective ran on, and a small cache of the ones seen last
  // (a collective on a known group costs a hash and two comparisons).
  std::map<GroupKey, GroupInfo, std::owner_less<GroupKey>> groups;
  std::array<GroupKey, 16> seen;

  void remember(const std::shared_ptr<detail::GroupState>& g) {
    GroupKey& slot = seen[(reinterpret_cast<uintptr_t>(g.get()) >> 4) % seen.size()];
    if (same_owner(slot, g)) return;
    slot = g;
    groups.try_emplace(GroupKey(g), GroupInfo{g->name, g->ranks, g->rank});
  }

  // The slot of `record`, or null when it was overwritten (or the ring is off).
  Entry* slot(uint64_t record) {
    if (ring.empty()) return nullptr;
    Entry& e = ring[record % ring.size()];
    return e.op != nullptr && e.record == record ? &e : nullptr;
  }
  void configure() {
    if (configured) return;
    configured = true;
    const auto n = env::get_count("COMMGRAD_TRACE_BUFFER_SIZE", "collectives").value_or(kDefaultBufferSize);
    ring.resize(static_cast<size_t>(n));
  }
};

Recorder& recorder() {
  static Recorder* r = new Recorder();  // never destroyed: ranks may dump while the process exits
  return *r;
}

// An entry and its group, as a dump writes them.
using Recorded = std::pair<Entry, GroupInfo>;

// ~~~ JSON ~~~

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

template <class T>
std::string json_list(const T* begin, const T* end) {
  std::string out = "[";
  for (const T* p = begin; p != end; ++p) out += (p == begin ? "" : ", ") + std::to_string(*p);
  return out + "]";
}

std::string time_or_null(int64_t us) { return us == 0 ? std::string("null") : std::to_string(us); }

void write_entry(std::ostream& out, const Entry& e, const GroupInfo& group) {
  out << "{\"record\": " << e.record << ", \"op\": " << quoted(e.op) << ", \"group\": " << quoted(group.name)
      << ", \"group_ranks\": " << json_list(group.ranks.data(), group.ranks.data() + group.ranks.size())
      << ", \"group_rank\": " << group.rank;
  out << ", \"seq\": " << e.sequence;
  if (e.has_tensor) {
    out << ", \"dtype\": " << quoted(dtype_name(e.dtype))
        << ", \"sizes\": " << json_list(e.sizes.data(), e.sizes.data() + std::min(e.ndim, kMaxDims));
    if (e.ndim > kMaxDims) out << ", \"ndim\": " << e.ndim;
  }
  out << ", \"state\": " << quoted(state_name(e.state)) << ", \"queued_us\": " << e.queued_us
      << ", \"posted_us\": " << time_or_null(e.posted_us) << ", \"finished_us\": " << time_or_null(e.finished_us)
      << "}";
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "";
  return buf;
}

// Writes rank `rank`'s entries of `entries` (oldest first) to DIR/rank_<rank>.json
// through a temporary file; returns the path ("" when it could not be written).
std::string write_dump(const std::string& dir, int rank, const std::vector<Recorded>& entries, size_t buffer_size,
                       const std::string& reason) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  const std::string path = (fs::path(dir) / ("rank_" + std::to_string(rank) + ".json")).string();
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  {
    std::ofstream out(tmp);
    if (!out) return "";
    out << "{\"format\": \"commgrad-flight-recorder\", \"version\": 1, \"rank\": " << rank << ", \"pid\": " << getpid()
        << ", \"host\": " << quoted(host_name()) << ", \"reason\": " << quoted(reason)
        << ", \"dumped_us\": " << now_us() << ", \"buffer_size\": " << buffer_size << ",\n \"entries\": [";
    bool first = true;
    for (const auto& [e, group] : entries) {
      if (e.global_rank != rank) continue;
      out << (first ? "\n  " : ",\n  ");
      write_entry(out, e, group);
      first = false;
    }
    out << "]}\n";
    if (!out) return "";
  }
  fs::rename(tmp, path, ec);
  return ec ? std::string() : path;
}

// The ring's entries oldest first, each with its group (a copy, taken under the lock).
std::vector<Recorded> snapshot(Recorder& r) {
  std::vector<Recorded> out;
  const size_t n = r.ring.size();
  const uint64_t first = r.next_record > n ? r.next_record - n : 0;
  for (uint64_t id = first; id < r.next_record; ++id) {
    const Entry& e = r.ring[id % n];
    if (e.op == nullptr || e.record != id) continue;
    const auto group = r.groups.find(e.group);
    out.push_back({e, group == r.groups.end() ? GroupInfo{"?", {}, -1} : group->second});
  }
  return out;
}

// Writes the files of every rank in the ring, or of `only` when >= 0.
std::vector<std::string> dump(const std::string& reason, bool block, int only = -1) {
  Recorder& r = recorder();
  std::unique_lock<std::mutex> lock(r.mutex, std::defer_lock);
  if (block) {
    lock.lock();
  } else if (!lock.try_lock()) {
    return {};
  }
  if (r.ring.empty()) return {};
  const auto entries = snapshot(r);
  const size_t buffer_size = r.ring.size();
  lock.unlock();
  std::set<int> ranks;
  for (const auto& recorded : entries) {
    if (only < 0 || recorded.first.global_rank == only) ranks.insert(recorded.first.global_rank);
  }
  std::vector<std::string> paths;
  const std::string dir = flight_recorder_directory();
  for (const int rank : ranks) {
    const auto path = write_dump(dir, rank, entries, buffer_size, reason);
    if (!path.empty()) paths.push_back(path);
  }
  return paths;
}

// ~~~ the signal ~~~

int g_signal_pipe[2] = {-1, -1};

extern "C" void on_dump_signal(int) {
  const int saved = errno;
  const char byte = 1;
  ssize_t ignored = write(g_signal_pipe[1], &byte, 1);
  (void)ignored;
  errno = saved;
}

int signal_number() {
  const auto value = env::get("COMMGRAD_TRACE_SIGNAL");
  if (!value || value->empty()) return SIGUSR2;
  const std::string name = value->rfind("SIG", 0) == 0 ? value->substr(3) : *value;
  if (name == "USR2") return SIGUSR2;
  if (name == "USR1") return SIGUSR1;
  char* end = nullptr;
  const long n = std::strtol(name.c_str(), &end, 10);
  TORCH_CHECK(!name.empty() && *end == '\0' && n >= 0 && n < NSIG, "[commgrad] environment: COMMGRAD_TRACE_SIGNAL='",
              *value, "' is not a signal (expected USR2, USR1, a number, or 0 for none)");
  return static_cast<int>(n);
}

}  // namespace

std::string flight_recorder_directory() {
  const auto dir = env::get("COMMGRAD_TRACE_DIR");
  return dir && !dir->empty() ? *dir : std::string("commgrad-trace");
}

std::vector<std::string> dump_flight_recorder(const std::string& reason) { return dump(reason, true); }

void install_flight_recorder_signal() {
  const int sig = signal_number();  // checked on every call
  if (sig == 0) return;
  static std::once_flag once;
  std::call_once(once, [sig] {
    struct sigaction old {};
    if (sigaction(sig, nullptr, &old) != 0 || old.sa_handler != SIG_DFL) return;  // the program's own
    if (pipe2(g_signal_pipe, O_CLOEXEC) != 0) return;
    std::thread([] {
      for (char byte = 0;;) {
        const ssize_t n = read(g_signal_pipe[0], &byte, 1);
        if (n == 1) {
          dump("signal", true);
        } else if (n < 0 && errno != EINTR) {
          return;
        } else if (n == 0) {
          return;
        }
      }
    }).detach();
    struct sigaction action {};
    action.sa_handler = on_dump_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    sigaction(sig, &action, nullptr);
  });
}

namespace detail {

uint64_t note_collective_started(const char* op, uint64_t sequence, const std::shared_ptr<GroupState>& group,
                                 const at::Tensor& x) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.configure();
  const bool off = r.ring.empty();
  Entry& e = off ? r.last : r.ring[r.next_record % r.ring.size()];
  e.record = r.next_record++;
  e.op = op;
  e.sequence = sequence;
  e.group = group;
  r.last_record = e.record;
  r.last_valid = true;
  if (off) return e.record;  // what the terminate handler needs, no more
  r.remember(group);
  e.global_rank = group->global_rank;
  e.has_tensor = x.defined();
  if (e.has_tensor) {
    e.dtype = x.scalar_type();
    e.ndim = static_cast<int>(x.dim());
    for (int d = 0; d < std::min(e.ndim, kMaxDims); ++d) e.sizes[d] = x.size(d);
  }
  e.state = State::kQueued;
  e.queued_us = coarse_now_us();
  e.posted_us = 0;
  e.finished_us = 0;
  return e.record;
}

void note_collective_posted(uint64_t record) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (Entry* e = r.slot(record)) {
    e->state = State::kPosted;
    e->posted_us = coarse_now_us();
  }
}

void note_collective_finished(uint64_t record) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (Entry* e = r.slot(record)) {
    e->state = State::kFinished;
    e->finished_us = coarse_now_us();
  }
  if (r.last_valid && r.last_record == record) r.last_valid = false;
}

void note_collective_failed(uint64_t record, bool timeout, const std::string& why) {
  int rank = -1;  // the failing rank's file only (thread ranks share the ring)
  {
    Recorder& r = recorder();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (Entry* e = r.slot(record)) {
      e->state = timeout ? State::kTimedOut : State::kFailed;
      e->finished_us = now_us();
      rank = e->global_rank;
    }
  }
  dump(why, true, rank);
}

std::vector<std::string> try_dump_flight_recorder(const std::string& reason) { return dump(reason, false); }

InFlight collective_in_flight() {
  Recorder& r = recorder();
  std::unique_lock<std::mutex> lock(r.mutex, std::try_to_lock);  // never block a dying process
  if (!lock.owns_lock() || !r.last_valid) return {};
  const Entry* e = r.ring.empty() ? &r.last : r.slot(r.last_record);
  if (e == nullptr) return {};
  return InFlight{e->op, e->sequence, e->group};
}

}  // namespace detail
}  // namespace commgrad
