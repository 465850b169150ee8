#include "harness/subprocess.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>

extern char** environ;

namespace commgrad::testing {

ProcessResult run_process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                          std::chrono::milliseconds timeout) {
  int out_pipe[2], err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) {
    throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
  }
  const auto start = std::chrono::steady_clock::now();
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    setpgid(0, 0);
    dup2(out_pipe[1], 1);
    dup2(err_pipe[1], 2);
    int devnull = open("/dev/null", O_RDONLY);
    dup2(devnull, 0);
    for (const auto& [k, v] : env) {
      if (v.empty()) {
        unsetenv(k.c_str());
      } else {
        setenv(k.c_str(), v.c_str(), 1);
      }
    }
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    dprintf(2, "run_process: cannot execute %s: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  setpgid(pid, pid);
  close(out_pipe[1]);
  close(err_pipe[1]);

  ProcessResult result;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&result.out, &result.err};
  int open_fds = 2;
  const auto deadline = start + timeout;
  while (open_fds > 0) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      result.timed_out = true;
      kill(-pid, SIGKILL);
      break;
    }
    if (poll(fds, 2, static_cast<int>(left.count())) < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[4096];
      const ssize_t n = read(fds[i].fd, buf, sizeof(buf));
      if (n > 0) {
        sinks[i]->append(buf, n);
      } else if (n == 0 || errno != EINTR) {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  for (auto& fd : fds) {
    if (fd.fd >= 0) close(fd.fd);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  // Whatever the command left behind in its process group goes too.
  kill(-pid, SIGKILL);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

std::string build_path(const std::string& relative) {
  const char* dir = std::getenv("COMMGRAD_BUILD_DIR");
  if (dir == nullptr) throw std::runtime_error("COMMGRAD_BUILD_DIR is not set (run the tests through ctest)");
  return std::string(dir) + "/" + relative;
}

std::string launcher_path() {
  if (const char* run = std::getenv("COMMGRAD_RUN")) return run;
  return build_path("bin/commgrad-run");
}

std::map<std::string, std::string> clean_env(const std::map<std::string, std::string>& extra) {
  std::map<std::string, std::string> env;
  for (const char* name :
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
        "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
        "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "COMMGRAD_BACKEND"}) {
    env[name] = "";
  }
  for (const auto& [k, v] : extra) env[k] = v;
  return env;
}

ProcessResult run_on_hosts(const std::vector<int>& host_of_rank, const std::string& program, const std::string& args,
                           const std::map<std::string, std::string>& env, std::chrono::milliseconds timeout) {
  const int world = static_cast<int>(host_of_rank.size());
  std::map<int, int> per_host, placed;
  for (int h : host_of_rank) ++per_host[h];
  std::string script = "fail=0; pids=";
  for (int rank = 0; rank < world; ++rank) {
    const int h = host_of_rank[rank];
    script += "; RANK=" + std::to_string(rank) + " WORLD_SIZE=" + std::to_string(world) +
              " LOCAL_RANK=" + std::to_string(placed[h]++) + " LOCAL_WORLD_SIZE=" + std::to_string(per_host[h]) +
              " COMMGRAD_HOST=host" + std::to_string(h) + " \"$PROGRAM\" " + args + " 2>&1 | sed 's/^/[" +
              std::to_string(rank) + "] /' & pids=\"$pids $!\"";
  }
  script += "; for p in $pids; do wait $p || fail=1; done; exit $fail";
  auto all = env;
  all["PROGRAM"] = program;
  all["MASTER_ADDR"] = "127.0.0.1";
  all["MASTER_PORT"] = std::to_string(free_port());
  return run_process({"bash", "-o", "pipefail", "-c", script}, clean_env(all), timeout);
}

std::vector<std::string> lines_with_prefix(const std::string& text, const std::string& prefix) {
  std::vector<std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(prefix, 0) == 0) out.push_back(line);
  }
  return out;
}

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace commgrad::testing
