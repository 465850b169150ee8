// The parallel layout: cutting the world into tensor-, context-, data- and
// pipeline-parallel groups in Megatron's rank order, and the data x context
// groups into expert groups.
//
// Rank r has the coordinates (t, c, d, p) with r = t + tp (c + cp (d + dp p)).
// A group is the set of ranks whose coordinates differ only in the dimensions
// it spans: tensor spans t, context c, data d, data-context c and d,
// pipeline p. Expert groups cut each data-context group (its members in rank
// order) into runs of ep consecutive members (expert) and members ep apart
// (expert-data). The embedding group is the first and last rank of each
// pipeline group (the pipeline group itself when pp <= 2: no new group).
// A group that equals another (context of one rank, data-context when cp = 1,
// ...) is not created again.
//
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

#include <array>
#include <map>
#include <mutex>

namespace commgrad {

namespace detail {
struct ParallelStateData {
  Group world;
  Group tensor;
  Group pipeline;
  Group data;
  Group context;
  Group data_context;
  Group expert;
  Group expert_data;
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

// The coordinates of a layout, tp fastest: t, c, d, p.
struct Coordinates {
  std::array<int, 4> sizes;

  std::array<int, 4> of(int rank) const {
    std::array<int, 4> x{};
    for (size_t i = 0; i < x.size(); ++i) {
      x[i] = rank % sizes[i];
      rank /= sizes[i];
    }
    return x;
  }

