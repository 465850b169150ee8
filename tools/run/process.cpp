#include "process.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

namespace commgrad::run {
namespace {

// What execvp searches when PATH is unset (glibc's default).
constexpr const char* kDefaultPath = "/bin:/usr/bin";

// An executable regular file, or why not (errno style).
int check_executable(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return errno;
  if (S_ISDIR(st.st_mode)) return EISDIR;
  if (!S_ISREG(st.st_mode)) return EACCES;
  if (access(path.c_str(), X_OK) != 0) return errno;
  return 0;
}

// Reads a small /proc file with plain read(): the process may vanish
// mid-read, which iostreams report by throwing.
std::string read_proc_file(const std::string& path) {
  std::string text;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return text;
  char buf[4096];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n > 0) {
      text.append(buf, static_cast<std::size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      break;
    }
  }
  close(fd);
  return text;
}

bool is_removed_variable(const std::string& name) {
  return name.rfind("OMPI_COMM_WORLD_", 0) == 0 || name == "SLURM_PROCID" || name == "SLURM_NTASKS" ||
         name == "SLURM_LOCALID";
}

}  // namespace

std::string random_job_id() {
  unsigned char bytes[8] = {};
  const int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  bool ok = fd >= 0 && read(fd, bytes, sizeof(bytes)) == static_cast<ssize_t>(sizeof(bytes));
  if (fd >= 0) close(fd);
  if (!ok) {  // unlikely: mix the pid and the time instead
    const std::uint64_t v = (static_cast<std::uint64_t>(getpid()) << 32) ^ static_cast<std::uint64_t>(time(nullptr));
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<unsigned char>(v >> (8 * i));
  }
  static const char* digits = "0123456789abcdef";
  std::string id;
  for (unsigned char b : bytes) {
    id.push_back(digits[b >> 4]);
    id.push_back(digits[b & 15]);
  }
  return id;
}

int remove_job_segments(const std::string& job_id) {
  if (job_id.empty()) return 0;
  const std::string prefix = "commgrad-shm-" + job_id + "-";
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  while (const dirent* e = readdir(dir)) {
    if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) != 0) continue;
    if (unlinkat(dirfd(dir), e->d_name, 0) == 0) ++removed;
  }
  closedir(dir);
  return removed;
}

ResolvedProgram resolve_program(const std::string& program) {
  ResolvedProgram result;
  if (program.find('/') != std::string::npos) {
    const int err = check_executable(program);
    if (err == 0) {
      result.path = program;
    } else {
      result.exit_code = (err == ENOENT || err == ENOTDIR) ? kExitNotFound : kExitNotExecutable;
      result.error = std::strerror(err);
    }
    return result;
  }

  const char* env_path = std::getenv("PATH");
  const std::string search = (env_path != nullptr && *env_path != '\0') ? env_path : kDefaultPath;
  bool denied = false;
  std::size_t start = 0;
  while (start <= search.size()) {
    std::size_t end = search.find(':', start);
    if (end == std::string::npos) end = search.size();
    // An empty PATH entry means the current directory.
    const std::string dir = end > start ? search.substr(start, end - start) : std::string(".");
    const std::string candidate = dir + "/" + program;
    const int err = check_executable(candidate);
    if (err == 0) {
      result.path = candidate;
      return result;
    }
    // Like execvp: keep looking, but report EACCES if nothing better turns up.
    if (err != ENOENT && err != ENOTDIR) denied = true;
    start = end + 1;
  }
  result.exit_code = denied ? kExitNotExecutable : kExitNotFound;
  result.error = denied ? std::strerror(EACCES) : "not found in PATH";
  return result;
}

namespace {

// Binds a TCP socket to port 0 on `host` (nullptr: the wildcard address) and
// returns the port the kernel chose, or -1 with `*error` set.
int bind_port_zero(const char* host, std::string* error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* list = nullptr;
  const int rc = getaddrinfo(host, "0", &hints, &list);
  if (rc != 0) {
    *error = gai_strerror(rc);
    return -1;
  }
  int port = -1;
  for (addrinfo* ai = list; ai != nullptr && port < 0; ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      *error = std::strerror(errno);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0) {
      port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                         : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    } else {
      *error = std::strerror(errno);
    }
    close(fd);
  }
  freeaddrinfo(list);
  return port;
}

}  // namespace

int pick_free_port(const std::string& addr, std::string* error) {
  std::string why;
  int port = bind_port_zero(addr.c_str(), &why);
  // The master address may not be local (a hostname that resolves to
  // another machine): then any free local port will do.
  if (port < 0) port = bind_port_zero(nullptr, &why);
  if (port < 0) *error = "cannot pick a free port for --master-addr '" + addr + "': " + why;
  return port;
}

