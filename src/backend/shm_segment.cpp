// The shm segment: layout, creation, mapping, unlinking, futexes.
//
// Naming and lifetime. Rank 0 draws 128 random bits from the kernel and
// creates "/commgrad-shm-<32 hex digits>" with O_CREAT|O_EXCL and mode 0600,
// so no other job (or user) can guess, open or collide with it. It reserves
// the whole size with posix_fallocate (a too-small /dev/shm fails here with
// a clear error instead of a SIGBUS in the middle of a collective) and
// publishes the name under a store key that also carries a per-rank
// generation number, so that a second group over the same store prefix
// never reads a stale name. Under a launcher that sets TORCHELASTIC_RUN_ID
// the name starts with it ("/commgrad-shm-<job>-<hex>"), so the launcher can
// remove what a job it stopped left behind. Every rank maps the segment,
// writes its pid into its control block and arrives at the segment's first
// barrier; the rank that completes that barrier unlinks the name. No rank
// leaves the constructor before that barrier, so from then on only the
// mappings keep the memory alive and a kill -9 of any rank leaves nothing
// in /dev/shm. Before it, a rank that cannot join unlinks the name itself
// and leaves its reason in the store; the waiting ranks look there, and at
// the liveness of the ranks not yet mapped (each stored its pid first),
// every 50 ms, and give up at once, unlinking the name too.
//
// Layout (every offset computed the same way by every rank, see Layout::compute):
//
//   Header | RankBlock[n] | aux int64[3][n][3n] | slots [3][n][chunk] | mailboxes [n][n]
//
// Futexes. The words live in MAP_SHARED memory, so waits and wakes use the
// shared (not FUTEX_PRIVATE) operations, keyed by the page, and work
// across processes as well as across threads of one process.

#include "detail/shm_segment.h"

#include "detail/shm_single_copy.h"

#include "commgrad/detail/torch_compat.h"
#include "commgrad/util/env.h"
#include "commgrad/util/error.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <climits>
#include <cstring>
#include <new>
#include <thread>
#include <vector>

