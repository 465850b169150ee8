// A small commgrad program for the multi-host tests, started by commgrad-run
// on every host with -n 2: it cuts three groups out of the world and prints,
// on every rank, which transport each got and whether an all_reduce over it
// gave the closed-form sum:
//
//   rank 2 host shm, local shm, across gloo ok   (across: local rank 0 only)
//
//   - host: the two ranks of this host, with the default backend (decided for the group: shm);
//   - local: the same two ranks with backend "auto" (one host: shm);
//   - across: local rank 0 of every host (ranks 0, 2, 4, ...), "auto" (gloo).
// Exits 1 when a sum is wrong.

#include <commgrad/dist/process_group.h>
#include <commgrad/ops/collectives.h>

#include <ATen/ATen.h>

#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

// all_reduce of (rank + 1) over `ranks` (global ranks): sum of (r + 1).
bool sums_right(const commgrad::Group& g, const std::vector<int>& ranks) {
  if (!g.is_member()) return true;
  auto y = commgrad::ops::all_reduce(at::full({5}, static_cast<float>(commgrad::rank() + 1)), {}, g);
  float want = 0;
  for (int r : ranks) want += static_cast<float>(r + 1);
  return at::equal(y, at::full({5}, want));
}

}  // namespace

int main() {
  try {
    commgrad::init_process_group();
    const int n = commgrad::world_size();
    const int per_host = commgrad::local_world_size();
    const int me = commgrad::rank();
    const int first = me - commgrad::local_rank();
    std::vector<int> mine;
    for (int r = first; r < first + per_host; ++r) mine.push_back(r);
    std::vector<int> leaders;
    for (int r = 0; r < n; r += per_host) leaders.push_back(r);

    // Every rank makes every group, in the same order (as c10d requires).
    std::vector<commgrad::Group> host, local;
    for (int h = 0; h < n / per_host; ++h) {
      std::vector<int> ranks;
      for (int r = h * per_host; r < (h + 1) * per_host; ++r) ranks.push_back(r);
      host.push_back(commgrad::new_group(ranks, commgrad::NewGroupOptions().name("host" + std::to_string(h))));
      local.push_back(
          commgrad::new_group(ranks, commgrad::NewGroupOptions().name("local" + std::to_string(h)).backend("auto")));
    }
    auto across = commgrad::new_group(leaders, commgrad::NewGroupOptions().name("across").backend("auto"));
    const int h = me / per_host;

    bool ok = sums_right(host[h], mine) && sums_right(local[h], mine) && sums_right(across, leaders);
    std::ostringstream line;
    line << "rank " << me << " host " << host[h].backend_name() << ", local " << local[h].backend_name();
    if (across.is_member()) line << ", across " << across.backend_name();
    line << (ok ? " ok" : " WRONG");
    std::cout << line.str() << std::endl;
    commgrad::destroy_process_group();
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "multihost_job: " << e.what() << "\n";
    return 1;
  }
}
