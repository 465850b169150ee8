// commgrad-run: starts the ranks of a commgrad job on this node (like
// `torchrun --no-python`), without LibTorch. See `commgrad-run --help`.

#include <cstdio>

#include "commgrad/config.h"

#include "launcher.h"
#include "options.h"

int main(int argc, char** argv) {
  using commgrad::run::ParseResult;
  const ParseResult parsed = commgrad::run::parse_options(argc, argv);
  switch (parsed.kind) {
    case ParseResult::Kind::kHelp:
      std::fputs(commgrad::run::usage_text().c_str(), stdout);
      return 0;
    case ParseResult::Kind::kVersion:
      std::puts(COMMGRAD_BUILD_INFO_STRING);
      return 0;
    case ParseResult::Kind::kError:
      std::fprintf(stderr, "commgrad-run: %s\nsee commgrad-run --help\n", parsed.error.c_str());
      return commgrad::run::kExitUsage;
    case ParseResult::Kind::kRun:
      break;
  }
  std::fflush(stdout);  // nothing buffered may be written twice by a forked child
  return commgrad::run::Launcher(parsed.options).run();
}
