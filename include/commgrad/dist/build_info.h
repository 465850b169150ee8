#pragma once
// What this build of commgrad is: its version, the LibTorch it was built
// against, the C++ standard and the transports compiled in. The same line
// is printed by `commgrad-run --version` and at the start of the examples.

#include <iosfwd>
#include <string>
#include <vector>

namespace commgrad {

struct BuildInfo {
  std::string version;                  // commgrad's, e.g. "0.2.0"
  std::string torch_version;            // the LibTorch built against, e.g. "2.15.0"
  int cxx_standard = 17;                // 17, or 20 for LibTorch 2.14 and later
  std::vector<std::string> transports;  // "gloo", "shm", and "nccl" with a CUDA LibTorch

  /// "commgrad 0.2.0 (LibTorch 2.15.0, C++20; transports: gloo shm nccl)".
  std::string to_string() const;
};

/// Writes info.to_string().
///
/// Example:
///   std::cout << commgrad::build_info() << std::endl;
std::ostream& operator<<(std::ostream& out, const BuildInfo& info);

/// This build's facts (from the generated commgrad/config.h).
const BuildInfo& build_info();

}  // namespace commgrad
