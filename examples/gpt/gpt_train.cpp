// A small GPT trained tensor x pipeline x data parallel (+ sequence
// parallel), checked against the same model on one rank.
//
//   commgrad-run -n 8 gpt_train --tp 2 --pp 2 --dp 2 [--cp 1 [--cp-mode ring|allgather|ulysses]]
//                               [--sp] [--microbatches 4] [--steps 10]
//                               [--schedule 1f1b|gpipe|interleaved|zbh1] [--stages-per-rank 2] [--fsdp]
//                               [--precision fp32|bf16|fp16 [--loss-scale-init S]]
//                               [--save DIR [--save-every K] [--async-save]] [--resume DIR] [--text FILE]
//                               [--curve PREFIX|none] [--check] [--dropout P]
//                               [--recompute none|selective|full [--recompute-layers K]] [--check-recompute]
//                               [--experts E [--topk k] [--ep N] [--moe-every 2] [--moe-score sigmoid]
//                                [--aux-loss C] [--z-loss C] [--expert-bias RATE] [--capacity-factor C]]
//
// (gpt_train --help lists every option with its default; a bad one ends the
// program with a message naming it and exit code 2, before any rank starts.)
//
// The model (examples/gpt/model.h): a vocabulary-parallel embedding plus
// learned positions, 4 ParallelTransformerLayers, a final LayerNorm and the
// output layer tied to the embedding, with vocabulary-parallel cross
// entropy. The ranks follow Megatron's order (commgrad::make_model_parallel): a
// pipeline of `pp` ranks (each with `stages-per-rank` stages under the
// interleaved schedule), each stage split over `tp` ranks, and `dp` replicas
// of the whole, trained with the sharded optimizer (ZeRO-2, AdamW,
// global-norm clipping over every stage and TP rank; the tied embedding's
// gradient summed between the first and last stage), or with --fsdp sharded
// by commgrad::fsdp (parameters too: one unit per layer, the tied embedding
// a unit of its own) and stepped by the same AdamW. Each step takes a
// global batch of 8 sequences of a deterministic corpus (examples/gpt/
// corpus.h; --text FILE: the file's bytes): every replica its 8/dp rows,
// split into `microbatches`. --dp auto (the default) takes the world size
// over tp x pp x cp: a job that commgrad-run --nnodes MIN:MAX restarts on
// fewer nodes resumes its checkpoint at a smaller DP (the load reshards) and
// keeps the global batch of 8; the number of microbatches stays, so each
// microbatch grows (8/(dp x microbatches) rows): at DP=1 a rank computes
// what the one-rank reference of --check computes. With --cp N each sequence is split over N
// context-parallel ranks (head-tail, positions included; attention across
// them by --cp-mode), gradients and the logged loss averaged over data x
// context: the loss printed is the loss of the whole sequence.
//
// Rank 0 shows the progress (one updating line on a terminal, plain lines
// otherwise) and writes the loss curve to PREFIX.csv and PREFIX.svg
// (default gpt_train_loss). --save DIR writes a sharded checkpoint (model
// and optimizer) at the end, and every K steps with --save-every; --resume
// DIR continues from its latest step under any layout. A --save DIR that
// already holds a checkpoint is resumed from (its latest intact step: a job
// that commgrad-run --max-restarts started again continues where it was).
// With --save, SIGTERM or SIGUSR1 (a preemption) makes every rank finish the
// step, save it and exit with 75, which commgrad-run does not count as a
// failure; a second signal ends the program at once.
//
// --experts E makes every layer's FFN a mixture of E experts (commgrad::moe,
// top-k routing with a per-sequence load-balancing loss), split over --ep
// ranks of each data-parallel group; the experts train with a second ZeRO-2
// over the expert-data group, clipped with the rest by one global norm
// (docs/moe.md); with --fsdp the experts of each layer are a unit of their
// own over the expert-data group (moe::fully_shard_experts), and --precision
// fp16 with experts needs --fsdp. With --sp each TP rank routes its own part of the
// sequences, with --cp each CP rank (EP then divides dp x cp); checkpoints hold the experts by their global index, so a
// run saved at one --ep resumes at another.
//
// --dropout P turns on attention and hidden dropout in every layer (masks
// from tp::rng_tracker(), seeded by the trainer). --recompute recomputes
// every layer's activations in backward (selective: the attention core;
// full: the whole layer), or with --recompute-layers K only the first K
// layers of each stage (Megatron's block method). --check-recompute also
// trains the same layout under none, selective and full recompute and
// checks that losses and parameters agree bit for bit (dropout masks are
// replayed; docs/recompute.md).
//
// With --check the run is compared with a one-process reference written
// with LibTorch functions and torch::optim alone (gpt/reference.h), started
// from the parallel model's gathered initial weights: the loss and the
// gradient norm of every step, every parameter's whole gradient of the
// first step this run trains (after the reductions, before clipping) and
// every parameter at the end (gpt/reference_check.h states the tolerances:
// float32 1e-5, bfloat16 5e-3 on the losses); the program exits 1 when one
// is off and names the worst tensor. Where the reference does not model the
// run (fp16's loss scaler, the router's other options), every rank trains
// the same program alone (TP = PP = DP = 1) and rank 0 compares the losses:
// 1e-3 relative under fp16, which also wants the one-rank run to skip the
// steps the loss scaler skipped (printed by every rank); --loss-scale-init
// S (default 65536) sets the first scale. GPT_TRAIN_FAULT=grad-scale:F[:NAME]
// scales the gradients of the parallel run (gpt/faults.h): --check must fail.
//
//   [0] GPT: 4 layers, hidden 32, 4 heads, vocab 64, sequence 16, tied embeddings; TP=2 x PP=2 x DP=2, 1f1b, ...
//   [0] step 1/10: loss 4.171530, 2409 tokens/s, ETA 0 s
//   [0] ...
//   [0] check step 10/10: loss 3.027105 (one rank 3.027105), gradient norm 0.912345 (one rank 0.912345)
//   [0] max relative difference from one rank 7.4e-08 (tolerance 1e-05): ok
//   [0] gradient norms: max relative difference 5.1e-07 (tolerance 1e-05): ok
//   [0] gradients of step 1 (before clipping): 52 tensors, the worst 'layer1.ln1.weight' off by 7.9e-07 ...: ok
//   [0] parameters after step 10 (...): 52 tensors, the worst 'layer0.mlp.fc2.weight' off by 3.8e-05 ...: ok