std::string signal_name(int sig) {
  struct Entry {
    int sig;
    const char* name;
  };
  static const Entry kNames[] = {
      {SIGHUP, "SIGHUP"},   {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"}, {SIGILL, "SIGILL"},       {SIGTRAP, "SIGTRAP"},
      {SIGABRT, "SIGABRT"}, {SIGBUS, "SIGBUS"},   {SIGFPE, "SIGFPE"},   {SIGKILL, "SIGKILL"},     {SIGUSR1, "SIGUSR1"},
      {SIGSEGV, "SIGSEGV"}, {SIGUSR2, "SIGUSR2"}, {SIGPIPE, "SIGPIPE"}, {SIGALRM, "SIGALRM"},     {SIGTERM, "SIGTERM"},
      {SIGCHLD, "SIGCHLD"}, {SIGCONT, "SIGCONT"}, {SIGSTOP, "SIGSTOP"}, {SIGTSTP, "SIGTSTP"},     {SIGTTIN, "SIGTTIN"},
      {SIGTTOU, "SIGTTOU"}, {SIGXCPU, "SIGXCPU"}, {SIGXFSZ, "SIGXFSZ"}, {SIGVTALRM, "SIGVTALRM"}, {SIGPROF, "SIGPROF"},
      {SIGSYS, "SIGSYS"},
  };
  for (const Entry& e : kNames) {
    if (e.sig == sig) return e.name;
  }
  return "signal " + std::to_string(sig);
}

bool write_all(int fd, const char* data, std::size_t size) {
  while (size > 0) {
    const ssize_t n = write(fd, data, size);
    if (n > 0) {
      data += n;
      size -= static_cast<std::size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      // Someone made our stdout non-blocking; wait instead of dropping output.
      pollfd p{fd, POLLOUT, 0};
      poll(&p, 1, 1000);
    } else {
      return false;
    }
  }
  return true;
}

std::vector<std::string> rank_environment(const char* const* parent,
                                          const std::vector<std::pair<std::string, std::string>>& vars) {
  std::vector<std::string> env;
  bool have_omp = false;
  for (const char* const* e = parent; e != nullptr && *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('='));
    if (is_removed_variable(name)) continue;
    bool overridden = false;
    for (const auto& var : vars) overridden = overridden || var.first == name;
    if (overridden) continue;
    have_omp = have_omp || name == "OMP_NUM_THREADS";
    env.push_back(entry);
  }
  for (const auto& var : vars) {
    have_omp = have_omp || var.first == "OMP_NUM_THREADS";
    env.push_back(var.first + "=" + var.second);
  }
  // Ranks usually outnumber cores on one node; one intra-op thread each.
  if (!have_omp) env.emplace_back("OMP_NUM_THREADS=1");
  return env;
}

std::vector<pid_t> orphaned_children(const std::vector<pid_t>& known) {
  std::vector<pid_t> found;
  const pid_t self = getpid();
  DIR* dir = opendir("/proc");
  if (dir == nullptr) return found;
  while (dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long pid = std::strtol(entry->d_name, &end, 10);
    if (*end != '\0' || pid <= 0) continue;
    const std::string stat = read_proc_file(std::string("/proc/") + entry->d_name + "/stat");
    // Format: "pid (comm) state ppid ..."; comm may contain spaces and ')'.
    const auto paren = stat.rfind(')');
    if (paren == std::string::npos) continue;
    char state = 0;
    long ppid = 0;
    if (std::sscanf(stat.c_str() + paren + 1, " %c %ld", &state, &ppid) != 2) continue;
    if (ppid != self || state == 'Z') continue;
    bool is_known = false;
    for (pid_t k : known) is_known = is_known || k == pid;
    if (!is_known) found.push_back(static_cast<pid_t>(pid));
  }
  closedir(dir);
  return found;
}

Watchdog::~Watchdog() { stop(); }

bool Watchdog::start() {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return false;
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return false;
  }
  if (pid == 0) {
    // The watchdog: its own process group and deaf to the signals meant for
    // the launcher, so Ctrl-C or `kill -- -<launcher pgid>` leave it to
    // clean up after the launcher.
    setpgid(0, 0);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGTSTP, SIGTTIN, SIGTTOU}) signal(sig, SIG_IGN);
    signal(SIGCHLD, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    // Hold no one's pipes open: stdio to /dev/null, every other fd closed.
    const int devnull = open("/dev/null", O_RDWR);
    if (devnull >= 0) {
      for (int fd = 0; fd < 3; ++fd) dup2(devnull, fd);
    }
    const int in = dup2(fds[0], 3) == 3 ? 3 : fds[0];
    if (in != 3 || close_range(4, ~0U, 0) != 0) {
      for (int fd = 3; fd < 1024; ++fd) {
        if (fd != in) close(fd);
      }
    }
    std::vector<pid_t> groups;
    for (;;) {
      std::int32_t value = 0;
      const ssize_t n = read(in, &value, sizeof(value));
      if (n < 0 && errno == EINTR) continue;
      if (n == static_cast<ssize_t>(sizeof(value)) && value > 0) {
        groups.push_back(value);
        continue;
      }
      if (n == static_cast<ssize_t>(sizeof(value)) && value == 0) _exit(0);  // goodbye
      break;                                                                 // EOF: the launcher died
    }
    for (pid_t g : groups) kill(-g, SIGKILL);
    _exit(0);
  }
  close(fds[0]);
  fd_ = fds[1];
  pid_ = pid;
  return true;
}

void Watchdog::watch(pid_t pgid) {
  if (fd_ < 0) return;
  const std::int32_t value = pgid;
  write_all(fd_, reinterpret_cast<const char*>(&value), sizeof(value));
}

void Watchdog::stop() {
  if (fd_ >= 0) {
    const std::int32_t goodbye = 0;
    write_all(fd_, reinterpret_cast<const char*>(&goodbye), sizeof(goodbye));
    close(fd_);
    fd_ = -1;
  }
  if (pid_ > 0) {
    while (waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
  }
}

}  // namespace commgrad::run
