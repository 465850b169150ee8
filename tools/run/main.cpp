// commgrad-run: starts the ranks of a commgrad job on this node (like
// `torchrun --no-python`), without LibTorch. See `commgrad-run --help`.

#include <cstdio>

#include "launcher.h"
#include "options.h"

int main(int argc, char** argv) {
  commgrad::run::LaunchOptions options;
  if (const auto code = commgrad::run::parse_options(argc, argv, options)) return *code;
  std::fflush(stdout);  // nothing buffered may be written twice by a forked child
  return commgrad::run::Launcher(options).run();
}
