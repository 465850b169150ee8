#include "options.h"

#include "cli/cli.h"
#include "commgrad/config.h"

#include <algorithm>
#include <cctype>
#include <limits>

namespace commgrad::run {
namespace {

// More ranks than this on one node is a typo, not a job (each rank costs the
// launcher two file descriptors).
constexpr int kMaxProcPerNode = 1024;
constexpr int kMaxNodes = 1 << 20;
constexpr double kMaxSeconds = 1e9;
constexpr int kMaxRestarts = 1000000;

// The usage line names the program that follows the options.
class Formatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string name) const override {
    return "usage: " + name + " [options] [--] program [args...]\n";
  }
};

const char* const kDescription = R"(Starts N copies (ranks) of program on this node with the torchrun variables
set: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT, and OMP_NUM_THREADS=1 unless it is already set. Inherited
OMPI_COMM_WORLD_* and SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID are removed.
)";

const char* const kFooter = R"(--  ends the options; the next word is the program.

Every rank runs in its own process group with stdin from /dev/null; its
stdout and stderr lines go to the launcher's stdout and stderr.
When a rank exits non-zero or is killed, the other ranks get SIGTERM after
the stop delay (ranks exiting anyway finish writing), then SIGKILL after the
grace period, and commgrad-run exits with that rank's code
(128+signal for a signal). SIGINT, SIGTERM and SIGHUP are forwarded to all
ranks and commgrad-run then exits with 128+signal. Ranks die with the launcher,
even when it is killed with SIGKILL.

With --max-restarts K, a failed job (a rank that exits non-zero or is
killed) is stopped as above and started again, up to K times, on the same
--master-port (or a new free one); TORCHELASTIC_RESTART_COUNT tells the
ranks which start this is. A rank that exits with 75 (preempted: it saved a
checkpoint on SIGTERM/SIGUSR1) is not a failure: the job stops without a
restart and commgrad-run exits with 75.

With --nnodes MIN:MAX every node's commgrad-run joins a rendezvous at
--master-addr:--master-port (hosted by the commgrad-run that can bind that
address) before each start: it waits until MAX nodes joined, or until MIN
joined and --rdzv-last-call passed (--rdzv-join-timeout for MIN), then gives
each node its rank (GROUP_RANK; the host's is 0) and sets WORLD_SIZE to the
nodes of this start times N. A node that does not come back after a failure
is left out; fewer than MIN ends the job.

exit codes: the first failing rank's code, 0 if all succeed, 2 bad usage,
  75 preempted, 124 timeout, 126 program not executable, 127 program not found.)";

// --nnodes: "M" (an integer in [1, kMaxNodes]) or "MIN:MAX" with
// 1 <= MIN <= MAX <= kMaxNodes. The reason it is not, or "".
std::string nodes_error(std::string& text) {
  const std::string range = "[1, " + std::to_string(kMaxNodes) + "]";
  const auto colon = text.find(':');
  if (colon == std::string::npos) {
    return cli::to_integer(text, 1, kMaxNodes) ? "" : "expected an integer in " + range + ", got '" + text + "'";
  }
  const auto lo = cli::to_integer(text.substr(0, colon), 0, kMaxNodes);
  const auto hi = cli::to_integer(text.substr(colon + 1), 0, kMaxNodes);
  const std::string expected = "expected MIN:MAX with integers 1 <= MIN <= MAX <= " + std::to_string(kMaxNodes);
  if (!lo || !hi) return expected + ", got '" + text + "'";
  if (*lo < 1) return expected + ", got '" + text + "' (MIN " + std::to_string(*lo) + " < 1)";
  if (*lo > *hi) {
    return expected + ", got '" + text + "' (MIN " + std::to_string(*lo) + " > MAX " + std::to_string(*hi) + ")";
  }
  return "";
}

// Stores a valid --nnodes value (nodes_error passed it).
void set_nodes(const std::string& text, LaunchOptions& opts) {
  const auto colon = text.find(':');
  if (colon == std::string::npos) {
    opts.nnodes = *cli::to_integer(text, 1, kMaxNodes);
    opts.elastic_nodes.reset();
    return;
  }
  const int lo = *cli::to_integer(text.substr(0, colon), 1, kMaxNodes);
  const int hi = *cli::to_integer(text.substr(colon + 1), 1, kMaxNodes);
  opts.elastic_nodes = std::make_pair(lo, hi);
  opts.nnodes = hi;
}

// The elastic form's own rules: node ranks come from the rendezvous, which
// lives at --master-addr:--master-port.
void check_elastic(const CLI::App& app, const LaunchOptions& opts) {
  const auto [lo, hi] = *opts.elastic_nodes;
  const std::string nodes = "--nnodes " + std::to_string(lo) + ":" + std::to_string(hi);
  if (app.count("--node-rank") > 0) {
    throw cli::usage_error(nodes + " hands out node ranks at the rendezvous; --node-rank is not allowed with it");
  }
  if (app.count("--master-addr") == 0 || !opts.master_port) {
    throw cli::usage_error(nodes + " needs --master-addr and --master-port (the rendezvous, the same on every node)");
  }
  if (static_cast<long long>(hi) * opts.nproc_per_node > std::numeric_limits<int>::max()) {
    throw cli::usage_error("--nnodes times --nproc-per-node is too large");
  }
}

