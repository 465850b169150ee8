// The source tree's layout rules (STYLE.md, "Lessons from the first review"):
// every public header of a layer has a source of the same name in that
// layer's folder, or is header-only by design; no source grows past ~600
// lines; no layer above backend/ names a concrete transport, and none above
// dist/ names a backend or makes a store (groups come from dist/: new_group,
// self_group, the parallel layout).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace commgrad::testing {
namespace {

namespace fs = std::filesystem;

const fs::path kRoot(COMMGRAD_SOURCE_DIR);

std::string read_file(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<fs::path> files_under(const fs::path& dir, const std::string& extension) {
  std::vector<fs::path> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file() && e.path().extension() == extension) out.push_back(e.path());
  }
  return out;
}

TEST(LayoutTest, EveryLayerHeaderHasItsSource) {
  // Headers that hold only declarations of types and inline code.
  const std::set<std::string> header_only = {"ops/options.h", "detail/torch_compat.h"};
  std::vector<std::string> unpaired;
  for (const auto& header : files_under(kRoot / "include" / "commgrad", ".h")) {
    const auto relative = fs::relative(header, kRoot / "include" / "commgrad");
    if (relative.parent_path().empty()) continue;  // umbrella headers (commgrad.h, tp.h, ...)
    if (header_only.count(relative.generic_string())) continue;
    const auto source = kRoot / "src" / relative.parent_path() / relative.filename().replace_extension(".cpp");
    if (!fs::exists(source)) unpaired.push_back(relative.generic_string());
  }
  EXPECT_THAT(unpaired, ::testing::IsEmpty()) << "headers without a source of the same name";
}

TEST(LayoutTest, NoSourceIsOverSixHundredLines) {
  std::vector<std::string> long_files;
  for (const char* ext : {".cpp", ".h"}) {
    for (const auto& f : files_under(kRoot / "src", ext)) {
      const auto text = read_file(f);
      const auto lines = std::count(text.begin(), text.end(), '\n');
      if (lines > 620) long_files.push_back(fs::relative(f, kRoot).generic_string() + " " + std::to_string(lines));
    }
  }
  EXPECT_THAT(long_files, ::testing::IsEmpty());
}

// Upper layers ask a transport for its capabilities (Group::capabilities)
// and reach it through ops::raw, never around it.
TEST(LayoutTest, UpperLayersReachTheWireOnlyThroughOps) {
  std::vector<std::string> offenders;
  for (const char* layer : {"ops", "cp", "dp", "tp", "optim", "fsdp", "pp", "check", "checkpoint"}) {
    for (const char* ext : {".cpp", ".h"}) {
      auto files = files_under(kRoot / "src" / layer, ext);
      for (const auto& header : files_under(kRoot / "include" / "commgrad" / layer, ext)) files.push_back(header);
      for (const auto& f : files) {
        const auto text = read_file(f);
        const auto name = fs::relative(f, kRoot).generic_string();
        if (text.find("ShmProcessGroup") != std::string::npos) offenders.push_back(name + ": ShmProcessGroup");
        if (std::string(layer) != "ops" && text.find("transport(") != std::string::npos) {
          offenders.push_back(name + ": transport()");
        }
        for (const char* backend_word : {"\"gloo\"", "\"shm\"", "\"nccl\"", "HashStore", "TCPStore", "FileStore"}) {
          if (text.find(backend_word) != std::string::npos) offenders.push_back(name + ": " + backend_word);
        }
      }
    }
  }
  EXPECT_THAT(offenders, ::testing::IsEmpty());
}

}  // namespace
}  // namespace commgrad::testing
