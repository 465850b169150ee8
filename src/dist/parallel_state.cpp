// The parallel layout: cutting the world into tensor-, pipeline- and
// data-parallel groups in Megatron's rank order.
//
// With W ranks, tensor size t and pipeline size p (d = W / (t p)):
//   tensor group k   = [k t, k t + 1, ..., k t + t - 1]           k < W / t
//   pipeline group k = [k, k + W/p, k + 2 W/p, ...]               k < W / p
//   data group (i, j) = [i W/p + j, i W/p + j + t, ...] < (i+1) W/p
//                                                     i < p, j < t
//   embedding group k = the first and last rank of pipeline group k (the
//                       pipeline group itself when p <= 2: no new group)
// Every rank creates every group, in this order (new_group is collective over
// the world, and each call must be made by all ranks in the same order), and
// keeps those it belongs to.
//
// Installed states are kept per world group (the process's world, or each
// thread's ScopedWorld in one-rank-per-thread programs), so threads that each
// run a rank do not overwrite each other's state; a ScopedParallelState
// overrides that for its thread.

#include "commgrad/dist/parallel_state.h"

#include "commgrad/dist/check.h"
#include "commgrad/dist/process_group.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <map>
#include <mutex>

namespace commgrad {

namespace detail {
struct ParallelStateData {
  Group world;
  Group tensor;
  Group pipeline;
  Group data;
  Group embedding;  // undefined on the middle stages of a pipeline
};
}  // namespace detail

namespace {

std::mutex g_mutex;
// Installed states by world group.
std::map<const detail::GroupState*, ParallelState> g_installed;
thread_local ParallelState t_scoped;

// Creates the groups of `layout` (a list of rank lists) and returns the one
// this rank belongs to.
Group make_groups(const std::vector<std::vector<int>>& layout, const char* prefix, int my_rank,
                  bool every_rank = true) {
  Group mine;
  for (size_t k = 0; k < layout.size(); ++k) {
    Group g = new_group(layout[k], NewGroupOptions().name(c10::str(prefix, k)));
    for (int r : layout[k]) {
      if (r == my_rank) mine = g;
    }
  }
  TORCH_INTERNAL_ASSERT(!every_rank || (mine.defined() && mine.is_member()), "rank ", my_rank, " is in no ", prefix,
                        " group");
  return mine;
}

}  // namespace

const detail::ParallelStateData& ParallelState::checked() const {
  TORCH_CHECK(data_ != nullptr,
              "[commgrad] ParallelState: use of an empty ParallelState; build one with "
              "make_model_parallel() or initialize_model_parallel()");
  return *data_;
}

const Group& ParallelState::world() const { return checked().world; }
const Group& ParallelState::tensor_parallel_group() const { return checked().tensor; }
const Group& ParallelState::pipeline_parallel_group() const { return checked().pipeline; }
const Group& ParallelState::data_parallel_group() const { return checked().data; }
const Group& ParallelState::embedding_group() const { return checked().embedding; }

std::string ParallelState::describe() const {
  if (!data_) return "(no parallel state)";
  auto part = [](const char* name, const Group& g) {
    return c10::str(name, " ", g.rank(), "/", g.size(), " (", g.backend_name(), ")");
  };
  return c10::str(part("tp", tensor_parallel_group()), " ", part("pp", pipeline_parallel_group()), " ",
                  part("dp", data_parallel_group()), " (world ", data_->world.size(), ", ",
                  data_->world.backend_name(), ")");
}

ParallelState make_model_parallel(int tp, int pp, const Group& world_group) {
  const Group w = world_group.defined() ? world_group : commgrad::world();
  check_member("make_model_parallel", w);
  COMMGRAD_CHECK(w == commgrad::world(), "make_model_parallel", w,
                 "groups can only be cut from this thread's world group (new_group works on commgrad::world())");
  const int n = w.size();
  COMMGRAD_CHECK(tp >= 1 && pp >= 1, "make_model_parallel", w, "tensor_parallel_size (", tp,
                 ") and pipeline_parallel_size (", pp, ") must be at least 1");
  COMMGRAD_CHECK(n % (tp * pp) == 0, "make_model_parallel", w, "world size ", n,
                 " is not divisible by tensor_parallel_size (", tp, ") x pipeline_parallel_size (", pp, ") = ",
                 tp * pp);
  const int me = w.rank();
  const int stage = n / pp;  // ranks per pipeline stage

  std::vector<std::vector<int>> tensor, pipeline, data;
  for (int k = 0; k < n / tp; ++k) {
    tensor.emplace_back();
    for (int r = k * tp; r < (k + 1) * tp; ++r) tensor.back().push_back(r);
  }
  for (int k = 0; k < stage; ++k) {
    pipeline.emplace_back();
    for (int r = k; r < n; r += stage) pipeline.back().push_back(r);
  }
  for (int i = 0; i < pp; ++i) {
    for (int j = 0; j < tp; ++j) {
      data.emplace_back();
      for (int r = i * stage + j; r < (i + 1) * stage; r += tp) data.back().push_back(r);
    }
  }

  auto data_ptr = std::make_shared<detail::ParallelStateData>();
  data_ptr->world = w;
  data_ptr->tensor = make_groups(tensor, "tp", me);
  data_ptr->pipeline = make_groups(pipeline, "pp", me);
  data_ptr->data = make_groups(data, "dp", me);
  if (pp <= 2) {
    data_ptr->embedding = data_ptr->pipeline;  // the first and last stage are the whole pipeline
  } else {
    std::vector<std::vector<int>> embedding;
    for (const auto& ranks : pipeline) embedding.push_back({ranks.front(), ranks.back()});
    data_ptr->embedding = make_groups(embedding, "emb", me, /*every_rank=*/false);
  }
  return ParallelState(std::move(data_ptr));
}

ParallelState initialize_model_parallel(int tp, int pp) {
  const Group w = commgrad::world();
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    COMMGRAD_CHECK(g_installed.count(w.state().get()) == 0, "initialize_model_parallel", w,
                   "model parallelism is already initialised for this world (", g_installed[w.state().get()].describe(),
                   "); call destroy_model_parallel() first");
  }
  ParallelState state = make_model_parallel(tp, pp, w);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_installed[w.state().get()] = state;
  return state;
}