// After parsing: the program and its arguments (what CLI11 left over), and
// the checks that take more than one option.
void finish(const CLI::App& app, LaunchOptions& opts) {
  std::vector<std::string> rest = app.remaining();
  if (!rest.empty() && rest.front() != "--" && rest.front().size() > 1 && rest.front()[0] == '-') {
    throw cli::usage_error("unknown option '" + rest.front() + "'");
  }
  if (!rest.empty() && rest.front() == "--") rest.erase(rest.begin());
  if (rest.empty()) throw cli::usage_error("missing the program to run");
  opts.program = rest.front();
  if (opts.program.empty()) throw cli::usage_error("the program name is empty");
  opts.args.assign(rest.begin() + 1, rest.end());

  if (opts.elastic_nodes) {
    check_elastic(app, opts);
    return;
  }
  if (opts.nnodes > 1 && (app.count("--master-addr") == 0 || !opts.master_port)) {
    throw cli::usage_error("--nnodes > 1 needs --master-addr and --master-port (the same on every node)");
  }
  if (opts.node_rank >= opts.nnodes) {
    throw cli::usage_error("--node-rank " + std::to_string(opts.node_rank) + " is not in [0, " +
                           std::to_string(opts.nnodes) + ")");
  }
  if (static_cast<long long>(opts.nnodes) * opts.nproc_per_node > std::numeric_limits<int>::max()) {
    throw cli::usage_error("--nnodes times --nproc-per-node is too large");
  }
}

}  // namespace

std::optional<int> parse_options(int argc, const char* const* argv, LaunchOptions& opts) {
  cli::App app("commgrad-run", kDescription);
  app.formatter(std::make_shared<Formatter>());
  app.get_formatter()->column_width(32);
  app.footer(kFooter);
  // torchrun's spellings: -n is commgrad-run's short form of --nproc-per-node.
  app.add_option("-n,--nproc-per-node", opts.nproc_per_node, "ranks to start on this node")
      ->type_name("N")
      ->check(cli::integer(1, kMaxProcPerNode));
  app.add_option_function<std::string>(
         "--nnodes", [&opts](const std::string& text) { set_nodes(text, opts); },
         "nodes in the job; with M > 1, --master-addr and --master-port\n"
         "are required and commgrad-run is started once on every node;\n"
         "MIN:MAX: elastic, node ranks handed out by a rendezvous\nbefore every start (torchrun's form)")
      ->type_name("M|MIN:MAX")
      ->check(CLI::Validator(nodes_error, "", "nodes"));
  app.add_option("--node-rank", opts.node_rank,
                 "this node's index in [0, M);\nRANK = K*N + local rank, WORLD_SIZE = M*N")
      ->type_name("K")
      ->check(cli::integer(0, kMaxNodes));
  app.add_option("--master-addr", opts.master_addr, "address of rank 0's rendezvous")
      ->type_name("A")
      ->check(CLI::Validator([](std::string& a) { return a.empty() ? std::string("expected an address, got ''") : ""; },
                             "", "address"));
  app.add_option_function<int>(
         "--master-port", [&opts](const int& port) { opts.master_port = port; },
         "port of the rendezvous (default: a free port)")
      ->type_name("P")
      ->check(cli::integer(1, 65535));
  app.add_option_function<double>(
         "--timeout", [&opts](const double& s) { opts.timeout_s = s; },
         "stop the job after S seconds (fractions allowed)\nand exit with code 124")
      ->type_name("S")
      ->check(cli::number(0, /*inclusive=*/false, kMaxSeconds));
  app.add_option("--grace", opts.grace_s, "seconds between SIGTERM and SIGKILL when stopping ranks")
      ->type_name("S")
      ->check(cli::number(0, /*inclusive=*/true, kMaxSeconds));
  app.add_option("--stop-delay", opts.stop_delay_s,
                 "seconds between a rank's failure and SIGTERM to the others\n(default 0.5: ranks exiting anyway "
                 "finish writing)")
      ->type_name("S")
      ->check(cli::number(0, /*inclusive=*/true, kMaxSeconds));
  app.add_option("--max-restarts", opts.max_restarts,
                 "start the whole job again, up to K times, when a rank fails\n"
                 "(TORCHELASTIC_RESTART_COUNT counts the restarts)")
      ->type_name("K")
      ->check(cli::integer(0, kMaxRestarts));
  app.add_option("--rdzv-id", opts.rdzv_id,
                 "the job's id (TORCHELASTIC_RUN_ID; the same on every node):\n"
                 "ranks of another job at the same port are refused\n(default: a random one on a single node)")
      ->type_name("ID")
      ->check(CLI::Validator(
          [](std::string& id) {
            const bool plain = !id.empty() && id.size() <= 64 && std::all_of(id.begin(), id.end(), [](char c) {
              return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
            });
            return plain ? std::string() : "expected letters, digits and '_' (at most 64), got '" + id + "'";
          },
          "", "job id"));
  app.add_option("--rdzv-join-timeout", opts.rdzv_join_timeout_s,
                 "with --nnodes MIN:MAX: seconds to wait for MIN nodes\nat each start (default 600)")
      ->type_name("S")
      ->check(cli::number(0, /*inclusive=*/false, kMaxSeconds));
  app.add_option("--rdzv-last-call", opts.rdzv_last_call_s,
                 "with --nnodes MIN:MAX: seconds to wait for more nodes\nonce MIN joined (default 30)")
      ->type_name("S")
      ->check(cli::number(0, /*inclusive=*/true, kMaxSeconds));
  app.add_flag_callback(
      "--no-prefix", [&opts] { opts.prefix = false; },
      "pass output through unchanged instead of prefixing\nevery line with \"[RANK] \"");
  app.set_version_flag("--version", COMMGRAD_BUILD_INFO_STRING,
                       "print commgrad's version, the LibTorch it was built\nagainst and its transports, and exit");
  app.prefix_command();  // the first word that is not an option starts the program's own arguments
  return cli::parse(app, argc, argv, [&] { finish(app, opts); });
}

}  // namespace commgrad::run
