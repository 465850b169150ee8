// GPT training throughput per layout, and the pipeline bubble measured
// against its closed form.
//
// Trains the GPT of examples/gpt (gpt::Trainer: the model, ZeRO-2 AdamW
// with clipping, pp::Pipeline) at a benchmark size on the synthetic corpus,
// for each layout given (or a default list fitting the world size), and
// prints one row per layout:
//
//   tokens/s      global batch x sequence / p50 of the step time (the
//                 slowest rank's wall time of a whole step: zero_grad,
//                 pipeline, optimizer step, loss all-reduce; barrier first)
//   bubble        1 - sum over ranks of compute / (ranks x max over ranks of
//                 the schedule's wall time), from pp::PipelineStepResult
//                 (compute: time inside the stages' forwards and
//                 backwards, TP collectives and the DP reduction included;
//                 the rest is waiting for a peer and point-to-point), p50
//                 over the measured steps
//   busiest rank  1 - the busiest rank's compute / the schedule's wall time:
//                 the bubble without the stages' imbalance (the other ranks
//                 also wait for the busiest one), which the closed form
//                 leaves out and which, on a shared machine, moves from rank
//                 to rank between runs
//   closed form   pp::bubble_fraction_closed_form: (p-1)/(v m+p-1), the
//                 idle share when the stages cost the same and messages are
//                 free; for zbh1 (p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W)) with
//                 F, B and W the measured times of a forward, a B and a W
//                 (medians over the steps of the ranks' means)
//
// A layout whose world (tp x pp x dp) is not the job's is skipped with a
// note: ranks left out of a layout would share the cores with it and
// distort its times, so each world size is its own job.
//
//   commgrad-run -n 2 gpt_bench [--layout TP,PP,DP[,SCHEDULE[,V]]]... [--hidden 256] [--heads 8]
//                               [--ffn 1024] [--layers 8] [--sequence 128] [--vocab 256] [--batch 16]
//                               [--microbatches 4] [--warmup 2] [--steps 5] [--untie]
//                               [--cp N [--cp-mode ring|allgather|ulysses]]
//                               [--recompute none,selective,full]
//                               [--experts E [--topk k] [--ep N]]
//
// --cp N adds N context-parallel ranks to every layout (each sequence split
// over them, head-tail; tokens/s counts every token once).
//
// --recompute none,selective,full runs every layout once per granularity
// listed (GptConfig::recompute) and prints another table instead: step
// time, its ratio to the first granularity listed, and the peak of CPU
// tensor storage above the step's start (counted exactly by
// memory_counter.h; the highest step and rank): activations, gradients
// and the optimizer's temporaries together, of which recomputation lowers
// the first.
//
// --untie gives the output layer a weight of its own (GptConfig::tie), the
// form torch.distributed.pipelining can express (bench/gpt_bench.py).
//
// --experts E [--topk k] [--ep N] makes every layer's FFN a mixture of E
// experts of width --ffn (commgrad::moe; the trainer steps them with a second
// ZeRO-2 over the expert-data group), split over N expert-parallel ranks of
// each layout's data x context ranks (a layout they do not divide is skipped).

#include "gpt/corpus.h"
#include "gpt/model.h"
#include "gpt/trainer.h"

#include "memory_counter.h"

#include "cli/cli.h"

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <optional>
#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace tp = commgrad::tp;

namespace {

struct LayoutSpec {
  int tp = 1, pp = 1, dp = 1;
  std::string schedule = "1f1b";
  int v = 1;
  int cp = 1;  // --cp: context-parallel ranks of every layout