namespace commgrad::backend::detail {
namespace {

constexpr uint64_t kMagic = 0x6873646172676d63ULL;  // "cmgradsh"
constexpr uint32_t kVersion = 5;

uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

std::string errno_text(int err) { return c10::str(std::strerror(err), " (errno ", err, ")"); }

std::string random_hex(int bytes) {
  std::vector<unsigned char> buf(bytes);
  size_t got = 0;
  while (got < buf.size()) {
    const ssize_t r = getrandom(buf.data() + got, buf.size() - got, 0);
    if (r < 0 && errno == EINTR) continue;
    TORCH_CHECK(r > 0, "[commgrad] shm: getrandom failed: ", errno_text(errno));
    got += static_cast<size_t>(r);
  }
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : buf) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

std::string mib(uint64_t bytes) { return c10::str(static_cast<double>(bytes) / (1024.0 * 1024.0), " MiB"); }

std::string shm_free_space() {
  struct statvfs st {};
  if (statvfs("/dev/shm", &st) != 0) return "unknown";
  return mib(static_cast<uint64_t>(st.f_bavail) * st.f_frsize);
}

}  // namespace

std::string segment_name_prefix() {
  // The launcher's job id (torchrun's run id), when it is a plain word: the
  // launcher removes what a job it ran left behind by this prefix.
  const std::string job = env::get("TORCHELASTIC_RUN_ID").value_or("");
  const bool plain = !job.empty() && job.size() <= 64 && job != "none" &&
                     std::all_of(job.begin(), job.end(),
                                 [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
  return plain ? "/commgrad-shm-" + job + "-" : std::string("/commgrad-shm-");
}

Layout Layout::compute(int size, uint64_t chunk_bytes, uint64_t mailbox_bytes) {
  Layout l;
  l.size = size;
  l.chunk_bytes = chunk_bytes;
  l.mailbox_bytes = size > 1 ? mailbox_bytes : 0;
  const auto n = static_cast<uint64_t>(size);
  l.ranks_offset = align_up(sizeof(Header), kLine);
  l.sets_offset = align_up(l.ranks_offset + n * sizeof(RankBlock), kLine);
  l.set_stride = align_up(sizeof(SetBlock) + 3 * n * sizeof(int64_t), kLine);
  l.slots_offset = align_up(l.sets_offset + kSets * n * l.set_stride, 4096);
  l.mailbox_offset = align_up(l.slots_offset + kSets * n * chunk_bytes, 4096);
  l.mailbox_stride = size > 1 ? align_up(sizeof(MailboxHead) + l.mailbox_bytes, kLine) : 0;
  l.total_bytes = align_up(l.mailbox_offset + n * n * l.mailbox_stride, 4096);
  return l;
}

Segment::Segment(const SegmentConfig& config)
    : layout_(Layout::compute(config.size, config.chunk_bytes, config.mailbox_bytes)) {
  // The key carries this rank's count of groups created over the store.
  const int64_t generation = config.store->add(c10::str("shm/generation/", config.rank), 1);
  const std::string key = c10::str("shm/", generation, "/segment");
  keys_ = c10::str("shm/", generation, "/");
  // Before anything can fail: who this rank is, so that a waiting peer can
  // tell when it died before it mapped the segment.
  const std::string me = c10::str(getpid(), " ", pid_namespace());
  config.store->set(keys_ + c10::str("pid/", config.rank), std::vector<uint8_t>(me.begin(), me.end()));
  if (config.rank == 0) {
    create(config);
    const std::string& n = name_;
    config.store->set(key, std::vector<uint8_t>(n.begin(), n.end()));
  } else {
    try {
      config.store->wait({key}, config.timeout);
    } catch (const std::exception& e) {
      COMMGRAD_THROW_MESSAGE(::commgrad::ErrorKind::kTimeout, "[commgrad] shm ", config.context,
                             ": rank 0 did not publish the shared-memory segment within ",
                             config.timeout.count() / 1000.0, "s (did rank 0 fail to create it?): ", e.what());
    }
    const auto bytes = config.store->get(key);
    name_.assign(bytes.begin(), bytes.end());
    try {
      open(config);
    } catch (const std::exception& e) {
      give_up(config, e.what());
      throw;
    }
  }
  rank_block(config.rank).pid_namespace = pid_namespace();
  rank_block(config.rank).probe_address = single_copy_probe_address();
  rank_block(config.rank).pid.store(static_cast<int32_t>(getpid()), std::memory_order_release);
  wait_until_mapped(config);
}

// A rank that cannot join removes the name itself (rank 0, which created it,
// may be stopped by the launcher before it notices) and leaves its reason in
// the store, where the waiting ranks find it.
void Segment::give_up(const SegmentConfig& config, const std::string& reason) {
  shm_unlink(name_.c_str());  // ENOENT is fine: someone was first
  const std::string what = reason.substr(0, reason.find('\n'));
  try {
    config.store->set(keys_ + "failed", std::vector<uint8_t>(what.begin(), what.end()));
  } catch (const std::exception&) {
    // The store is gone too: the peers time out instead.
  }
}

Segment::~Segment() {
  if (base_ != nullptr) munmap(base_, layout_.total_bytes);
}

void Segment::create(const SegmentConfig& config) {
  int fd = -1;
  for (int attempt = 0; attempt < 4 && fd < 0; ++attempt) {
    name_ = segment_name_prefix() + random_hex(16);
    fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, S_IRUSR | S_IWUSR);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    COMMGRAD_THROW_MESSAGE(::commgrad::ErrorKind::kPeerFailed, "[commgrad] shm ", config.context,
                           ": cannot create segment ", name_, " in /dev/shm: ", errno_text(errno));
  }
  auto fail = [&](const std::string& what, int err) {
    close(fd);
    shm_unlink(name_.c_str());
    COMMGRAD_THROW_MESSAGE(::commgrad::ErrorKind::kPeerFailed, "[commgrad] shm ", config.context, ": ", what, " ",
                           name_, " (", mib(layout_.total_bytes), "): ", errno_text(err), "; /dev/shm has ",
                           shm_free_space(), " free. A smaller COMMGRAD_SHM_CHUNK_BYTES needs less.");
  };
  if (ftruncate(fd, static_cast<off_t>(layout_.total_bytes)) != 0) fail("cannot size segment", errno);
  const int rc = posix_fallocate(fd, 0, static_cast<off_t>(layout_.total_bytes));
  if (rc != 0) fail("cannot reserve memory for segment", rc);
  void* p = mmap(nullptr, layout_.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) fail("cannot map segment", errno);
  close(fd);
  base_ = static_cast<uint8_t*>(p);

  // The file is zero-filled: construct the control words in place.
  auto* h = new (base_) Header{};
  h->version = kVersion;
  h->size = config.size;
  h->chunk_bytes = layout_.chunk_bytes;
  h->mailbox_bytes = layout_.mailbox_bytes;
  h->single_copy_bytes = config.single_copy_bytes;
  h->single_copy_max_bytes = config.single_copy_max_bytes;
  h->single_copy_piece_bytes = config.single_copy_piece_bytes;
  h->total_bytes = layout_.total_bytes;
  for (int r = 0; r < config.size; ++r) new (&rank_block(r)) RankBlock{};
  if (config.size > 1) {
    for (int s = 0; s < config.size; ++s) {
      for (int d = 0; d < config.size; ++d) new (&mailbox(s, d)) MailboxHead{};
    }
  }
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;
}

void Segment::open(const SegmentConfig& config) {
  const int fd = shm_open(name_.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    COMMGRAD_THROW_MESSAGE(
        ::commgrad::ErrorKind::kPeerFailed, "[commgrad] shm ", config.context, ": cannot open segment ", name_,
        " created by rank 0: ", errno_text(errno),
        errno == ENOENT ? " (it was unlinked: another rank gave up waiting, or this rank is not on rank 0's host)"
                        : "");
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != layout_.total_bytes) {
    close(fd);
    TORCH_CHECK(false, "[commgrad] shm ", config.context, ": segment ", name_, " has ", st.st_size,
                " bytes, this rank expects ", layout_.total_bytes,
                " (all ranks must use the same chunk_bytes / COMMGRAD_SHM_CHUNK_BYTES, mailbox_bytes and group size)");
  }
  void* p = mmap(nullptr, layout_.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    COMMGRAD_THROW_MESSAGE(::commgrad::ErrorKind::kPeerFailed, "[commgrad] shm ", config.context,
                           ": cannot map segment ", name_, ": ", errno_text(err));
  }
  base_ = static_cast<uint8_t*>(p);
  std::atomic_thread_fence(std::memory_order_acquire);
  const Header& h = header();
  if (h.magic != kMagic || h.version != kVersion || h.size != config.size || h.chunk_bytes != layout_.chunk_bytes ||
      h.mailbox_bytes != layout_.mailbox_bytes || h.single_copy_bytes != config.single_copy_bytes ||
      h.single_copy_max_bytes != config.single_copy_max_bytes ||
      h.single_copy_piece_bytes != config.single_copy_piece_bytes) {
    const std::string got = c10::str("size ", h.size, ", chunk_bytes ", h.chunk_bytes, ", mailbox_bytes ",
                                     h.mailbox_bytes, ", single_copy_bytes ", h.single_copy_bytes, " to ",
                                     h.single_copy_max_bytes, ", single_copy_piece_bytes ", h.single_copy_piece_bytes);
    munmap(base_, layout_.total_bytes);
    base_ = nullptr;
    TORCH_CHECK(false, "[commgrad] shm ", config.context, ": rank 0 created segment ", name_, " with ", got,
                "; this rank expects size ", config.size, ", chunk_bytes ", layout_.chunk_bytes, ", mailbox_bytes ",
                layout_.mailbox_bytes, ", single_copy_bytes ", config.single_copy_bytes, " to ",
                config.single_copy_max_bytes, ", single_copy_piece_bytes ", config.single_copy_piece_bytes,
                " (all ranks must use the same settings)");
  }
}

void Segment::wait_until_mapped(const SegmentConfig& config) {
  Bell& bell = header().mapped;
  const auto n = static_cast<uint32_t>(config.size);
  const uint32_t arrived = bell.value.fetch_add(1, std::memory_order_seq_cst) + 1;
  if (arrived == n) {
    // Everyone has it mapped: the name is no longer needed.
    shm_unlink(name_.c_str());
    if (bell.sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&bell.value);
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + config.timeout;
  auto next_look = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
  while (true) {
    const uint32_t v = bell.value.load(std::memory_order_acquire);
    if (v >= n) return;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) break;
    if (now >= next_look) {  // a peer that failed or died, at most every 50 ms
      next_look = now + std::chrono::milliseconds(50);
      check_peers(config);
    }
    bell.sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (bell.value.load(std::memory_order_seq_cst) == v) {
      futex_wait(&bell.value, v, std::min<std::chrono::nanoseconds>(deadline - now, std::chrono::milliseconds(50)));
    }
    bell.sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
  std::vector<int> missing;
  for (int r = 0; r < config.size; ++r) {
    if (rank_block(r).pid.load(std::memory_order_relaxed) == 0) missing.push_back(r);
  }
  abandon();
  COMMGRAD_THROW_MESSAGE(::commgrad::ErrorKind::kTimeout, "[commgrad] shm ", config.context, ": ",
                         describe_ranks(missing), " did not map the shared-memory segment within ",
                         config.timeout.count() / 1000.0, "s");
}

void Segment::abandon() {
  shm_unlink(name_.c_str());  // nobody else may join now; ENOENT is fine
  munmap(base_, layout_.total_bytes);
  base_ = nullptr;
}

// Throws (after removing the name) when a peer left its reason for not
// joining, or died before it mapped the segment.
void Segment::check_peers(const SegmentConfig& config) {
  std::string failure;
  try {
    if (config.store->check({keys_ + "failed"})) {
      const auto bytes = config.store->get(keys_ + "failed");
      failure.assign(bytes.begin(), bytes.end());
    }
  } catch (const std::exception& e) {
    failure = c10::str("the store is gone (", std::string(e.what()).substr(0, 200), ")");
  }
  if (!failure.empty()) {
    abandon();
    COMMGRAD_THROW_MESSAGE(::commgrad::ErrorKind::kPeerFailed, "[commgrad] shm ", config.context,
                           ": a peer could not join the shared-memory segment: ", failure);
  }
  const uint64_t my_namespace = pid_namespace();
  for (int r = 0; r < config.size; ++r) {
    if (rank_block(r).pid.load(std::memory_order_acquire) != 0) continue;
    long long pid = 0;
    unsigned long long ns = 0;
    try {
      const std::string key = keys_ + c10::str("pid/", r);
      if (!config.store->check({key})) continue;
      const auto bytes = config.store->get(key);
      if (std::sscanf(std::string(bytes.begin(), bytes.end()).c_str(), "%lld %llu", &pid, &ns) != 2) continue;
    } catch (const std::exception&) {
      continue;
    }
    if (ns != my_namespace || process_alive(static_cast<int32_t>(pid))) continue;
    abandon();
    COMMGRAD_THROW_MESSAGE(::commgrad::ErrorKind::kPeerFailed, "[commgrad] shm ", config.context, ": rank ", r,
                           " (pid ", pid, ") exited before it mapped the shared-memory segment");
  }
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  if (timeout.count() <= 0) return;
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

std::string describe_ranks(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += c10::str(i == 0 ? "" : ", ", ranks[i]);
  return out;
}

uint64_t pid_namespace() {
  struct stat st {};
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

bool process_alive(int32_t pid) {
  if (pid <= 0 || pid == getpid()) return true;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  // A killed process stays a zombie until its parent reaps it.
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno != ENOENT;
  char buf[512];
  const ssize_t len = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (len <= 0) return true;
  buf[len] = '\0';
  const char* paren = std::strrchr(buf, ')');
  if (paren == nullptr || paren[1] == '\0' || paren[2] == '\0') return true;
  const char state = paren[2];
  return state != 'Z' && state != 'X';
}

}  // namespace commgrad::backend::detail
