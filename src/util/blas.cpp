#include "commgrad/util/blas.h"

#include <ATen/Version.h>

#include <dlfcn.h>

#include <fstream>

namespace commgrad {

std::string active_blas() {
  // OpenBLAS exports its configuration string; find it in whatever is loaded.
  using ConfigFn = char* (*)();
  if (auto fn = reinterpret_cast<ConfigFn>(dlsym(RTLD_DEFAULT, "openblas_get_config"))) {
    return std::string("OpenBLAS (") + fn() + ")";
  }
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("libblas.so") != std::string::npos) {
      const std::string path = line.substr(line.find('/'));
      if (path.find("openblas") != std::string::npos) return "OpenBLAS (" + path + ")";
      if (path.find("blis") != std::string::npos) return "BLIS (" + path + ")";
      if (path.find("atlas") != std::string::npos) return "ATLAS (" + path + ")";
      return "reference BLAS, about 20x slower than OpenBLAS (" + path + ")";
    }
    if (line.find("libmkl") != std::string::npos) return "MKL";
  }
  // PyPI's x86-64 wheels link MKL into libtorch_cpu itself; their build
  // configuration says so.
  const std::string config = at::show_config();
  const std::string key = "BLAS_INFO=";
  const auto at = config.find(key);
  if (at != std::string::npos) {
    const size_t from = at + key.size();
    const std::string name = config.substr(from, config.find_first_of(", \n", from) - from);
    if (name == "mkl") return "MKL (built into LibTorch)";
    return name + " (built into LibTorch)";
  }
  return "unknown BLAS";
}

int set_blas_threads(int threads) {
  // Looked up at run time: LibTorch links whichever BLAS the system selects.
  using SetFn = void (*)(int);
  using GetFn = int (*)();
  auto set = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  auto get = reinterpret_cast<GetFn>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  if (set == nullptr || get == nullptr) return 0;
  set(threads);
  return get();
}

}  // namespace commgrad
