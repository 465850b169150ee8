// The source tree's layout rules (STYLE.md, "Lessons from the first review"):
// every public header of a layer has a source of the same name in that
// layer's folder, or is header-only by design; no source grows past ~600
// lines; no layer above backend/ names a concrete transport, and none above
// dist/ names a backend or makes a store (groups come from dist/: new_group,
// self_group, the parallel layout); no function grows past ~80 lines.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
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
  for (const char* layer : {"ops", "cp", "dp", "tp", "optim", "fsdp", "moe", "pp", "check", "checkpoint"}) {
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

// ~~~ function length ~~~

// One line of C++ without its comments, string and character literals
// (`in_comment` carries a /* comment from line to line).
std::string code_of(const std::string& line, bool& in_comment) {
  std::string out;
  for (size_t i = 0; i < line.size(); ++i) {
    if (in_comment) {
      const auto end = line.find("*/", i);
      if (end == std::string::npos) return out;
      in_comment = false;
      i = end + 1;
    } else if (line.compare(i, 2, "//") == 0) {
      break;
    } else if (line.compare(i, 2, "/*") == 0) {
      in_comment = true;
      ++i;
    } else if (line[i] == '"' || line[i] == '\'') {
      const char quote = line[i];
      if (quote == '"' && i > 0 && line[i - 1] == 'R') {  // a raw string ends at )"
        const auto end = line.find(")\"", i);
        i = end == std::string::npos ? line.size() : end + 1;
        continue;
      }
      for (++i; i < line.size() && line[i] != quote; ++i) {
        if (line[i] == '\\') ++i;
      }
    } else {
      out += line[i];
    }
  }
  return out;
}

// What a "{" opens, from the text since the last ";", "{" or "}".
enum class Scope { kNamespace, kClass, kFunction, kOther };
Scope scope_of(const std::string& head) {
  static const std::regex kNamespace(R"(^\s*(inline\s+)?namespace\b|^\s*extern\s*$)");
  static const std::regex kClass(R"(^\s*(template\s*<[^{]*>\s*)?(class|struct|union|enum)\b[^(]*$)");
  if (std::regex_search(head, kNamespace)) return Scope::kNamespace;
  if (std::regex_search(head, kClass)) return Scope::kClass;
  const auto close = head.find_last_of(')');
  if (close != std::string::npos && head.find('=') == std::string::npos) return Scope::kFunction;
  if (close != std::string::npos && head.find(')') < head.find('=')) return Scope::kFunction;  // defaults: f(int a = 1)
  return Scope::kOther;
}

// The functions of `path` (at namespace or class scope) longer than `limit`
// lines: "file:line (n lines)".
std::vector<std::string> long_functions(const fs::path& path, int limit) {
  std::ifstream in(path);
  std::vector<std::pair<Scope, int>> open;  // scopes entered, with their first line
  std::string line, head;
  std::vector<std::string> out;
  bool in_comment = false;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t") != std::string::npos && line[line.find_first_not_of(" \t")] == '#') continue;
    for (char c : code_of(line, in_comment)) {
      if (c == '{') {
        const bool outside =
            open.empty() || open.back().first == Scope::kNamespace || open.back().first == Scope::kClass;
        open.emplace_back(outside ? scope_of(head) : Scope::kOther, number);
        head.clear();
      } else if (c == '}') {
        if (!open.empty() && open.back().first == Scope::kFunction && number - open.back().second + 1 > limit) {
          out.push_back(fs::relative(path, kRoot).generic_string() + ":" + std::to_string(open.back().second) + " (" +
                        std::to_string(number - open.back().second + 1) + " lines)");
        }
        if (!open.empty()) open.pop_back();
        head.clear();
      } else if (c == ';') {
        head.clear();
      } else {
        head += c;
      }
    }
    head += ' ';
  }
  return out;
}

TEST(LayoutTest, NoFunctionIsOverEightyLines) {
  // Known long functions (none today), each to be split along the steps its
  // comments number; an entry holds today's length, and it may only shrink.
  const std::map<std::string, int> known = {};
  std::vector<std::string> offenders;
  for (const char* dir : {"src", "tools", "examples", "bench"}) {
    for (const char* ext : {".cpp", ".h"}) {
      for (const auto& f : files_under(kRoot / dir, ext)) {
        for (const auto& entry : long_functions(f, 80)) {
          const auto at = entry.substr(0, entry.find(' '));
          const int lines = std::stoi(entry.substr(entry.find('(') + 1));
          const auto it = known.find(at);
          if (it == known.end() || lines > it->second) offenders.push_back(entry);
        }
      }
    }
  }
  EXPECT_THAT(offenders, ::testing::IsEmpty()) << "split these along their steps";
}

TEST(LayoutTest, TheFunctionLengthScanSeesThroughCommentsAndStrings) {
  const auto dir = fs::temp_directory_path() / "commgrad_layout_test";
  fs::create_directories(dir);
  const auto file = dir / "sample.cpp";
  {
    std::ofstream out(file);
    out << "namespace a {\nstruct S {\n  int f() {\n";
    for (int i = 0; i < 90; ++i) out << "    x(\"}{\"); // }\n";
    out << "  }\n};\nint g() { return 1; }\n}  // namespace a\n";
  }
  const auto found = long_functions(file, 80);
  fs::remove_all(dir);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_THAT(found[0], ::testing::HasSubstr(":3 (92 lines)"));
}

}  // namespace
}  // namespace commgrad::testing