#include "gpt/corpus.h"
#include "gpt/faults.h"
#include "gpt/loss_curve.h"
#include "gpt/model.h"
#include "gpt/progress.h"
#include "gpt/recompute_check.h"
#include "gpt/reference_check.h"
#include "gpt/trainer.h"

#include "cli/cli.h"

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

namespace tp = commgrad::tp;

namespace {

constexpr int64_t kBatch = 8;  // global, divisible by dp * microbatches for dp, m in {1, 2, 4, 8}
// Relative tolerance of --check, by the resolution of the compute dtype: a
// rounding of bfloat16 is 2^-8 = 3.9e-3 relative, of float16 2^-11 = 4.9e-4.
double tolerance(const std::string& precision) {
  if (precision == "bf16") return 5e-3;
  if (precision == "fp16") return 1e-3;
  return 1e-5;
}

struct Config {
  int tp = 1, pp = 1, cp = 1;
  int dp = 0;  // 0: --dp auto, the world size over tp x pp x cp
  std::string cp_mode = "ring";
  bool sp = false;
  bool fsdp = false;
  std::string precision = "fp32";
  double loss_scale_init = 0;  // 0: the trainer's default
  int microbatches = 4;
  int steps = 10;
  std::string schedule = "1f1b";
  int stages_per_rank = 0;  // 0: 2 for the interleaved schedule, else 1
  std::string save, resume, text;
  int save_every = 0;
  bool async_save = false;
  std::string curve = "gpt_train_loss";
  bool check = false;
  std::string recompute = "none";
  int recompute_layers = 0;
  bool check_recompute = false;
  double dropout = 0.0;
  int experts = 0, topk = 2, ep = 1, moe_every = 1;
  std::string moe_score = "softmax";
  double aux_loss = 1e-2, z_loss = 0, expert_bias = 0, capacity_factor = 0;