  // The groups that span the dimensions marked in `spans` (each group's
  // ranks ascending; groups in the order of their first rank).
  std::vector<std::vector<int>> groups(std::array<bool, 4> spans) const {
    std::map<std::array<int, 4>, size_t> index;
    std::vector<std::vector<int>> out;
    const int n = sizes[0] * sizes[1] * sizes[2] * sizes[3];
    for (int r = 0; r < n; ++r) {
      auto key = of(r);
      for (size_t i = 0; i < key.size(); ++i) {
        if (spans[i]) key[i] = 0;
      }
      auto [it, inserted] = index.emplace(key, out.size());
      if (inserted) out.emplace_back();
      out[it->second].push_back(r);
    }
    return out;
  }
};

// Expert groups: each data-context group cut into runs of `ep` consecutive
// members (expert = true) or into members `ep` apart (expert = false).
std::vector<std::vector<int>> expert_groups(const std::vector<std::vector<int>>& data_context, int ep, bool expert) {
  std::vector<std::vector<int>> out;
  for (const auto& members : data_context) {
    const int n = static_cast<int>(members.size());
    const int count = expert ? n / ep : ep;
    for (int k = 0; k < count; ++k) {
      out.emplace_back();
      if (expert) {
        for (int i = k * ep; i < (k + 1) * ep; ++i) out.back().push_back(members[i]);
      } else {
        for (int i = k; i < n; i += ep) out.back().push_back(members[i]);
      }
    }
  }
  return out;
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
const Group& ParallelState::context_parallel_group() const { return checked().context; }
const Group& ParallelState::data_context_parallel_group() const { return checked().data_context; }
const Group& ParallelState::expert_parallel_group() const { return checked().expert; }
const Group& ParallelState::expert_data_parallel_group() const { return checked().expert_data; }
const Group& ParallelState::embedding_group() const { return checked().embedding; }

std::string ParallelState::describe() const {
  if (!data_) return "(no parallel state)";
  auto part = [](const char* name, const Group& g) {
    return c10::str(name, " ", g.rank(), "/", g.size(), " (", g.backend_name(), ")");
  };
  std::string extra;
  if (context_parallel_size() > 1) extra += c10::str(" ", part("cp", context_parallel_group()));
  if (expert_parallel_size() > 1) extra += c10::str(" ", part("ep", expert_parallel_group()));
  return c10::str(part("tp", tensor_parallel_group()), " ", part("pp", pipeline_parallel_group()), " ",
                  part("dp", data_parallel_group()), extra, " (world ", data_->world.size(), ", ",
                  data_->world.backend_name(), ")");
}

ParallelState make_model_parallel(const ModelParallelOptions& options, const Group& world_group) {
  const Group w = world_group.defined() ? world_group : commgrad::world();
  check_member("make_model_parallel", w);
  COMMGRAD_CHECK(w == commgrad::world(), "make_model_parallel", w,
                 "groups can only be cut from this thread's world group (new_group works on commgrad::world())");
  const int n = w.size();
  const int tp = options.tensor_parallel_size(), cp = options.context_parallel_size();
  const int pp = options.pipeline_parallel_size(), ep = options.expert_parallel_size();
  COMMGRAD_CHECK(tp >= 1 && cp >= 1 && pp >= 1 && ep >= 1, "make_model_parallel", w, "tensor_parallel_size (", tp,
                 "), context_parallel_size (", cp, "), pipeline_parallel_size (", pp, ") and expert_parallel_size (",
                 ep, ") must be at least 1");
  COMMGRAD_CHECK(n % (tp * cp * pp) == 0, "make_model_parallel", w, "world size ", n,
                 " is not divisible by tensor_parallel_size (", tp, ") x context_parallel_size (", cp,
                 ") x pipeline_parallel_size (", pp, ") = ", tp * cp * pp);
  const int dp = n / (tp * cp * pp);
  COMMGRAD_CHECK((dp * cp) % ep == 0, "make_model_parallel", w, "expert_parallel_size (", ep,
                 ") does not divide data_parallel_size (", dp, ") x context_parallel_size (", cp, ") = ", dp * cp);
  const int me = w.rank();
  const Coordinates at{{tp, cp, dp, pp}};
  const auto pipeline = at.groups({false, false, false, true});
  const auto data_context = at.groups({false, true, true, false});

  auto data_ptr = std::make_shared<detail::ParallelStateData>();
  auto& s = *data_ptr;
  s.world = w;
  s.tensor = make_groups(at.groups({true, false, false, false}), "tp", me);
  s.pipeline = make_groups(pipeline, "pp", me);
  s.data = make_groups(at.groups({false, false, true, false}), "dp", me);
  s.context = cp == 1 ? self_group() : make_groups(at.groups({false, true, false, false}), "cp", me);
  s.data_context = cp == 1 ? s.data : make_groups(data_context, "dpcp", me);
  s.expert = ep == 1 ? self_group() : make_groups(expert_groups(data_context, ep, true), "ep", me);
  s.expert_data = ep == 1 ? s.data_context : make_groups(expert_groups(data_context, ep, false), "edp", me);
  if (pp <= 2) {
    s.embedding = s.pipeline;  // the first and last stage are the whole pipeline
  } else {
    std::vector<std::vector<int>> embedding;
    for (const auto& ranks : pipeline) embedding.push_back({ranks.front(), ranks.back()});
    s.embedding = make_groups(embedding, "emb", me, /*every_rank=*/false);
  }
  return ParallelState(std::move(data_ptr));
}

ParallelState make_model_parallel(int tp, int pp, const Group& world_group) {
  return make_model_parallel(ModelParallelOptions(tp, pp), world_group);
}

ParallelState initialize_model_parallel(int tp, int pp) {
  return initialize_model_parallel(ModelParallelOptions(tp, pp));
}

ParallelState initialize_model_parallel(const ModelParallelOptions& options) {
  const Group w = commgrad::world();
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    COMMGRAD_CHECK(g_installed.count(w.state().get()) == 0, "initialize_model_parallel", w,
                   "model parallelism is already initialised for this world (", g_installed[w.state().get()].describe(),
                   "); call destroy_model_parallel() first");
  }
  ParallelState state = make_model_parallel(options, w);
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
Group context_parallel_group() { return parallel_state().context_parallel_group(); }
Group data_context_parallel_group() { return parallel_state().data_context_parallel_group(); }
Group expert_parallel_group() { return parallel_state().expert_parallel_group(); }
Group expert_data_parallel_group() { return parallel_state().expert_data_parallel_group(); }

Group default_data_parallel_group() {
  const ParallelState s = current_or_empty();
  return s.defined() ? s.data_context_parallel_group() : commgrad::world();
}

Group default_expert_data_parallel_group() {
  const ParallelState s = current_or_empty();
  return s.defined() ? s.expert_data_parallel_group() : default_data_parallel_group();
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
