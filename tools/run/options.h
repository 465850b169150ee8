#pragma once

// Command-line options of commgrad-run.

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace commgrad::run {

/// What `commgrad-run [options] [--] program [args...]` asked for.
///
/// Example:
///   commgrad-run -n 4 --timeout 600 ./train --lr 0.1
///   -> nproc_per_node = 4, timeout_s = 600, program = "./train",
///      args = {"--lr", "0.1"}
struct LaunchOptions {
  /// Ranks started on this node (`-n`, `--nproc-per-node`).
  int nproc_per_node = 1;
  /// Nodes in the job (`--nnodes`) and this node's index (`--node-rank`).
  int nnodes = 1;
  int node_rank = 0;
  /// `--nnodes MIN:MAX` (torchrun's elastic form): the node agents meet in a
  /// rendezvous on --master-addr:--master-port before every start, which
  /// hands out node ranks and the number of nodes of that start (between MIN
  /// and MAX; see rendezvous.h). Unset: the fixed form, --nnodes N.
  std::optional<std::pair<int, int>> elastic_nodes;
  /// Seconds the rendezvous waits for MIN nodes (`--rdzv-join-timeout`),
  /// then for more nodes once MIN joined (`--rdzv-last-call`).
  double rdzv_join_timeout_s = 600.0;
  double rdzv_last_call_s = 30.0;
  /// Rendezvous address and port; empty port means "pick a free one".
  std::string master_addr = "127.0.0.1";
  std::optional<int> master_port;
  /// Whole-job time limit in seconds (`--timeout`); unset means none.
  std::optional<double> timeout_s;
  /// Seconds between SIGTERM and SIGKILL when stopping ranks (`--grace`).
  double grace_s = 3.0;
  /// Seconds between a rank's failure and SIGTERM to the others
  /// (`--stop-delay`): ranks that are exiting anyway finish writing first.
  double stop_delay_s = 0.5;
  /// Times the whole job is started again after a rank fails
  /// (`--max-restarts`, torchrun's flag); each start sets
  /// TORCHELASTIC_RESTART_COUNT to the number of restarts before it.
  int max_restarts = 0;
  /// The job's id (`--rdzv-id`, set as TORCHELASTIC_RUN_ID): ranks of another
  /// job that reach the same rendezvous are refused. Empty: a random one on
  /// a single node; none (no check) across nodes unless given.
  std::string rdzv_id;
  /// Pass output through without the `[rank] ` prefix (`--no-prefix`).
  bool prefix = true;
  /// The program and its arguments.
  std::string program;
  std::vector<std::string> args;
};

/// Parses argv into `options` (CLI11, the house rules of tools/cli/cli.h).
/// Options stop at the first non-option word or at `--`; everything after
/// belongs to the program. Returns the exit code when commgrad-run ends here:
/// 0 after --help or --version (printed to stdout), 2 after a bad command
/// line (named on stderr, with "see commgrad-run --help").
///
/// Example:
///   LaunchOptions options;
///   if (auto code = parse_options(argc, argv, options)) return *code;
std::optional<int> parse_options(int argc, const char* const* argv, LaunchOptions& options);

}  // namespace commgrad::run