  std::string layout() const {
    return "TP=" + std::to_string(tp) + " x PP=" + std::to_string(pp) + " x DP=" + std::to_string(dp) +
           (cp > 1 ? " x CP=" + std::to_string(cp) + " (" + cp_mode + ")" : "") +
           (ep > 1 ? " (EP=" + std::to_string(ep) + ")" : "") + (sp ? " (SP)" : "") + (fsdp ? " (FSDP)" : "") +
           (precision != "fp32" ? " " + precision : "");
  }
};

// The trainer's options of a command line.
gpt::TrainerOptions trainer_options(const Config& c) {
  gpt::TrainerOptions o;
  o.batch = kBatch;
  o.microbatches = c.microbatches;
  o.schedule = c.schedule;
  o.stages_per_rank = c.stages_per_rank;
  o.fsdp = c.fsdp;
  o.precision = c.precision;
  if (c.loss_scale_init > 0) o.loss_scale_init = c.loss_scale_init;
  o.cp_mode = c.cp_mode;
  o.async_save = c.async_save;
  return o;
}

// --experts, --topk, --moe-every, --ep and the router's options.
void add_expert_options(commgrad::cli::App& app, Config& c) {
  namespace cli = commgrad::cli;
  app.add_option("--experts", c.experts,
                 "mixture of experts: every layer's FFN a MoE block of\nthis many experts (0: dense)")
      ->check(cli::non_negative());
  app.add_option("--topk", c.topk, "experts per token (with --experts)")->check(cli::positive());
  app.add_option("--moe-every", c.moe_every, "with --experts: every layer (1) or every other (2) MoE")
      ->check(cli::positive());
  app.add_option("--ep", c.ep, "expert-parallel ranks (split the experts; divides --dp)")->check(cli::positive());
  app.add_option("--moe-score", c.moe_score, "router scores: softmax, or sigmoid (top-k normalised,\nDeepSeek-V3)")
      ->check(cli::one_of({"softmax", "sigmoid"}));
  app.add_option("--aux-loss", c.aux_loss, "load-balancing loss coefficient (per sequence)")
      ->type_name("COEFF")
      ->check(cli::number(0.0, true, 1.0));
  app.add_option("--z-loss", c.z_loss, "router z-loss coefficient")
      ->type_name("COEFF")
      ->check(cli::number(0.0, true, 1.0));
  app.add_option(
         "--expert-bias", c.expert_bias,
         "aux-loss-free balancing: each step moves every expert's\nrouting bias by RATE toward balance (0: off)")
      ->type_name("RATE")
      ->check(cli::number(0.0, true, 1.0));
  app.add_option("--capacity-factor", c.capacity_factor,
                 "each expert takes at most ceil(C T k / E) of a rank's T\ntokens per microbatch (0: dropless)")
      ->type_name("C")
      ->check(cli::number(0.0, true, 64.0));
}

// --cp splits every sequence into 2 x cp chunks (head-tail).
void check_context_parallel(const Config& c) {
  const int64_t sequence = gpt::GptConfig().sequence;
  if (c.cp > 1 && sequence % (2 * c.cp) != 0) {
    throw commgrad::cli::usage_error("--cp " + std::to_string(c.cp) + ": the sequence of " + std::to_string(sequence) +
                                     " tokens does not split into 2 x " + std::to_string(c.cp) + " chunks (head-tail)");
  }
}

// --save, --save-every, --async-save, --resume.
void add_checkpoint_options(commgrad::cli::App& app, Config& c) {
  namespace cli = commgrad::cli;
  auto* save = app.add_option("--save", c.save,
                              "write a sharded checkpoint into DIR at the end (and on\nSIGTERM/SIGUSR1); resume from "
                              "DIR when it holds one")
                   ->type_name("DIR");
  app.add_option("--save-every", c.save_every, "and every K steps (needs --save)")
      ->type_name("K")
      ->check(cli::non_negative());
  app.add_flag("--async-save", c.async_save, "write checkpoints in the background while training goes on")->needs(save);
  app.add_option("--resume", c.resume, "continue from the latest step of the checkpoint in DIR,\nunder any layout")
      ->type_name("DIR");
}

// --dropout, --recompute, --recompute-layers, --check-recompute.
void add_recompute_options(commgrad::cli::App& app, Config& c) {
  namespace cli = commgrad::cli;
  app.add_option("--dropout", c.dropout, "attention and hidden dropout probability of every layer")
      ->type_name("P")
      ->check(cli::number(0.0, true, 0.9));
  app.add_option(
         "--recompute", c.recompute,
         "activation recomputation of every layer: none, selective\n(the attention core) or full (the whole layer)")
      ->check(cli::one_of({"none", "selective", "full"}));
  app.add_option("--recompute-layers", c.recompute_layers,
                 "with --recompute: only the first K layers of each stage\n(0: every layer)")
      ->type_name("K")
      ->check(cli::non_negative());
  app.add_flag("--check-recompute", c.check_recompute,
               "also train this layout under none, selective and full\nrecompute and compare losses and parameters "
               "bit for bit\n(exit 1 when they differ)");
}

// The combinations of the recompute and dropout options that cannot work, named.
void check_recompute_options(const Config& c) {
  namespace cli = commgrad::cli;
  if (c.recompute_layers > 0 && c.recompute == "none") {
    throw cli::usage_error("--recompute-layers " + std::to_string(c.recompute_layers) +
                           " needs --recompute selective or full");
  }
  if (c.dropout > 0 && c.check) {
    throw cli::usage_error(
        "--check compares with one rank, whose dropout masks differ from a split layer's; with --dropout use "
        "--check-recompute");
  }
  if (c.dropout > 0 && c.cp > 1) throw cli::usage_error("--dropout does not combine with --cp (attention dropout)");
}

// The global batch splits into dp replicas x microbatches, and EP divides dp x cp.
void check_data_parallel(const Config& c) {
  namespace cli = commgrad::cli;
  if (kBatch % (static_cast<int64_t>(c.dp) * c.microbatches) != 0) {
    throw cli::usage_error("the global batch of " + std::to_string(kBatch) + " does not split into " +
                           std::to_string(c.dp) + " replicas x " + std::to_string(c.microbatches) + " microbatches");
  }
  if (c.ep > 1 && (c.dp * c.cp) % c.ep != 0) {
    throw cli::usage_error("--ep " + std::to_string(c.ep) + " does not divide --dp " + std::to_string(c.dp) +
                           (c.cp > 1 ? " x --cp " + std::to_string(c.cp) : ""));
  }
}

// --dp auto: the data-parallel size of this world (a job restarted on fewer
// nodes trains at a smaller DP, from the same checkpoint).
void derive_data_parallel(Config& c, int world) {
  const int64_t model = static_cast<int64_t>(c.tp) * c.pp * c.cp;
  if (c.dp == 0) {
    if (world % model != 0) {
      throw std::invalid_argument("--tp " + std::to_string(c.tp) + " x --pp " + std::to_string(c.pp) +
                                  (c.cp > 1 ? " x --cp " + std::to_string(c.cp) : "") +
                                  " does not divide the world size " + std::to_string(world) + " (--dp auto)");
    }
    c.dp = static_cast<int>(world / model);
    check_data_parallel(c);
  }
  if (model * c.dp != world) {
    throw std::invalid_argument("--tp " + std::to_string(c.tp) + " x --pp " + std::to_string(c.pp) + " x --dp " +
                                std::to_string(c.dp) + (c.cp > 1 ? " x --cp " + std::to_string(c.cp) : "") +
                                " is not the world size " + std::to_string(world));
  }
}

// The combinations --experts does not support (yet), named.
void check_experts(const Config& c) {
  namespace cli = commgrad::cli;
  if (c.experts > 0 && c.precision == "fp16" && !c.fsdp) {
    throw cli::usage_error("--precision fp16 with --experts needs --fsdp (one loss scaler over every gradient)");
  }
  if (c.ep > 1 && (c.experts == 0 || (c.dp > 0 && (c.dp * c.cp) % c.ep != 0) || c.experts % c.ep != 0)) {
    throw cli::usage_error("--ep " + std::to_string(c.ep) + " needs --experts divisible by it and divides --dp " +
                           (c.dp > 0 ? std::to_string(c.dp) : "auto") +
                           (c.cp > 1 ? " x --cp " + std::to_string(c.cp) : ""));
  }
  const bool router =
      c.moe_score != "softmax" || c.aux_loss != 1e-2 || c.z_loss > 0 || c.expert_bias > 0 || c.capacity_factor > 0;
  if (c.experts == 0 && router) {
    throw cli::usage_error(
        "the router options (--moe-score, --aux-loss, --z-loss, --expert-bias, --capacity-factor) need --experts");
  }
  // A capacity is per rank and microbatch: the one-rank run splits into
  // microbatches of a data-parallel rank's tokens, which SP and CP cut differently.
  if (c.capacity_factor > 0 && c.check && (c.sp || c.cp > 1)) {
    throw cli::usage_error(
        "--capacity-factor with --check: not with --sp or --cp (a rank's tokens are parts of "
        "sequences, which the one-rank run cannot drop alike)");
  }
  if (c.experts > 0 && c.topk > c.experts) {
    throw cli::usage_error("--topk " + std::to_string(c.topk) + " is more than the " + std::to_string(c.experts) +
                           " experts");
  }
}

// The options of the command line into `c`; the exit code when the program
// ends here (--help, or a bad command line, named on stderr with exit code 2).
std::optional<int> parse(int argc, char** argv, Config& c) {
  namespace cli = commgrad::cli;
  cli::App app("gpt_train",
               "A small GPT (tied embeddings) trained tensor x pipeline x data parallel (+ sequence\n"
               "parallel) under commgrad-run, checked against one rank with --check.\n"
               "  commgrad-run -n 8 gpt_train --tp 2 --pp 2 --dp 2");
  app.add_option("--tp", c.tp, "tensor-parallel ranks")->check(cli::positive());
  app.add_option("--pp", c.pp, "pipeline stages (ranks)")->check(cli::positive());
  app.add_option_function<std::string>(
         "--dp", [&c](const std::string& v) { c.dp = v == "auto" ? 0 : std::stoi(v); },
         "data-parallel replicas; auto (the default): the world size\nover --tp x --pp x --cp")
      ->type_name("N|auto")
      ->check(CLI::Validator(
          [](std::string& v) {
            return v == "auto" || cli::to_integer(v, 1)
                       ? std::string()
                       : "expected auto or an integer in [1, 2147483647], got '" + v + "'";
          },
          "", "replicas"));
  app.add_option("--cp", c.cp, "context-parallel ranks (each sequence split over them)")->check(cli::positive());
  app.add_option("--cp-mode", c.cp_mode, "attention across the context-parallel ranks:\nring, allgather or ulysses")
      ->check(cli::one_of({"ring", "allgather", "ulysses"}));
  app.add_flag("--sp", c.sp, "sequence parallelism (with --tp)");
  app.add_flag("--fsdp", c.fsdp,
               "shard parameters, gradients and optimizer state over DP\n(commgrad::fsdp, one unit per layer) instead "
               "of ZeRO-2");
  app.add_option("--precision", c.precision,
                 "fp32, bf16 (bfloat16 compute, float32 masters) or fp16\n(float16 compute with loss scaling)")
      ->check(cli::one_of({"fp32", "bf16", "fp16"}));
  app.add_option("--loss-scale-init", c.loss_scale_init, "with --precision fp16: the loss scaler's first scale (65536)")
      ->type_name("S")
      ->check(cli::number(0, false));
  app.add_option("--microbatches", c.microbatches, "microbatches per step and replica")->check(cli::positive());
  app.add_option("--steps", c.steps, "train to this step (after a resume too)")->check(cli::positive());
  app.add_option("--schedule", c.schedule, "pipeline schedule: 1f1b, gpipe, interleaved or zbh1")
      ->check(cli::one_of({"1f1b", "gpipe", "interleaved", "zbh1"}));
  app.add_option("--stages-per-rank", c.stages_per_rank,
                 "pipeline stages on each rank under --schedule interleaved\n(0: 2 there, else 1)")
      ->check(cli::non_negative());
  add_checkpoint_options(app, c);
  app.add_option("--text", c.text, "train on this file's bytes instead of the synthetic corpus")->type_name("FILE");
  app.add_option("--curve", c.curve, "write the loss curve to PREFIX.csv and PREFIX.svg\n(none: do not)")
      ->type_name("PREFIX");
  add_recompute_options(app, c);
  add_expert_options(app, c);
  app.add_flag("--check", c.check, "also train on one rank and compare the curves\n(exit 1 when they part)");
  return cli::parse(app, argc, argv, [&c] {
    if (c.stages_per_rank == 0) c.stages_per_rank = c.schedule == "interleaved" ? 2 : 1;
    if (c.stages_per_rank != 1 && c.schedule != "interleaved") {
      throw cli::usage_error("--stages-per-rank " + std::to_string(c.stages_per_rank) +
                             " needs --schedule interleaved");
    }
    if (c.loss_scale_init > 0 && c.precision != "fp16")
      throw cli::usage_error("--loss-scale-init needs --precision fp16");
    check_context_parallel(c);
    if (c.dp > 0) check_data_parallel(c);
    check_experts(c);
    check_recompute_options(c);
    if (c.save_every > 0 && c.save.empty()) {
      throw cli::usage_error("--save-every needs --save DIR and a positive number of steps");
    }
    if (!c.resume.empty()) {
      const auto saved = commgrad::checkpoint::latest_step(c.resume);
      if (saved && c.steps <= *saved) {
        throw cli::usage_error("--steps " + std::to_string(c.steps) + ": the checkpoint in " + c.resume +
                               " already holds step " + std::to_string(*saved) +
                               "; nothing to train (--steps must be larger)");
      }
    }
  });
}

// What a training gave: the loss of every step, and the steps the loss
// scaler skipped (fp16).
struct Curve {
  std::vector<double> losses;
  std::vector<int> skipped;
};

// Trains the model alone on every rank (a group of this process alone for
// every role) from step 1.
Curve train_alone(Config c, const gpt::GptConfig& model_config, const gpt::Corpus& corpus) {
  const commgrad::Group alone = commgrad::self_group();
  c.schedule = "1f1b";
  c.stages_per_rank = 1;
  c.fsdp = c.fsdp && c.precision == "fp16";  // float16 on one rank as the run shards it (bf16: ZeRO's masters)
  auto config = model_config;
  config.ep_group = commgrad::Group();  // every expert on this rank
  config.routing.batch_group(commgrad::Group());
  // With a capacity: microbatches of a data-parallel rank's size, so that the same pairs are dropped.
  if (config.capacity_factor > 0) c.microbatches *= c.dp;
  config.sequence_parallel = false;
  config.recompute = tp::RecomputeGranularity::kNone;  // the plain curve
  gpt::Trainer trainer(trainer_options(c), config, gpt::Layout{alone, alone, alone, alone});
  Curve curve;
  for (int k = 0; k < c.steps; ++k) curve.losses.push_back(trainer.step(corpus, k));
  curve.skipped = trainer.skipped_steps();
  return curve;
}

// The model's options of the command line.
void configure_model(const Config& c, const gpt::Corpus& corpus, gpt::GptConfig& model_config) {
  model_config.vocab = corpus.vocab();
  model_config.experts = c.experts;
  model_config.topk = c.topk;
  model_config.moe_every = c.moe_every;
  model_config.routing = commgrad::moe::RoutingOptions()
                             .score_function(c.moe_score == "sigmoid" ? commgrad::moe::ScoreFunction::kSigmoid
                                                                      : commgrad::moe::ScoreFunction::kSoftmax)
                             .normalize_top_k(c.moe_score == "sigmoid")
                             .aux_loss_coeff(c.aux_loss)
                             .z_loss_coeff(c.z_loss)
                             .expert_bias_rate(c.expert_bias);
  model_config.capacity_factor = c.capacity_factor;
  model_config.sequence_parallel = c.sp;
  model_config.recompute = c.recompute == "full"        ? tp::RecomputeGranularity::kFull
                           : c.recompute == "selective" ? tp::RecomputeGranularity::kSelective
                                                        : tp::RecomputeGranularity::kNone;
  model_config.recompute_layers = c.recompute_layers;
  model_config.dropout = c.dropout;
}

// Rank 0's first lines: the build, the model, the layout and the data.
void print_header(const Config& c, const gpt::GptConfig& model_config, const gpt::Corpus& corpus) {
  std::cout << commgrad::build_info().to_string() << "\n";
  std::printf("GPT: %lld layers, hidden %lld, %lld heads, vocab %lld, sequence %lld, tied embeddings; %s, %s",
              static_cast<long long>(model_config.layers), static_cast<long long>(model_config.hidden),
              static_cast<long long>(model_config.heads), static_cast<long long>(model_config.vocab),
              static_cast<long long>(model_config.sequence), c.layout().c_str(), c.schedule.c_str());
  if (c.stages_per_rank > 1) std::printf(" (%d stages per rank)", c.stages_per_rank);
  std::printf(", %d microbatches", c.microbatches);
  if (c.recompute != "none") std::printf(", recompute %s", c.recompute.c_str());
  if (c.recompute != "none" && c.recompute_layers > 0)
    std::printf(" (the first %d layers of each stage)", c.recompute_layers);
  if (c.dropout > 0) std::printf(", dropout %g", c.dropout);
  if (c.experts > 0) std::printf(", %d experts (top-%d) over EP=%d", c.experts, c.topk, c.ep);
  if (c.experts > 0 && c.moe_score != "softmax") std::printf(", %s scores", c.moe_score.c_str());
  if (c.experts > 0 && c.z_loss > 0) std::printf(", z-loss %g", c.z_loss);
  if (c.experts > 0 && c.expert_bias > 0) std::printf(", expert bias rate %g", c.expert_bias);
  if (c.experts > 0 && c.capacity_factor > 0) std::printf(", capacity factor %g", c.capacity_factor);
  std::printf("; data %s\n", corpus.describe().c_str());
  std::fflush(stdout);
}

// --check: trains the model alone, puts its losses beside `curve`'s, prints
// them (rank 0); true when they part by no more than the tolerance (and,
// under fp16, the one-rank run skipped the steps `skipped` holds).
bool matches_one_rank(const Config& c, const gpt::GptConfig& model_config, const gpt::Corpus& corpus,
                      std::vector<gpt::CurvePoint>& curve, const std::vector<int>& skipped, int rank) {
  const auto alone = train_alone(c, model_config, corpus);
  const auto& reference = alone.losses;
  double worst = 0;
  for (auto& point : curve) {
    point.reference = reference[point.step - 1];
    const double difference = std::abs(point.loss - *point.reference) / std::abs(*point.reference);
    worst = std::isnan(difference) ? difference : std::max(worst, difference);
    if (rank == 0) {
      std::printf("check step %d/%d: loss %.6f (one rank %.6f)\n", point.step, c.steps, point.loss, *point.reference);
    }
  }
  const double allowed = tolerance(c.precision);
  bool ok = worst <= allowed;  // (a NaN loss fails)
  if (rank == 0) {
    std::printf("max relative difference from one rank %.2g (tolerance %.0e): %s\n", worst, allowed,
                ok ? "ok" : "MISMATCH");
  }
  if (c.precision == "fp16") {
    // Only the steps this run trained (after a resume, the last ones).
    const int first = curve.empty() ? c.steps + 1 : curve.front().step;
    std::vector<int> expected;
    for (int s : alone.skipped)
      if (s >= first) expected.push_back(s);
    const bool same = expected == skipped;
    if (rank == 0) {
      std::printf("skipped steps %s, one rank %s: %s\n", gpt::step_list(skipped).c_str(),
                  gpt::step_list(expected).c_str(), same ? "the same" : "MISMATCH");
    }
    ok = ok && same;
  }
  return ok;
}

// Where this run starts: --resume DIR's latest step; else the latest intact
// step of --save DIR when it holds one (a restarted job); else step 0.
int resume(const Config& c, gpt::Trainer& trainer, int rank) {
  std::string root = c.resume;
  std::optional<int64_t> step;
  if (root.empty() && !c.save.empty()) {
    step = commgrad::checkpoint::latest_complete_step(c.save).step;
    if (step) root = c.save;
  }
  if (root.empty()) return 0;
  const auto [loaded, saved_layout] = trainer.load(root, step);
  if (rank == 0) std::printf("resumed from step %d of %s (saved at %s)\n", loaded, root.c_str(), saved_layout.c_str());
  return loaded;
}

// Trains steps start+1 .. --steps, saving as asked; returns the last step
// saved (0: none), or -1 after a preemption (the step saved, the ranks stop).
int train(const Config& c, gpt::Trainer& trainer, const gpt::Corpus& corpus, int start, int rank,
          std::vector<gpt::CurvePoint>& curve, gpt::Progress& progress, const gpt::Faults& faults) {
  std::optional<commgrad::checkpoint::Preemption> preemption;
  if (!c.save.empty()) preemption.emplace();
  int saved = 0;
  for (int k = start; k < c.steps; ++k) {
    faults.step_begins(k + 1, rank);
    curve.push_back({k + 1, trainer.step(corpus, k), std::nullopt});
    if (rank == 0) progress.step(k + 1, curve.back().loss);
    const bool preempted = preemption && preemption->requested();
    if (preempted) faults.preemption_save_begins(rank);
    if (!c.save.empty() && (preempted || k + 1 == c.steps || (c.save_every > 0 && (k + 1) % c.save_every == 0))) {
      trainer.save(c.save, k + 1, c.layout());
      saved = k + 1;
    }
    if (preempted) {
      if (rank == 0) {
        progress.finish();
        std::printf("preempted: saved step %d in %s; exiting with %d\n", saved, c.save.c_str(),
                    commgrad::checkpoint::kExitPreempted);
        std::fflush(stdout);
      }
      return -1;
    }
  }
  return saved;
}

// fp16: the scaler's state (rank 0) and the steps it skipped (every rank,
// "rank r skipped steps: 1 2"; the same on every rank).
void print_loss_scaler(const gpt::Trainer& trainer, int rank) {
  const auto* scaler = trainer.loss_scaler();
  if (scaler == nullptr) return;
  if (rank == 0) {
    std::printf("loss scale %g, %lld steps skipped (inf/NaN gradients)\n", scaler->scale(),
                static_cast<long long>(scaler->skipped_steps()));
  }
  std::printf("rank %d skipped steps: %s\n", rank, gpt::step_list(trainer.skipped_steps()).c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Config c;
    if (const auto code = parse(argc, argv, c)) return *code;
    commgrad::init_process_group();
    const int rank = commgrad::rank();
    derive_data_parallel(c, commgrad::world_size());
    gpt::GptConfig model_config;
    const auto corpus = c.text.empty() ? gpt::Corpus::synthetic(model_config.vocab)
                                       : gpt::Corpus::from_file(c.text, model_config.sequence);
    configure_model(c, corpus, model_config);
    if (rank == 0) print_header(c, model_config, corpus);
    const auto state = commgrad::make_model_parallel(
        commgrad::ModelParallelOptions(c.tp, c.pp).context_parallel_size(c.cp).expert_parallel_size(c.ep),
        commgrad::world());
    model_config.ep_group = state.expert_parallel_group();
    model_config.routing.batch_group(state.data_context_parallel_group());  // the expert bias's loads
    const gpt::Layout layout{state.tensor_parallel_group(),     state.pipeline_parallel_group(),
                             state.data_parallel_group(),       state.embedding_group(),
                             state.context_parallel_group(),    state.data_context_parallel_group(),
                             state.expert_data_parallel_group()};
    gpt::Trainer trainer(trainer_options(c), model_config, layout);
    if (rank == 0 && c.recompute != "none")
      std::printf("rank 0 layers: %s\n", gpt::layer_recomputation(*trainer.model()).c_str());
    const auto faults = gpt::Faults::from_environment();
    // --check: the initial weights for the reference, before a resume loads.
    std::optional<gpt::ReferenceCheck> check;
    if (c.check && gpt::reference_models(model_config, c.precision))
      check.emplace(trainer, model_config, c.precision, trainer_options(c).loss_scale_init, commgrad::world());
    if (check || faults.scales_gradients()) {
      trainer.inspect_gradients([&faults, &check](int step, const auto& gradients) {
        faults.scale_gradients(gradients);
        if (check) check->capture(step, gradients);
      });
    }
    const int start = resume(c, trainer, rank);  // steps done before this run
    if (check) check->compare_gradients_of(trainer, start + 1);
    std::vector<gpt::CurvePoint> curve;
    gpt::Progress progress(start + 1, c.steps, kBatch * model_config.sequence);
    const int saved = train(c, trainer, corpus, start, rank, curve, progress, faults);
    if (saved < 0) {  // preempted: saved (on disk before the exit) and stopping
      trainer.finish_saves();
      commgrad::destroy_process_group();
      return commgrad::checkpoint::kExitPreempted;
    }
    trainer.finish_saves();
    if (rank == 0) {
      progress.finish();
      if (saved > 0) std::printf("saved step %d in %s\n", saved, c.save.c_str());
    }
    print_loss_scaler(trainer, rank);

    bool ok = true;
    if (check) {
      ok = check->compare(trainer, corpus, kBatch, c.steps, curve);
    } else if (c.check) {
      if (rank == 0)
        std::printf(
            "check: the reference does not model these router options; comparing with this program at one "
            "rank\n");
      ok = matches_one_rank(c, model_config, corpus, curve, trainer.skipped_steps(), rank);
    }
    if (c.check_recompute) {
      ok = gpt::recompute_matches(trainer_options(c), model_config, layout, corpus, c.steps, commgrad::world()) && ok;
    }
    if (rank == 0 && c.curve != "none" && !curve.empty()) {
      gpt::write_csv(c.curve + ".csv", curve);
      gpt::write_svg(c.curve + ".svg", curve, "gpt_train " + c.layout() + ", " + c.schedule);
      std::printf("loss curve: %s.csv, %s.svg\n", c.curve.c_str(), c.curve.c_str());
    }
    std::fflush(stdout);
    commgrad::destroy_process_group();
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "gpt_train: " << e.what() << "\n";
    return 1;
  }
}
