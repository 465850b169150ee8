// A small commgrad program for the multi-process shm tests, started by
// commgrad-run:
//
//   shm_job ops [backend]  every rank checks a few collectives and point-to-point
//                          messages on the world group (backend: "shm", "auto", ...)
//                          and prints "rank r ok (<backend>)"
//   shm_job kill [ops]     rank 1 is SIGKILLed in the middle of a stream of
//                          4 MiB all-reduces (transport calls, or ops::all_reduce
//                          with "ops"); the other ranks print the error they get
//                          and exit with 3 (they ignore SIGTERM, so the launcher's
//                          teardown cannot hide whether they noticed); rank 0
//                          prints "single copy on|off" (whether they read their
//                          peers' tensors directly)
//   shm_job single-copy [unreadable]
//                          all-reduces of 1-5 MiB, in place and out of place;
//                          every rank prints "rank r single copy on|off" and
//                          "rank r ok". With "unreadable" no rank may read rank
//                          1 (it is not dumpable, and every rank drops
//                          CAP_SYS_PTRACE), so the group must stage instead
//   shm_job mismatch       rank 1 sets another COMMGRAD_SHM_CHUNK_BYTES: every rank
//                          prints the error it gets ("rank r setup failed: ...")
//                          and exits 3
//   shm_job die            rank 1 SIGKILLs itself once rank 0's segment shows in
//                          /dev/shm (named after TORCHELASTIC_RUN_ID), while the
//                          group is being set up
//
// Rank 0 prints "segment <name>" for the shm backend, so that the test can
// check that /dev/shm holds nothing of the job afterwards.

#include <commgrad/backend.h>
#include <commgrad/dist/process_group.h>
#include <commgrad/ops/collectives.h>

#include <ATen/ATen.h>

#include <dirent.h>
#include <linux/capability.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::cerr << "rank " << commgrad::rank() << ": " << what << " is wrong\n";
    ++failures;
  }
}

void print_segment(const commgrad::Group& world) {
  if (world.rank() != 0) return;
  if (auto* shm = dynamic_cast<commgrad::backend::ShmProcessGroup*>(&world.transport())) {
    std::cout << "segment " << shm->segment_name() << std::endl;
  }
}

const char* single_copy_state(const commgrad::Group& world, int64_t bytes) {
  auto* shm = dynamic_cast<commgrad::backend::ShmProcessGroup*>(&world.transport());
  return shm != nullptr && shm->uses_single_copy(bytes) ? "on" : "off";
}

const char* direct_pieces_state(const commgrad::Group& world, int64_t bytes) {
  auto* shm = dynamic_cast<commgrad::backend::ShmProcessGroup*>(&world.transport());
  return shm != nullptr && shm->reads_pieces_directly(bytes) ? "on" : "off";
}

// Rank x sends (x + q) % 3 * 40000 + 1 floats to rank q: pieces from 4 bytes
// (staged) to 320 KiB (read directly), each value naming sender and receiver.
void check_alltoall_pieces(commgrad::detail::TransportBase& pg, int r, int n) {
  auto count = [](int x, int q) { return static_cast<int64_t>((x + q) % 3) * 40000 + 1; };
  auto piece = [&](int x, int q) { return at::arange(count(x, q), at::kFloat) + 1000 * x + q; };
  std::vector<at::Tensor> sends, expected;
  std::vector<int64_t> in_splits, out_splits;
  for (int q = 0; q < n; ++q) {
    sends.push_back(piece(r, q));
    expected.push_back(piece(q, r));
    in_splits.push_back(count(r, q));
    out_splits.push_back(count(q, r));
  }
  at::Tensor in = at::cat(sends);
  at::Tensor out = at::empty({at::cat(expected).numel()});
  pg.alltoall_base(out, in, out_splits, in_splits)->wait();
  check(at::equal(out, at::cat(expected)), "uneven alltoall_base");
  // In place, equal splits of 200000 floats per pair.
  at::Tensor both = at::arange(200000 * n, at::kFloat) + 1e6 * r;
  std::vector<int64_t> none;
  pg.alltoall_base(both, both, none, none)->wait();
  for (int q = 0; q < n; ++q) {
    check(at::equal(both.narrow(0, q * 200000, 200000), at::arange(200000, at::kFloat) + 200000 * r + 1e6 * q),
          "in-place alltoall_base");
  }
}

// This process may no longer read others regardless of their owner
// (process_vm_readv of a process that is not dumpable needs CAP_SYS_PTRACE).
bool drop_ptrace_capability() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2] = {};
  if (syscall(SYS_capget, &header, data) != 0) return false;
  data[CAP_TO_INDEX(CAP_SYS_PTRACE)].effective &= ~CAP_TO_MASK(CAP_SYS_PTRACE);
  return syscall(SYS_capset, &header, data) == 0;
}

int run_single_copy(bool unreadable) {
  if (unreadable) {
    if (!drop_ptrace_capability()) std::cerr << "capset failed" << std::endl;
    const char* rank = std::getenv("RANK");
    if (rank != nullptr && std::string(rank) == "1") prctl(PR_SET_DUMPABLE, 0);
  }
  commgrad::Group world = commgrad::init_process_group(commgrad::InitOptions().backend("shm"));
  auto& pg = world.transport();
  const int n = world.size();
  const int r = world.rank();
  std::cout << "rank " << r << " single copy " << single_copy_state(world, 4 << 20) << ", direct pieces "
            << direct_pieces_state(world, 1 << 20) << std::endl;
  // Small integers: every order of the sum is exact, so equal means right.
  for (int64_t numel : {(int64_t{1} << 18) + 5, int64_t{3} << 18, (int64_t{5} << 18) - 3}) {
    const at::Tensor input = at::arange(numel, at::kFloat).remainder(7) + r;
    const at::Tensor expected = at::arange(numel, at::kFloat).remainder(7) * n + n * (n - 1) / 2.0f;
    std::vector<at::Tensor> t{input.clone()};
    pg.allreduce(t)->wait();
    check(at::equal(t[0], expected), "allreduce of " + std::to_string(numel));
    auto* shm = dynamic_cast<commgrad::backend::ShmProcessGroup*>(&pg);
    at::Tensor out = at::empty_like(input);
    shm->allreduce_out(input, out)->wait();
    check(at::equal(out, expected), "out-of-place allreduce of " + std::to_string(numel));
  }
  check_alltoall_pieces(pg, r, n);
  pg.barrier()->wait();
  std::cout << "rank " << r << " ok" << std::endl;
  commgrad::destroy_process_group();
  return failures == 0 ? 0 : 1;
}

