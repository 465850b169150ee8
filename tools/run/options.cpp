#include "options.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>

namespace commgrad::run {
namespace {

// More ranks than this on one node is a typo, not a job (each rank costs the
// launcher two file descriptors).
constexpr long kMaxProcPerNode = 1024;
constexpr long kMaxNodes = 1 << 20;
constexpr double kMaxSeconds = 1e9;

bool parse_long(const std::string& text, long min, long max, long* out) {
  if (text.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const long value = std::strtol(text.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || value < min || value > max) return false;
  *out = value;
  return true;
}

bool parse_seconds(const std::string& text, bool allow_zero, double* out) {
  if (text.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (errno != 0 || *end != '\0' || !std::isfinite(value)) return false;
  if (value < 0 || (!allow_zero && value == 0) || value > kMaxSeconds) return false;
  *out = value;
  return true;
}

ParseResult fail(std::string message) {
  ParseResult result;
  result.kind = ParseResult::Kind::kError;
  result.error = std::move(message);
  return result;
}

}  // namespace

std::string usage_text() {
  return R"(usage: commgrad-run [options] [--] program [args...]

Starts N copies (ranks) of program on this node with the torchrun variables
set: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT, and OMP_NUM_THREADS=1 unless it is already set. Inherited
OMPI_COMM_WORLD_* and SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID are removed.

options:
  -n, --nproc-per-node N  ranks to start on this node (default 1)
  --nnodes M              nodes in the job (default 1); with M > 1,
                          --master-addr and --master-port are required and
                          commgrad-run is started once on every node
  --node-rank K           this node's index in [0, M) (default 0);
                          RANK = K*N + local rank, WORLD_SIZE = M*N
  --master-addr A         address of rank 0's rendezvous (default 127.0.0.1)
  --master-port P         port of the rendezvous (default: a free port)
  --timeout S             stop the job after S seconds (fractions allowed)
                          and exit with code 124
  --grace S               seconds between SIGTERM and SIGKILL when stopping
                          ranks (default 3)
  --no-prefix             pass output through unchanged instead of prefixing
                          every line with "[RANK] "
  -h, --help              print this help and exit
  --version               print commgrad's version, the LibTorch it was
                          built against and its transports, and exit
  --                      end of options; the next word is the program

Every rank runs in its own process group with stdin from /dev/null; its
stdout and stderr lines go to the launcher's stdout and stderr.
When a rank exits non-zero or is killed, the other ranks get SIGTERM, then
SIGKILL after the grace period, and commgrad-run exits with that rank's code
(128+signal for a signal). SIGINT, SIGTERM and SIGHUP are forwarded to all
ranks and commgrad-run then exits with 128+signal. Ranks die with the launcher,
even when it is killed with SIGKILL.

exit codes: the first failing rank's code, 0 if all succeed, 2 bad usage,
  124 timeout, 126 program not executable, 127 program not found.
)";
}

ParseResult parse_options(int argc, const char* const* argv) {
  ParseResult result;
  LaunchOptions& opts = result.options;
  bool have_addr = false;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') break;  // the program

    // Split "--name=value" and "-nVALUE" into a name and an inline value.
    std::string name = arg;
    std::optional<std::string> inline_value;
    if (arg.rfind("--", 0) == 0) {
      const auto eq = arg.find('=');
      if (eq != std::string::npos) {
        name = arg.substr(0, eq);
        inline_value = arg.substr(eq + 1);
      }
    } else if (arg.size() > 2) {
      name = arg.substr(0, 2);
      inline_value = arg.substr(2);
    }

    if (name == "-h" || name == "--help") {
      if (inline_value) return fail("option '" + name + "' takes no value");
      result.kind = ParseResult::Kind::kHelp;
      return result;
    }
    if (name == "--version") {
      if (inline_value) return fail("option '--version' takes no value");
      result.kind = ParseResult::Kind::kVersion;
      return result;
    }
    if (name == "--no-prefix") {
      if (inline_value) return fail("option '--no-prefix' takes no value");
      opts.prefix = false;
      continue;
    }

    const bool known = name == "-n" || name == "--nproc-per-node" || name == "--nnodes" ||
                       name == "--node-rank" || name == "--master-addr" ||
                       name == "--master-port" || name == "--timeout" || name == "--grace";
    if (!known) return fail("unknown option '" + arg + "'");
    std::string value;
    if (inline_value) {
      value = *inline_value;
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return fail("option '" + name + "' needs a value");
    }

    long number = 0;
    const auto bad = [&](const char* what) {
      return fail("option '" + name + "' expects " + what + ", got '" + value + "'");
    };
    if (name == "-n" || name == "--nproc-per-node") {
      if (!parse_long(value, 1, kMaxProcPerNode, &number))
        return bad("an integer in [1, 1024]");
      opts.nproc_per_node = static_cast<int>(number);
    } else if (name == "--nnodes") {
      if (!parse_long(value, 1, kMaxNodes, &number)) return bad("a positive integer");
      opts.nnodes = static_cast<int>(number);
    } else if (name == "--node-rank") {
      if (!parse_long(value, 0, kMaxNodes, &number)) return bad("a non-negative integer");
      opts.node_rank = static_cast<int>(number);
    } else if (name == "--master-addr") {
      if (value.empty()) return bad("an address");
      opts.master_addr = value;
      have_addr = true;
    } else if (name == "--master-port") {
      if (!parse_long(value, 1, 65535, &number)) return bad("a port in [1, 65535]");
      opts.master_port = static_cast<int>(number);
    } else if (name == "--timeout") {
      double seconds = 0;
      if (!parse_seconds(value, /*allow_zero=*/false, &seconds))
        return bad("a positive number of seconds");
      opts.timeout_s = seconds;
    } else if (name == "--grace") {
      if (!parse_seconds(value, /*allow_zero=*/true, &opts.grace_s))
        return bad("a non-negative number of seconds");
    }
  }

  if (i >= argc) return fail("missing the program to run");
  opts.program = argv[i];
  if (opts.program.empty()) return fail("the program name is empty");
  for (++i; i < argc; ++i) opts.args.emplace_back(argv[i]);

  if (opts.nnodes > 1 && (!have_addr || !opts.master_port))
    return fail("--nnodes > 1 needs --master-addr and --master-port (the same on every node)");
  if (opts.node_rank >= opts.nnodes) {
    return fail("--node-rank " + std::to_string(opts.node_rank) + " is not in [0, " +
                std::to_string(opts.nnodes) + ")");
  }
  if (static_cast<long long>(opts.nnodes) * opts.nproc_per_node >
      std::numeric_limits<int>::max()) {
    return fail("--nnodes times --nproc-per-node is too large");
  }
  result.kind = ParseResult::Kind::kRun;
  return result;
}

}  // namespace commgrad::run
