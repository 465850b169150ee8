#include "rendezvous.h"

// The sockets of the elastic rendezvous: one line from each guest ("join"),
// one line back ("round" or "fail"), then the connection closes. The host
// polls its listening socket, the guests' connections and the launcher's
// wake-up pipe in one loop, as the launcher polls its ranks' pipes; the
// round's rules (rendezvous_round.h) say when to stop.

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "process.h"

namespace commgrad::run {
namespace {

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

int to_ms(double s) { return static_cast<int>(std::clamp(std::ceil(s * 1000.0), 0.0, 3600.0 * 1000)); }

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%gs", s);
  return buf;
}

// The IPv4/IPv6 addresses of addr:port, or nullptr with `*why`.
addrinfo* resolve(const std::string& addr, int port, std::string* why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0) {
    *why = std::string("cannot resolve '") + addr + "': " + gai_strerror(rc);
    return nullptr;
  }
  return found;
}

void send_line(int fd, const std::string& line) {
  const std::string text = line + "\n";
  ssize_t ignored = send(fd, text.data(), text.size(), MSG_NOSIGNAL | MSG_DONTWAIT);  // one short line fits
  (void)ignored;
}

// Reads what is there; appends it to `buf`. False at EOF or on an error.
bool read_some(int fd, std::string& buf) {
  char chunk[512];
  for (;;) {
    const ssize_t n = read(fd, chunk, sizeof(chunk));
    if (n > 0) {
      buf.append(chunk, static_cast<std::size_t>(n));
      if (buf.size() > 4096) return false;  // not a join line
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
  }
}

// Takes the first complete line out of `buf`.
std::optional<std::string> take_line(std::string& buf) {
  const auto end = buf.find('\n');
  if (end == std::string::npos) return std::nullopt;
  std::string line = buf.substr(0, end);
  buf.erase(0, end + 1);
  return line;
}

// A node that connected to the host in this round.
struct Guest {
  int fd = -1;
  std::string buf;
  bool joined = false;
  bool gone = false;
};

void accept_guests(int listen_fd, std::vector<Guest>& guests) {
  for (;;) {
    const int fd = accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    Guest g;
    g.fd = fd;
    guests.push_back(std::move(g));
  }
}

// Reads a guest's join line, and notices a guest that went away.
void serve_guest(Guest& g, RoundState& state, const std::string& job_id, int nproc, int max_nodes) {
  const bool open = read_some(g.fd, g.buf);
  if (!g.joined) {
    if (const auto line = take_line(g.buf)) {
      auto why = refusal(*line, job_id, nproc);
      if (!why && state.nodes() >= max_nodes) {
        why = "the job is full: it has the most nodes --nnodes allows (" + std::to_string(max_nodes) + ")";
      }
      if (why) {
        send_line(g.fd, failure_line(*why));
        g.gone = true;
        return;
      }
      g.joined = true;
      state.joined(now_s());
    }
  }
  if (!open) {
    if (g.joined) state.left(now_s());
    g.gone = true;
  }
}

// Nodes that knocked as the round closed: in while there is room, else told
// the job is full. None stays in the listen queue: it would knock again.
void sweep_guests(int listen_fd, std::vector<Guest>& guests, RoundState& state, const std::string& job_id, int nproc,
                  int max_nodes) {
  accept_guests(listen_fd, guests);
  for (Guest& g : guests) {
    if (!g.joined && !g.gone) serve_guest(g, state, job_id, nproc, max_nodes);
  }
}

void close_guests(std::vector<Guest>& guests) {
  for (Guest& g : guests) {
    if (g.fd >= 0) close(g.fd);
  }
  guests.clear();
}

// Connects to addr:port before `deadline` (s), retrying while nobody listens
// yet. Returns the socket or -1 with `*why`.
int connect_before(const std::string& addr, int port, double deadline, std::string* why) {
  for (;;) {
    addrinfo* found = resolve(addr, port, why);
    if (found == nullptr) return -1;
    int fd = socket(found->ai_family, found->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int rc = fd < 0 ? -1 : connect(fd, found->ai_addr, found->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      rc = poll(&p, 1, to_ms(std::min(deadline - now_s(), 2.0)));
      int err = rc > 0 ? 0 : ETIMEDOUT;
      socklen_t len = sizeof(err);
      if (rc > 0) getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      errno = err;
      rc = err == 0 ? 0 : -1;
    }
    freeaddrinfo(found);
    if (rc == 0) return fd;
    *why = std::strerror(errno);
    if (fd >= 0) close(fd);
    if (now_s() >= deadline) return -1;
    usleep(250 * 1000);
  }
}

}  // namespace

Rendezvous::Rendezvous(const LaunchOptions& options, std::string job_id)
    : options_(options), job_id_(std::move(job_id)) {}

Rendezvous::~Rendezvous() {
  if (listen_fd_ >= 0) close(listen_fd_);
  if (member_fd_ >= 0) close(member_fd_);
  for (const int fd : members_) close(fd);
}

bool Rendezvous::new_round_wanted() {
  if (hosting()) return true;  // a node knocks
  if (member_fd_ < 0) return false;
  const bool open = read_some(member_fd_, member_buf_);
  if (const auto line = take_line(member_buf_)) return *line == restart_line();
  if (!open) {  // the host ended (its job is over, or it died): no news to wait for
    close(member_fd_);
    member_fd_ = -1;
  }
  return false;
}

std::string Rendezvous::endpoint() const { return options_.master_addr + ":" + std::to_string(*options_.master_port); }

bool Rendezvous::open(std::string* error) {
  addrinfo* found = resolve(options_.master_addr, *options_.master_port, error);
  if (found == nullptr) return false;
  const int fd = socket(found->ai_family, found->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  const int one = 1;
  if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  // Not an address of this node (EADDRNOTAVAIL), or another agent here hosts
  // it (EADDRINUSE): a guest.
  if (fd >= 0 && bind(fd, found->ai_addr, found->ai_addrlen) == 0 && listen(fd, 128) == 0) {
    listen_fd_ = fd;
  } else if (fd >= 0) {
    close(fd);
  }
  freeaddrinfo(found);
  return true;
}

RendezvousResult Rendezvous::next_round(int wake_fd, const std::function<bool()>& interrupted, double time_left_s) {
  ++round_;
  for (const int fd : members_) {
    send_line(fd, restart_line());
    close(fd);
  }
  members_.clear();
  if (member_fd_ >= 0) close(member_fd_);
  member_fd_ = -1;
  member_buf_.clear();
  const double stop_at_s = now_s() + time_left_s;
  return hosting() ? host_round(wake_fd, interrupted, stop_at_s) : guest_round(wake_fd, interrupted, stop_at_s);
}

RendezvousResult Rendezvous::host_round(int wake_fd, const std::function<bool()>& interrupted, double stop_at_s) {
  const auto [lo, hi] = *options_.elastic_nodes;
  RoundState state(RoundRule{lo, hi, options_.rdzv_join_timeout_s, options_.rdzv_last_call_s}, now_s());
  state.joined(now_s());  // the host is a node of every round
  std::vector<Guest> guests;
  RendezvousResult result;
  for (RoundDecision d = state.decide(now_s()); d.verdict == RoundVerdict::kWait; d = state.decide(now_s())) {
    std::vector<pollfd> fds = {{listen_fd_, POLLIN, 0}, {wake_fd, POLLIN, 0}};
    for (const Guest& g : guests) fds.push_back({g.fd, POLLIN, 0});
    if (poll(fds.data(), fds.size(), to_ms(std::min(d.wait_s, stop_at_s - now_s()))) < 0 && errno != EINTR) break;
    const bool stop = (fds[1].revents & POLLIN) != 0 && interrupted();
    if (stop || now_s() >= stop_at_s) {
      close_guests(guests);
      (stop ? result.interrupted : result.timed_out) = true;
      return result;
    }
    if ((fds[0].revents & POLLIN) != 0) accept_guests(listen_fd_, guests);
    for (std::size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents != 0) serve_guest(guests[i - 2], state, job_id_, options_.nproc_per_node, hi);
    }
    for (Guest& g : guests) {
      if (g.gone) close(g.fd);
    }
    guests.erase(std::remove_if(guests.begin(), guests.end(), [](const Guest& g) { return g.gone; }), guests.end());
  }
  if (state.decide(now_s()).verdict != RoundVerdict::kClose) {
    result.error = "rendezvous round " + std::to_string(round_) + " at " + endpoint() + " failed: " + state.failure();
    for (const Guest& g : guests) send_line(g.fd, failure_line(result.error));
    close_guests(guests);
    return result;
  }
  sweep_guests(listen_fd_, guests, state, job_id_, options_.nproc_per_node, hi);
  const int port = pick_free_port(options_.master_addr, &result.error);
  if (port < 0) {
    for (const Guest& g : guests) send_line(g.fd, failure_line(result.error));
    close_guests(guests);
    return result;
  }
  // Node ranks in the order of joining; a guest whose line has not come yet
  // is told to try again.
  int next = 1;
  for (Guest& g : guests) {
    if (g.joined && !g.gone) {
      send_line(g.fd, assignment_line({round_, next++, state.nodes(), port}));
      members_.push_back(g.fd);
      g.fd = -1;
    } else if (!g.gone) {
      send_line(g.fd, failure_line("the rendezvous round closed as this node came; start it again"));
    }
  }
  close_guests(guests);
  result.ok = true;
  result.assignment = RoundAssignment{round_, 0, state.nodes(), port};
  return result;
}

RendezvousResult Rendezvous::guest_round(int wake_fd, const std::function<bool()>& interrupted, double stop_at_s) {
  RendezvousResult result;
  const double join_deadline = now_s() + options_.rdzv_join_timeout_s;
  const double deadline = std::min(join_deadline, stop_at_s);
  std::string why;
  const int fd = connect_before(options_.master_addr, *options_.master_port, deadline, &why);
  if (fd < 0 && now_s() >= stop_at_s) {
    result.timed_out = true;
    return result;
  }
  if (fd < 0) {
    result.error = "could not reach the rendezvous at " + endpoint() + " within --rdzv-join-timeout " +
                   seconds(options_.rdzv_join_timeout_s) + ": " + why;
    return result;
  }
  send_line(fd, join_line(job_id_, options_.nproc_per_node));
  std::string buf;
  for (;;) {
    const double left = deadline - now_s();
    std::vector<pollfd> fds = {{fd, POLLIN, 0}, {wake_fd, POLLIN, 0}};
    const int rc = left > 0 ? poll(fds.data(), fds.size(), to_ms(left)) : 0;
    if (rc < 0 && errno == EINTR) continue;
    if (rc == 0 && now_s() >= stop_at_s) {
      result.timed_out = true;
      break;
    }
    if (rc == 0) {
      result.error = "no rendezvous round at " + endpoint() + " closed within --rdzv-join-timeout " +
                     seconds(options_.rdzv_join_timeout_s) + " (the host's job may be running without this node)";
      break;
    }
    if ((fds[1].revents & POLLIN) != 0 && interrupted()) {
      result.interrupted = true;
      break;
    }
    if (fds[0].revents == 0) continue;
    const bool open = read_some(fd, buf);
    if (const auto line = take_line(buf)) {
      if (const auto a = parse_answer(*line, &result.error)) {
        result.ok = true;
        result.assignment = *a;
        member_fd_ = fd;  // kept: the host says "restart" on it
        return result;
      }
      break;
    }
    if (!open) {
      result.error = "the rendezvous host at " + endpoint() + " closed the connection (its commgrad-run ended)";
      break;
    }
  }
  close(fd);
  return result;
}

}  // namespace commgrad::run
