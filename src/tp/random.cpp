// Tensor-parallel-aware random streams.
//
// Megatron keeps one CUDA generator per device and, to "fork" into the
// tensor-parallel stream, swaps that generator's state with a tracked one and
// swaps it back afterwards. commgrad cannot do that with LibTorch's global
// CPU generator: programs and tests may run one rank per thread, and those
// threads share the global generator, so a swap on one rank would change the
// numbers another rank draws. Instead a tracker owns its generators outright
// (one default, replicated stream plus named ones), and "forking" only
// changes which of them the calling thread's tracker-aware ops use: a
// thread-local stack of (tracker, generator) pairs. Nothing global is
// mutated, so ranks-as-threads stay independent and reproducible.
//
// Seeding follows Megatron: default stream = seed on every TP rank (so
// replicated activations get identical masks); kModelParallelRng =
// seed + 2718 + tp_rank (so split activations get a different mask on each
// rank). Both are functions of the one seed, so a run can be replayed.
//
// Initialisation seeds: a layer built without .seed() draws one 64-bit
// number from LibTorch's default CPU generator, so torch::manual_seed()
// governs it as it governs torch::nn::Linear. Each rank of the layer's TP
// group draws (a rank that skipped the draw would be one number behind the
// others for everything it draws afterwards), and group rank 0's number is
// broadcast: ranks whose generators drifted (a rank that drew other numbers
// before, or ranks that are threads sharing one generator) still build
// shards of one full layer. Cost: one 8-byte broadcast per layer built
// without a seed; nothing with an explicit seed or in a group of one.
//
// dropout() draws its Bernoulli mask into a fresh contiguous tensor of x's
// shape with the current generator, then multiplies. The mask therefore
// depends only on the shape and the generator's state, never on x's strides,
// and autograd sees a multiplication by a constant.

#include "commgrad/tp/random.h"

#include "commgrad/dist/check.h"
#include "commgrad/ops/raw.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>
#include <utility>

namespace commgrad::tp {
namespace detail {

struct RngTrackerState {
  mutable std::mutex mutex;
  at::Generator default_generator;
  std::map<std::string, at::Generator> streams;
  std::map<std::string, uint64_t> seeds;
};

}  // namespace detail

namespace {

using StatePtr = std::shared_ptr<detail::RngTrackerState>;

// This thread's active forks, innermost last.
thread_local std::vector<std::pair<const detail::RngTrackerState*, at::Generator>> t_forks;
// This thread's ScopedRngTracker, if any.
thread_local std::shared_ptr<RngTracker> t_tracker;

RngTracker& process_tracker() {
  static RngTracker tracker;
  return tracker;
}

at::Generator make_cpu_generator(uint64_t seed) { return at::detail::createCPUGenerator(seed); }

}  // namespace

// ~~~ RngTracker ~~~

RngTracker::RngTracker() : state_(std::make_shared<detail::RngTrackerState>()) {
  state_->default_generator = make_cpu_generator(c10::default_rng_seed_val);
}

void RngTracker::reset() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->streams.clear();
  state_->seeds.clear();
  state_->default_generator = make_cpu_generator(c10::default_rng_seed_val);
}

void RngTracker::manual_seed(uint64_t seed) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->default_generator = make_cpu_generator(seed);
}

void RngTracker::add(const std::string& name, uint64_t seed) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  TORCH_CHECK(!name.empty() && name != kDefaultRng, "[commgrad] RngTracker::add: invalid stream name '", name,
              "' (empty and '", kDefaultRng, "' are reserved)");
  TORCH_CHECK(state_->streams.count(name) == 0, "[commgrad] RngTracker::add: stream '", name,
              "' already exists; call reset() first to reseed");
  for (const auto& [other, other_seed] : state_->seeds) {
    TORCH_CHECK(other_seed != seed, "[commgrad] RngTracker::add: seed ", seed, " of stream '", name,
                "' is already used by stream '", other, "'");
  }
  state_->streams.emplace(name, make_cpu_generator(seed));
  state_->seeds.emplace(name, seed);
}

bool RngTracker::has(const std::string& name) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->streams.count(name) != 0;
}

std::vector<std::string> RngTracker::names() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  std::vector<std::string> result;
  for (const auto& entry : state_->streams) result.push_back(entry.first);
  return result;
}

at::Generator RngTracker::default_generator() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->default_generator;
}