  int world() const { return tp * pp * dp * cp; }
  std::string name() const {
    return "TP=" + std::to_string(tp) + " x PP=" + std::to_string(pp) + " x DP=" + std::to_string(dp) +
           (cp > 1 ? " x CP=" + std::to_string(cp) : "");
  }
};

struct Config {
  gpt::GptConfig model;
  int64_t batch = 16;
  int microbatches = 4;
  int warmup = 2;
  int steps = 5;
  std::vector<LayoutSpec> layouts;
  int cp = 1;
  std::string cp_mode = "ring";
  std::vector<std::string> recompute;  // --recompute: granularities to compare (empty: the bubble table)
  int ep = 1;                          // --ep: expert-parallel ranks of every layout (with --experts)
};

// "tp,pp,dp[,schedule[,v]]"; v defaults to 2 for the interleaved schedule.
// Throws a usage error that quotes the layout.
LayoutSpec parse_layout(const std::string& text) {
  namespace cli = commgrad::cli;
  std::vector<std::string> parts;
  std::istringstream in(text);
  for (std::string part; std::getline(in, part, ',');) parts.push_back(part);
  if (parts.size() < 3 || parts.size() > 5) {
    throw cli::usage_error("--layout '" + text + "': expected TP,PP,DP[,SCHEDULE[,V]]");
  }
  const auto size = [&](const std::string& part) {
    const auto value = cli::to_integer(part, 1);
    if (!value) throw cli::usage_error("--layout '" + text + "': sizes are integers of at least 1, got '" + part + "'");
    return *value;
  };
  LayoutSpec l;
  l.tp = size(parts[0]);
  l.pp = size(parts[1]);
  l.dp = size(parts[2]);
  if (parts.size() > 3) l.schedule = parts[3];
  l.v = parts.size() > 4 ? size(parts[4]) : l.schedule == "interleaved" ? 2 : 1;
  if (l.schedule != "1f1b" && l.schedule != "gpipe" && l.schedule != "interleaved" && l.schedule != "zbh1") {
    throw cli::usage_error("--layout '" + text + "': schedule must be 1f1b, gpipe, interleaved or zbh1");
  }
  if (l.v != 1 && l.schedule != "interleaved") {
    throw cli::usage_error("--layout '" + text + "': V needs the interleaved schedule");
  }
  if (static_cast<int64_t>(l.tp) * l.pp * l.dp > std::numeric_limits<int>::max()) {
    throw cli::usage_error("--layout '" + text + "': more ranks than a job can have");
  }
  return l;
}

// The layouts of the benchmark at `n` ranks.
std::vector<LayoutSpec> default_layouts(int n) {
  if (n == 1) return {{1, 1, 1}};
  if (n == 2) {
    return {{1, 2, 1, "1f1b"}, {1, 2, 1, "gpipe"}, {1, 2, 1, "interleaved", 2},
            {1, 2, 1, "zbh1"}, {2, 1, 1},          {1, 1, 2}};
  }
  if (n == 4) return {{2, 2, 1, "1f1b"}, {1, 2, 2, "1f1b"}, {1, 4, 1, "1f1b"}};
  return {{1, n, 1, "1f1b"}, {1, 1, n}};
}

// The options of the command line into `c`; the exit code when the program
// ends here (--help, or a bad command line, named on stderr with exit code 2).
std::optional<int> parse(int argc, char** argv, Config& c) {
  namespace cli = commgrad::cli;
  c.model.vocab = 256;
  c.model.sequence = 128;
  c.model.hidden = 256;
  c.model.heads = 8;
  c.model.ffn = 1024;
  c.model.layers = 8;
  std::vector<std::string> layouts;
  cli::App app("gpt_bench",
               "The GPT of examples/gpt per layout: tokens/s, and the measured pipeline bubble against the\n"
               "closed form.\n"
               "  commgrad-run -n 2 gpt_bench [--layout 1,2,1,interleaved]...");
  app.add_option("--layout", layouts,
                 "a layout to measure (repeatable; default: the usual ones of the world size);\n"
                 "SCHEDULE: 1f1b, gpipe, interleaved or zbh1; V: stages per rank (interleaved)")
      ->type_name("TP,PP,DP[,SCHEDULE[,V]]")
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->always_capture_default(false);
  app.add_option("--cp", c.cp, "context-parallel ranks in every layout (each sequence split over them)")
      ->check(cli::positive());
  app.add_option("--cp-mode", c.cp_mode, "attention across them: ring, allgather or ulysses")
      ->check(cli::one_of({"ring", "allgather", "ulysses"}));
  app.add_option("--hidden", c.model.hidden, "model width")->check(cli::positive<int64_t>());
  app.add_option("--heads", c.model.heads, "attention heads")->check(cli::positive<int64_t>());
  app.add_option("--ffn", c.model.ffn, "inner width of the MLP")->check(cli::positive<int64_t>());
  app.add_option("--layers", c.model.layers, "transformer layers")->check(cli::positive<int64_t>());
  app.add_option("--sequence", c.model.sequence, "tokens per sequence")->check(cli::positive<int64_t>());
  app.add_option("--vocab", c.model.vocab, "vocabulary size")->check(cli::positive<int64_t>());
  app.add_option("--batch", c.batch, "global batch (sequences per step)")->check(cli::positive<int64_t>());
  app.add_option("--microbatches", c.microbatches, "microbatches per step and replica")->check(cli::positive());
  app.add_option("--warmup", c.warmup, "untimed steps first")->check(cli::non_negative());
  app.add_option("--steps", c.steps, "measured steps")->check(cli::positive());
  app.add_option("--recompute", c.recompute,
                 "compare these granularities (none, selective, full; comma-separated)\nper layout instead of "
                 "the bubble table")
      ->delimiter(',')
      ->check(cli::one_of({"none", "selective", "full"}));
  app.add_flag_callback(
      "--untie", [&c] { c.model.tie = false; }, "an output layer of its own (default: tied to the embedding)");
  app.add_option("--experts", c.model.experts, "every layer's FFN a mixture of this many experts (0: dense)")
      ->check(cli::non_negative<int64_t>());
  app.add_option("--topk", c.model.topk, "experts per token (with --experts)")->check(cli::positive<int64_t>());
  app.add_option("--ep", c.ep, "expert-parallel ranks in every layout (split the experts)")->check(cli::positive());
  return cli::parse(app, argc, argv, [&] {
    for (const auto& text : layouts) c.layouts.push_back(parse_layout(text));
    if (c.ep > 1 && (c.model.experts == 0 || c.model.experts % c.ep != 0)) {
      throw cli::usage_error("--ep " + std::to_string(c.ep) + " needs --experts divisible by it");
    }
    if (c.model.experts > 0 && c.model.topk > c.model.experts) {
      throw cli::usage_error("--topk " + std::to_string(c.model.topk) + " is more than the " +
                             std::to_string(c.model.experts) + " experts");
    }
  });
}

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Row {
  double tokens_per_second = 0, step_ms = 0, bubble = 0, busiest = 0, closed_form = 0, loss = 0;
  double peak_bytes = 0;  // CPU tensor storage above the step's start, highest step and rank
};

// Trains `l` for warm-up plus measured steps; the result is the same on every rank.
Row run_layout(const Config& c, const gpt::GptConfig& base, const LayoutSpec& l, const gpt::Corpus& corpus) {
  const commgrad::Group world = commgrad::world();
  const auto state = commgrad::make_model_parallel(
      commgrad::ModelParallelOptions(l.tp, l.pp).context_parallel_size(l.cp).expert_parallel_size(c.ep), world);
  gpt::GptConfig model = base;
  model.ep_group = state.expert_parallel_group();
  gpt::TrainerOptions options;
  options.cp_mode = c.cp_mode;
  options.batch = c.batch;
  options.microbatches = c.microbatches;
  options.schedule = l.schedule;
  options.stages_per_rank = l.v;
  gpt::Trainer trainer(options, model,
                       gpt::Layout{state.tensor_parallel_group(), state.pipeline_parallel_group(),
                                   state.data_parallel_group(), state.embedding_group(), state.context_parallel_group(),
                                   state.data_context_parallel_group(), state.expert_data_parallel_group()});
  const auto sum = commgrad::ops::AllReduceOptions().op(commgrad::ReduceOp::kSum);
  const auto max = commgrad::ops::AllReduceOptions().op(commgrad::ReduceOp::kMax);
  std::vector<double> step_times, bubbles, busiest, forwards, backwards, weights;
  Row row;
  for (int k = 0; k < c.warmup + c.steps; ++k) {
    commgrad::ops::barrier(world);
    commgrad::bench::reset_peak_cpu_bytes();
    const int64_t live = commgrad::bench::live_cpu_bytes();
    const double start = seconds_now();
    row.loss = trainer.step(corpus, k);
    const double wall = seconds_now() - start;
    const double peak = static_cast<double>(commgrad::bench::peak_cpu_bytes() - live);
    const auto& r = trainer.last_step();
    // Summed over the ranks: compute, and one F, B and W (divided into the ranks' mean).
    const double per_action = 1.0 / (c.microbatches * world.size());
    const auto sums = commgrad::ops::raw::all_reduce(
                          torch::tensor({r.compute_seconds, r.forward_seconds * per_action,
                                         r.backward_seconds * per_action, r.backward_weight_seconds * per_action},
                                        torch::kDouble),
                          sum, world)
                          .wait();
    const double compute = sums[0].item<double>();
    const auto slowest = commgrad::ops::raw::all_reduce(
                             torch::tensor({wall, r.step_seconds, r.compute_seconds, peak}, torch::kDouble), max, world)
                             .wait();
    if (k < c.warmup) continue;
    row.peak_bytes = std::max(row.peak_bytes, slowest[3].item<double>());
    forwards.push_back(sums[1].item<double>());
    backwards.push_back(sums[2].item<double>());
    weights.push_back(sums[3].item<double>());
    step_times.push_back(slowest[0].item<double>());
    bubbles.push_back(1.0 - compute / (world.size() * slowest[1].item<double>()));
    busiest.push_back(1.0 - slowest[2].item<double>() / slowest[1].item<double>());
  }
  row.step_ms = 1e3 * median(step_times);
  row.tokens_per_second = static_cast<double>(c.batch * c.model.sequence) / median(step_times);
  row.bubble = median(bubbles);
  row.busiest = median(busiest);
  const double w = median(weights);
  const auto costs =
      commgrad::pp::SimulationOptions().forward(median(forwards)).backward(median(backwards) + w).backward_weight(w);
  row.closed_form = commgrad::pp::bubble_fraction_closed_form(l.pp == 1 ? "1f1b" : l.schedule, l.pp, c.microbatches,
                                                              l.pp == 1 ? 1 : l.v, costs);
  return row;
}

tp::RecomputeGranularity granularity(const std::string& name) {
  if (name == "full") return tp::RecomputeGranularity::kFull;
  if (name == "selective") return tp::RecomputeGranularity::kSelective;
  return tp::RecomputeGranularity::kNone;
}

// --recompute: one row per granularity of layout `l`.
void print_recompute_rows(const Config& c, const LayoutSpec& l, const gpt::Corpus& corpus, bool speaker) {
  double first_ms = 0;
  for (const auto& name : c.recompute) {
    gpt::GptConfig model = c.model;
    model.recompute = granularity(name);
    const Row r = run_layout(c, model, l, corpus);
    if (first_ms == 0) first_ms = r.step_ms;
    if (!speaker) continue;
    std::printf("| %s | %s | %d | %s | %.0f | %.1f | %.2fx | %.2f | %.4f |\n", l.name().c_str(),
                l.pp == 1 ? "-" : l.schedule.c_str(), l.pp == 1 ? 1 : l.v, name.c_str(), r.tokens_per_second, r.step_ms,
                r.step_ms / first_ms, r.peak_bytes / (1 << 20), r.loss);
    std::fflush(stdout);
  }
}

// The table's header: the bubble table, or with --recompute the granularities'.
void print_table_header(const Config& c) {
  if (c.recompute.empty()) {
    std::printf(
        "| layout | schedule | v | tokens/s | step p50 (ms) | bubble measured | bubble closed form | "
        "measured / closed | busiest rank | busiest / closed | loss |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  } else {
    std::printf(
        "| layout | schedule | v | recompute | tokens/s | step p50 (ms) | step / %s | peak MiB above step start | "
        "loss |\n|---|---|---:|---|---:|---:|---:|---:|---:|\n",
        c.recompute.front().c_str());
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Config c;
    if (const auto code = parse(argc, argv, c)) return *code;
    commgrad::bench::count_cpu_allocations();
    commgrad::init_process_group();
    const int n = commgrad::world_size();
    const bool speaker = commgrad::rank() == 0;
    if (c.layouts.empty()) c.layouts = default_layouts(n % c.cp == 0 ? n / c.cp : n);
    for (auto& l : c.layouts) l.cp = c.cp;
    const auto corpus = gpt::Corpus::synthetic(c.model.vocab);
    const auto& m = c.model;
    if (speaker) {
      std::printf(
          "gpt_bench: %d ranks (%s), GPT %lld layers, hidden %lld, %lld heads, ffn %lld, vocab %lld, "
          "sequence %lld, %s; global batch %lld, %d microbatches, %d warm-up + %d measured steps",
          n, commgrad::world().backend_name().c_str(), static_cast<long long>(m.layers),
          static_cast<long long>(m.hidden), static_cast<long long>(m.heads), static_cast<long long>(m.ffn),
          static_cast<long long>(m.vocab), static_cast<long long>(m.sequence),
          m.tie ? "tied embeddings" : "untied output layer", static_cast<long long>(c.batch), c.microbatches, c.warmup,
          c.steps);
      if (m.experts > 0) {
        std::printf("; %lld experts (top-%lld) over EP=%d", static_cast<long long>(m.experts),
                    static_cast<long long>(m.topk), c.ep);
      }
      std::printf("\n\n");
      print_table_header(c);
    }
    std::vector<std::string> notes;
    for (const auto& l : c.layouts) {
      const std::string schedule = l.pp == 1 ? "-" : l.schedule;
      if (l.world() != n) {
        notes.push_back(l.name() + " " + schedule + ": skipped, it needs " + std::to_string(l.world()) +
                        " ranks and the job has " + std::to_string(n));
        continue;
      }
      if ((l.dp * l.cp) % c.ep != 0) {
        notes.push_back(l.name() + " " + schedule + ": skipped, --ep " + std::to_string(c.ep) +
                        " does not divide its data x context ranks");
        continue;
      }
      if (!c.recompute.empty()) {
        print_recompute_rows(c, l, corpus, speaker);
        continue;
      }
      const Row r = run_layout(c, c.model, l, corpus);
      if (speaker) {
        char ratio[32] = "-", busiest_ratio[32] = "-";
        if (r.closed_form > 0) {
          std::snprintf(ratio, sizeof ratio, "%.2f", r.bubble / r.closed_form);
          std::snprintf(busiest_ratio, sizeof busiest_ratio, "%.2f", r.busiest / r.closed_form);
        }
        std::printf("| %s | %s | %d | %.0f | %.1f | %.3f | %.3f | %s | %.3f | %s | %.4f |\n", l.name().c_str(),
                    schedule.c_str(), l.pp == 1 ? 1 : l.v, r.tokens_per_second, r.step_ms, r.bubble, r.closed_form,
                    ratio, r.busiest, busiest_ratio, r.loss);
        std::fflush(stdout);
      }
    }
    if (speaker) {
      for (const auto& note : notes) std::printf("note: %s\n", note.c_str());
      std::fflush(stdout);
    }
    commgrad::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
