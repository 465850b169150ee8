#include "recompute_check.h"

#include <cstdio>
#include <cstring>
#include <string>

namespace gpt {

namespace tp = commgrad::tp;

namespace {

constexpr uint64_t kFnvOffset = 14695981039346656037ull;
constexpr uint64_t kFnvPrime = 1099511628211ull;

void fnv(uint64_t& hash, const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) hash = (hash ^ p[i]) * kFnvPrime;
}

struct Run {
  std::vector<double> losses;
  uint64_t parameters = 0;
};

Run train(const TrainerOptions& options, const GptConfig& config, const Layout& layout, const Corpus& corpus,
          int steps) {
  Trainer trainer(options, config, layout);
  Run run;
  for (int k = 0; k < steps; ++k) run.losses.push_back(trainer.step(corpus, k));
  run.parameters = parameter_digest(*trainer.model());
  return run;
}

// The losses bit for bit (as the bytes of the doubles).
bool same_losses(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

}  // namespace

uint64_t parameter_digest(const torch::nn::Module& module) {
  uint64_t hash = kFnvOffset;
  for (const auto& item : module.named_parameters()) {
    const at::Tensor t = item.value().detach().contiguous().cpu();
    fnv(hash, item.key().data(), item.key().size());
    fnv(hash, t.sizes().data(), t.sizes().size() * sizeof(int64_t));
    const auto dtype = static_cast<int>(t.scalar_type());
    fnv(hash, &dtype, sizeof dtype);
    fnv(hash, t.data_ptr(), t.numel() * t.element_size());
  }
  return hash;
}

std::string layer_recomputation(const torch::nn::Module& model) {
  std::string out;
  for (const auto& item : model.named_children()) {
    const auto* layer = dynamic_cast<const tp::ParallelTransformerLayerImpl*>(item.value().get());
    if (layer == nullptr) continue;
    if (!out.empty()) out += ", ";
    out += item.key() + " " + tp::recompute_granularity_name(layer->options.recompute());
  }
  return out;
}

bool recompute_matches(const TrainerOptions& options, const GptConfig& config, const Layout& layout,
                       const Corpus& corpus, int steps, const commgrad::Group& world) {
  using G = tp::RecomputeGranularity;
  GptConfig none_config = config;
  none_config.recompute = G::kNone;
  const Run none = train(options, none_config, layout, corpus, steps);
  bool all = true;
  for (G g : {G::kNone, G::kSelective, G::kFull}) {
    GptConfig c = config;
    c.recompute = g;
    const Run run = g == G::kNone ? none : train(options, c, layout, corpus, steps);
    const bool mine = same_losses(run.losses, none.losses) && run.parameters == none.parameters;
    // Agreed over the world: 1 when every rank matched.
    const bool every =
        commgrad::ops::raw::all_reduce(torch::full({1}, mine ? 1 : 0, torch::kInt),
                                       commgrad::ops::AllReduceOptions().op(commgrad::ReduceOp::kMin), world)
            .wait()
            .item<int>() == 1;
    all = all && every;
    if (world.rank() == 0) {
      std::string losses;
      char number[64];
      for (double l : run.losses) {
        std::snprintf(number, sizeof number, " %.9g", l);
        losses += number;
      }
      const char* verdict = g == G::kNone ? "the reference" : every ? "equal to none bit for bit" : "DIFFER from none";
      std::printf("recompute %s: losses%s, rank 0 parameters %016llx: %s\n", tp::recompute_granularity_name(g),
                  losses.c_str(), static_cast<unsigned long long>(run.parameters), verdict);
    }
  }
  std::fflush(stdout);
  return all;
}

}  // namespace gpt