at::Generator RngTracker::generator(const std::string& name) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  auto it = state_->streams.find(name);
  if (it == state_->streams.end()) {
    std::string known;
    for (const auto& entry : state_->streams) known += (known.empty() ? "" : ", ") + entry.first;
    TORCH_CHECK(false, "[commgrad] RngTracker::generator: stream '", name,
                "' was not added (known: ", known.empty() ? std::string("none") : known,
                "); call tp::model_parallel_manual_seed() or RngTracker::add() first");
  }
  return it->second;
}

at::Generator RngTracker::current_generator() const {
  for (auto it = t_forks.rbegin(); it != t_forks.rend(); ++it) {
    if (it->first == state_.get()) return it->second;
  }
  return default_generator();
}

RngFork RngTracker::fork(const std::string& name) const { return RngFork(state_, generator(name)); }

RngStates RngTracker::get_states() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  RngStates states;
  states.emplace(kDefaultRng, state_->default_generator.get_state());
  for (const auto& [name, generator] : state_->streams) states.emplace(name, generator.get_state());
  return states;
}

void RngTracker::set_states(const RngStates& states) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  // Validate every name before touching any state.
  for (const auto& entry : states) {
    TORCH_CHECK(entry.first == kDefaultRng || state_->streams.count(entry.first) != 0,
                "[commgrad] RngTracker::set_states: stream '", entry.first, "' was not added");
  }
  for (const auto& [name, state] : states) {
    at::Generator& generator = name == kDefaultRng ? state_->default_generator : state_->streams.at(name);
    std::lock_guard<std::mutex> generator_lock(generator.mutex());
    generator.set_state(state);
  }
}

// ~~~ RngFork ~~~

RngFork::RngFork(std::shared_ptr<detail::RngTrackerState> state, at::Generator generator) : state_(std::move(state)) {
  t_forks.emplace_back(state_.get(), std::move(generator));
}

RngFork::RngFork(RngFork&& other) noexcept : state_(std::move(other.state_)) { other.state_ = nullptr; }

RngFork::~RngFork() {
  if (!state_) return;
  // Guards are scoped, so ours is the innermost entry; tolerate misuse by
  // removing the innermost entry of this tracker instead of corrupting others.
  for (auto it = t_forks.rbegin(); it != t_forks.rend(); ++it) {
    if (it->first == state_.get()) {
      t_forks.erase(std::next(it).base());
      break;
    }
  }
}

// ~~~ thread / process tracker ~~~

RngTracker rng_tracker() { return t_tracker ? *t_tracker : process_tracker(); }

ScopedRngTracker::ScopedRngTracker(RngTracker tracker)
    : previous_(std::exchange(t_tracker, std::make_shared<RngTracker>(std::move(tracker)))) {}

ScopedRngTracker::~ScopedRngTracker() { t_tracker = std::move(previous_); }

void model_parallel_manual_seed(uint64_t seed, const Group& tp_group, RngTracker tracker) {
  check_member("model_parallel_manual_seed", tp_group);
  tracker.reset();
  tracker.manual_seed(seed);
  tracker.add(kModelParallelRng, seed + kTensorParallelSeedOffset + static_cast<uint64_t>(tp_group.rank()));
}

// ~~~ initialisation seeds ~~~

uint64_t draw_seed() {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get<at::CPUGeneratorImpl>()->random64();
}

uint64_t resolve_seed(const std::optional<uint64_t>& seed, const Group& group) {
  if (seed) return *seed;
  check_member("resolve_seed", group);
  const uint64_t mine = draw_seed();  // every rank draws: the generators advance alike
  if (group.size() == 1) return mine;
  const at::Tensor value = at::full({1}, static_cast<int64_t>(mine), at::kLong);
  const at::Tensor chosen = ops::raw::broadcast(value, ops::BroadcastOptions().src(0), group).wait();
  return static_cast<uint64_t>(chosen.item<int64_t>());
}

// ~~~ dropout ~~~

at::Tensor dropout(const at::Tensor& x, double p, bool training, const RngTracker& tracker) {
  TORCH_CHECK(p >= 0.0 && p <= 1.0, "[commgrad] tp::dropout: probability must be in [0, 1], got ", p);
  TORCH_CHECK(x.is_floating_point(), "[commgrad] tp::dropout: expected a floating-point tensor, got ", tensor_name(x));
  if (!training || p == 0.0) return x;
  if (p == 1.0) return x * 0;
  at::Generator generator = tracker.current_generator();
  at::Tensor mask = at::empty(x.sizes(), x.options().requires_grad(false));
  mask.bernoulli_(1.0 - p, generator);
  mask.div_(1.0 - p);
  return x * mask;
}

}  // namespace commgrad::tp