int run_ops(const std::string& backend) {
  commgrad::Group world = commgrad::init_process_group(commgrad::InitOptions().backend(backend));
  print_segment(world);
  auto& pg = world.transport();
  const int n = world.size();
  const int r = world.rank();
  for (int64_t numel : {1, 1000, 300000}) {
    std::vector<at::Tensor> t{at::full({numel}, static_cast<float>(r + 1))};
    pg.allreduce(t)->wait();
    check(at::equal(t[0], at::full({numel}, n * (n + 1) / 2.0f)), "allreduce of " + std::to_string(numel));
    std::vector<at::Tensor> b{at::full({numel}, static_cast<double>(r))};
    c10d::BroadcastOptions o;
    o.rootRank = n - 1;
    pg.broadcast(b, o)->wait();
    check(at::equal(b[0], at::full({numel}, static_cast<double>(n - 1), at::kDouble)), "broadcast");
    at::Tensor in = at::full({numel}, static_cast<float>(r));
    at::Tensor out = at::empty({numel * n});
    pg._allgather_base(out, in)->wait();
    for (int q = 0; q < n; ++q)
      check(at::equal(out.narrow(0, q * numel, numel), at::full({numel}, float(q))), "allgather");
  }
  if (n > 1) {
    std::vector<at::Tensor> send{at::arange(5000, at::kLong) + r};
    std::vector<at::Tensor> recv{at::empty({5000}, at::kLong)};
    auto w = pg.recv(recv, (r + n - 1) % n, 3);
    pg.send(send, (r + 1) % n, 3)->wait();
    w->wait();
    check(at::equal(recv[0], at::arange(5000, at::kLong) + (r + n - 1) % n), "send/recv");
  }
  pg.barrier()->wait();
  std::cout << "rank " << r << " ok (" << world.backend_name() << ")" << std::endl;
  commgrad::destroy_process_group();
  return failures == 0 ? 0 : 1;
}

int run_kill(bool via_ops) {
  signal(SIGTERM, SIG_IGN);
  commgrad::Group world = commgrad::init_process_group(commgrad::InitOptions().backend("shm"));
  print_segment(world);
  if (world.rank() == 0) std::cout << "single copy " << single_copy_state(world, 4 << 20) << std::endl;
  auto& pg = world.transport();
  if (world.rank() == 1) {
    std::thread([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      kill(getpid(), SIGKILL);
    }).detach();
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    std::vector<at::Tensor> t{at::ones({1 << 20})};
    for (int i = 0; std::chrono::steady_clock::now() - start < std::chrono::seconds(60); ++i) {
      if (via_ops) {
        commgrad::ops::all_reduce(t[0]);
      } else {
        pg.allreduce(t)->wait();
      }
    }
  } catch (const std::exception& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::string message = e.what();
    message = message.substr(0, message.find('\n'));
    std::cerr << "rank " << world.rank() << " failed after " << s << "s: " << message << std::endl;
    _exit(3);
  }
  std::cerr << "rank " << world.rank() << ": no error within 60 s" << std::endl;
  return 1;
}

int run_setup_failure(bool die) {
  const char* rank = std::getenv("RANK");
  const bool rank1 = rank != nullptr && std::string(rank) == "1";
  if (rank1 && !die) setenv("COMMGRAD_SHM_CHUNK_BYTES", "8192", 1);
  if (rank1 && die) {
    const std::string prefix = std::string("commgrad-shm-") + std::getenv("TORCHELASTIC_RUN_ID") + "-";
    std::thread([prefix] {
      for (;;) {
        if (DIR* dir = opendir("/dev/shm")) {
          while (const dirent* e = readdir(dir)) {
            if (std::string(e->d_name).rfind(prefix, 0) == 0) kill(getpid(), SIGKILL);
          }
          closedir(dir);
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }).detach();
  }
  try {
    commgrad::init_process_group(commgrad::InitOptions().backend("shm"));
  } catch (const std::exception& e) {
    std::string message = e.what();
    std::cerr << "rank " << (rank ? rank : "?") << " setup failed: " << message.substr(0, message.find('\n'))
              << std::endl;
    _exit(3);
  }
  std::cerr << "rank " << (rank ? rank : "?") << ": the group was set up" << std::endl;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "ops";
  try {
    if (mode == "ops") return run_ops(argc > 2 ? argv[2] : "shm");
    if (mode == "single-copy") return run_single_copy(argc > 2 && std::string(argv[2]) == "unreadable");
    if (mode == "kill") return run_kill(argc > 2 && std::string(argv[2]) == "ops");
    if (mode == "mismatch" || mode == "die") return run_setup_failure(mode == "die");
  } catch (const std::exception& e) {
    std::cerr << "shm_job: " << e.what() << std::endl;
    return 1;
  }
  std::cerr << "usage: shm_job ops [backend] | shm_job kill [ops] | shm_job mismatch | shm_job die\n";
  return 2;
}