void destroy_model_parallel() {
  if (!is_initialized()) return;
  const Group w = commgrad::world();
  std::lock_guard<std::mutex> lock(g_mutex);
  g_installed.erase(w.state().get());
}

namespace {
ParallelState current_or_empty() {
  if (t_scoped.defined()) return t_scoped;
  if (!is_initialized()) return {};
  const Group w = commgrad::world();
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_installed.find(w.state().get());
  return it == g_installed.end() ? ParallelState() : it->second;
}
}  // namespace

bool model_parallel_is_initialized() { return current_or_empty().defined(); }

ParallelState parallel_state() {
  ParallelState s = current_or_empty();
  TORCH_CHECK(s.defined(),
              "[commgrad] parallel_state: model parallelism is not initialised: call "
              "initialize_model_parallel(tp_size) (or install a state with ScopedParallelState), or pass the "
              "group explicitly");
  return s;
}

Group tensor_parallel_group() { return parallel_state().tensor_parallel_group(); }
int tensor_parallel_rank() { return parallel_state().tensor_parallel_rank(); }
int tensor_parallel_size() { return parallel_state().tensor_parallel_size(); }
Group pipeline_parallel_group() { return parallel_state().pipeline_parallel_group(); }
Group data_parallel_group() { return parallel_state().data_parallel_group(); }
int data_parallel_rank() { return parallel_state().data_parallel_rank(); }
int data_parallel_size() { return parallel_state().data_parallel_size(); }

Group default_data_parallel_group() {
  const ParallelState s = current_or_empty();
  return s.defined() ? s.data_parallel_group() : commgrad::world();
}

Group default_tensor_parallel_group() {
  const ParallelState s = current_or_empty();
  return s.defined() && s.tensor_parallel_size() > 1 ? s.tensor_parallel_group() : Group();
}

Group default_pipeline_parallel_group() {
  const ParallelState s = current_or_empty();
  return s.defined() && s.pipeline_parallel_size() > 1 ? s.pipeline_parallel_group() : Group();
}

Group self_group() {
  // One per thread, created on first use: a Gloo group of one over a private
  // in-memory store. Collectives on it short-circuit after their checks.
  thread_local Group group;
  if (!group.defined()) {
    group = make_world_group(InitOptions()
                                 .store(c10::make_intrusive<c10d::HashStore>())
                                 .rank(0)
                                 .world_size(1)
                                 .backend("gloo")
                                 .intra_op_threads(0));
    group.state()->name = "single";
  }
  return group;
}

ScopedParallelState::ScopedParallelState(ParallelState state) : previous_(t_scoped) { t_scoped = std::move(state); }
ScopedParallelState::~ScopedParallelState() { t_scoped = previous_; }

}  // namespace commgrad
