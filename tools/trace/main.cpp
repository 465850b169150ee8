// commgrad-trace: reads the flight-recorder dumps of a job (one JSON file per
// rank, written on a timeout, a failure, SIGUSR2 or dump_flight_recorder())
// and prints which ranks wait in which collective, which rank is behind and
// which called a different collective. See docs/flight_recorder.md.

#include <iostream>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "diagnosis.h"
#include "dumps.h"

int main(int argc, char** argv) {
  std::string dir;
  commgrad::cli::App app("commgrad-trace", "Diagnoses a stuck or failed job from its flight-recorder dumps.");
  app.add_option("dir", dir, "the directory of the dumps (COMMGRAD_TRACE_DIR of the job)")->required();
  if (const auto code = commgrad::cli::parse(app, argc, argv)) return *code;

  std::vector<std::string> problems;
  const auto dumps = commgrad::trace::read_dumps(dir, problems);
  for (const auto& p : problems) std::cerr << "commgrad-trace: skipped " << p << "\n";
  if (dumps.empty()) {
    std::cerr << "commgrad-trace: no flight records (rank_<r>.json) in " << dir << "\n";
    return 1;
  }
  for (const auto& line : commgrad::trace::diagnose(dumps)) std::cout << line << "\n";
  return 0;
}
