// build_info(): the generated configuration, checked against the LibTorch
// headers this file is compiled with.

#include "commgrad/dist/build_info.h"

#include "commgrad/config.h"

#include <torch/version.h>

#include <ostream>
#include <sstream>

static_assert(TORCH_VERSION_MAJOR == COMMGRAD_TORCH_VERSION_MAJOR &&
                  TORCH_VERSION_MINOR == COMMGRAD_TORCH_VERSION_MINOR,
              "the LibTorch headers on the include path are not those of the LibTorch CMake found");

namespace commgrad {

std::string BuildInfo::to_string() const {
  std::ostringstream out;
  out << "commgrad " << version << " (LibTorch " << torch_version << ", C++" << cxx_standard << "; transports:";
  for (const auto& t : transports) out << ' ' << t;
  out << ')';
  return out.str();
}

std::ostream& operator<<(std::ostream& out, const BuildInfo& info) { return out << info.to_string(); }

const BuildInfo& build_info() {
  static const BuildInfo info = [] {
    BuildInfo b;
    b.version = COMMGRAD_VERSION_STRING;
    b.torch_version = COMMGRAD_TORCH_VERSION_STRING;
    b.cxx_standard = COMMGRAD_CXX_STANDARD;
    std::istringstream names(COMMGRAD_TRANSPORTS);
    for (std::string name; names >> name;) b.transports.push_back(name);
    return b;
  }();
  return info;
}

}  // namespace commgrad
