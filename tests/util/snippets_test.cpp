// Code in the docs is code that compiles: a snippet in a Markdown file is
// marked with the file and region it quotes,
//
//   <!-- snippet: examples/getting_started/train.cpp train -->
//   ```cpp
//   ...
//   ```
//
// and must equal the lines between "// [train]" and "// [end train]" in that
// file (less their common indentation), which CMake builds and a test runs.
// Every C++ block of README.md and docs/*.md must be such a quote.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace commgrad::testing {
namespace {

namespace fs = std::filesystem;

const fs::path kRoot(COMMGRAD_SOURCE_DIR);
const std::string kMarker = "<!-- snippet: ";

std::vector<std::string> lines_of(const fs::path& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

std::string trim_right(std::string s) {
  while (!s.empty() && (s.back() == ' ' || s.back() == '\r')) s.pop_back();
  return s;
}

// A line that opens or closes a fenced block (``` after any indentation).
bool is_fence(const std::string& line) {
  const auto start = line.find_first_not_of(' ');
  return start != std::string::npos && line.compare(start, 3, "```") == 0;
}

// A fence that opens a C++ block: ```cpp, ```c++, ```cxx or ```cc (any case).
bool opens_cpp_block(const std::string& line) {
  if (!is_fence(line)) return false;
  std::string lang = trim_right(line.substr(line.find_first_not_of(' ') + 3));
  std::transform(lang.begin(), lang.end(), lang.begin(), [](unsigned char c) { return std::tolower(c); });
  return lang == "cpp" || lang == "c++" || lang == "cxx" || lang == "cc";
}

// The lines of region `name` of `file`, less their common indentation; an
// error message when the file or the region is missing.
std::vector<std::string> region(const std::string& file, const std::string& name, std::string* error) {
  const auto lines = lines_of(kRoot / file);
  if (lines.empty()) {
    *error = file + " is missing or empty";
    return {};
  }
  const auto begin = std::find_if(lines.begin(), lines.end(),
                                  [&](const std::string& l) { return ends_with(trim_right(l), "// [" + name + "]"); });
  const auto end = std::find_if(
      begin, lines.end(), [&](const std::string& l) { return ends_with(trim_right(l), "// [end " + name + "]"); });
  if (begin == lines.end() || end == lines.end()) {
    *error = file + " has no region '" + name + "' (// [" + name + "] ... // [end " + name + "])";
    return {};
  }
  std::vector<std::string> out(begin + 1, end);
  size_t indent = std::string::npos;
  for (const auto& l : out) {
    if (trim_right(l).empty()) continue;
    indent = std::min(indent, l.find_first_not_of(' '));
  }
  for (auto& l : out) l = trim_right(l).size() > indent ? trim_right(l).substr(indent) : "";
  return out;
}

std::vector<fs::path> pages() {
  std::vector<fs::path> out = {kRoot / "README.md"};
  for (const auto& e : fs::directory_iterator(kRoot / "docs")) {
    if (e.path().extension() == ".md") out.push_back(e.path());
  }
  return out;
}

TEST(SnippetsTest, QuotedCodeEqualsTheCompiledFiles) {
  int quotes = 0;
  for (const auto& page : pages()) {
    const std::string name = fs::relative(page, kRoot).generic_string();
    const auto lines = lines_of(page);
    for (size_t i = 0; i < lines.size(); ++i) {
      if (lines[i].rfind(kMarker, 0) != 0) continue;
      std::istringstream marker(lines[i].substr(kMarker.size()));
      std::string file, region_name;
      marker >> file >> region_name;
      ASSERT_LT(i + 1, lines.size()) << name;
      ASSERT_EQ(lines[i + 1], "```cpp") << name << ":" << i + 2 << ": a snippet marker must precede a ```cpp block";
      std::vector<std::string> quoted_lines;
      size_t j = i + 2;
      for (; j < lines.size() && lines[j] != "```"; ++j) quoted_lines.push_back(trim_right(lines[j]));
      std::string error;
      const auto want = region(file, region_name, &error);
      EXPECT_TRUE(error.empty()) << name << ":" << i + 1 << ": " << error;
      EXPECT_EQ(quoted_lines, want) << name << ":" << i + 1 << " quotes " << file << " region '" << region_name
                                    << "', which now reads otherwise: run scripts/update_snippets.py";
      ++quotes;
    }
  }
  EXPECT_GT(quotes, 0) << "no snippet markers found";
}

TEST(SnippetsTest, EveryCppBlockQuotesACompiledFile) {
  int blocks = 0;
  for (const auto& page : pages()) {
    const std::string name = fs::relative(page, kRoot).generic_string();
    const auto lines = lines_of(page);
    bool in_block = false;
    for (size_t i = 0; i < lines.size(); ++i) {
      if (!is_fence(lines[i])) continue;
      in_block = !in_block;
      if (!in_block) continue;  // a block's closing fence
      if (!opens_cpp_block(lines[i])) continue;
      ++blocks;
      const bool quoted = i > 0 && lines[i - 1].rfind(kMarker, 0) == 0 && lines[i] == "```cpp";
      EXPECT_TRUE(quoted) << name << ":" << i + 1 << ": a C++ block that quotes no compiled file (put a line "
                          << kMarker << "<file> <region> --> before it, with the region in <file>, and run "
                          << "scripts/update_snippets.py)";
    }
  }
  EXPECT_GT(blocks, 0) << "no C++ blocks found";
}

}  // namespace
}  // namespace commgrad::testing
