// The environment variables: the list in util/env.cpp, the table in
// docs/launching.md and the code that reads them stay in step.

#include <commgrad/util/env.h>

#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace commgrad::testing {
namespace {

namespace fs = std::filesystem;

std::string read_file(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string trim(const std::string& s) {
  const auto a = s.find_first_not_of(' ');
  const auto b = s.find_last_not_of(' ');
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

// The rows "| `NAME` | values | meaning |" of the table under "## Environment variables".
std::vector<env::Variable> documented() {
  static std::vector<std::string> storage;  // keeps the rows' text alive
  const std::string doc = read_file(fs::path(COMMGRAD_SOURCE_DIR) / "docs" / "launching.md");
  const auto start = doc.find("## Environment variables");
  EXPECT_NE(start, std::string::npos) << "docs/launching.md has no section '## Environment variables'";
  std::istringstream in(doc.substr(start));
  std::vector<std::vector<std::string>> rows;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("| `", 0) != 0) {
      if (!rows.empty() && line.empty()) break;  // the end of the table
      continue;
    }
    std::vector<std::string> cells;
    std::istringstream cols(line.substr(1));
    for (std::string cell; std::getline(cols, cell, '|');) cells.push_back(trim(cell));
    if (cells.size() >= 3) rows.push_back({cells[0].substr(1, cells[0].size() - 2), cells[1], cells[2]});
  }
  storage.clear();
  for (const auto& r : rows) storage.insert(storage.end(), r.begin(), r.end());
  std::vector<env::Variable> out;
  for (size_t i = 0; i + 2 < storage.size(); i += 3) {
    out.push_back({storage[i].c_str(), storage[i + 1].c_str(), storage[i + 2].c_str()});
  }
  return out;
}

TEST(EnvTest, DocumentedTableIsTheListInTheCode) {
  const auto docs = documented();
  const auto& code = env::variables();
  ASSERT_EQ(docs.size(), code.size()) << "docs/launching.md and src/util/env.cpp list different variables";
  for (size_t i = 0; i < code.size(); ++i) {
    EXPECT_EQ(std::string(docs[i].name), code[i].name) << "row " << i;
    EXPECT_EQ(std::string(docs[i].values), code[i].values) << code[i].name;
    EXPECT_EQ(std::string(docs[i].meaning), code[i].meaning) << code[i].name;
  }
}

// Nothing in the library reads the environment around env::get(), so the
// list is every variable the library reads.
TEST(EnvTest, OnlyTheHelperReadsTheEnvironment) {
  std::vector<std::string> offenders;
  for (const char* dir : {"src", "include"}) {
    for (const auto& entry : fs::recursive_directory_iterator(fs::path(COMMGRAD_SOURCE_DIR) / dir)) {
      if (!entry.is_regular_file()) continue;
      const auto path = entry.path();
      if (path.filename() == "env.cpp") continue;
      if (read_file(path).find("getenv(") != std::string::npos) offenders.push_back(path.string());
    }
  }
  EXPECT_THAT(offenders, ::testing::IsEmpty());
}

TEST(EnvTest, EveryNameReadIsListed) {
  EXPECT_THROW(env::get("COMMGRAD_NO_SUCH_VARIABLE"), c10::Error);
  for (const auto& v : env::variables()) EXPECT_NO_THROW(env::get(v.name)) << v.name;
}

TEST(EnvTest, CountsAreCheckedAndNamed) {
  ::setenv("COMMGRAD_SHM_SPIN_US", "12", 1);
  EXPECT_EQ(env::get_count("COMMGRAD_SHM_SPIN_US", "microseconds"), 12);
  ::setenv("COMMGRAD_SHM_SPIN_US", "", 1);
  EXPECT_EQ(env::get_count("COMMGRAD_SHM_SPIN_US", "microseconds"), std::nullopt);
  for (const char* bad : {"abc", "-1", "3x"}) {
    ::setenv("COMMGRAD_SHM_SPIN_US", bad, 1);
    try {
      env::get_count("COMMGRAD_SHM_SPIN_US", "microseconds");
      ADD_FAILURE() << bad << " was accepted";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), ::testing::HasSubstr(std::string("COMMGRAD_SHM_SPIN_US='") + bad +
                                                                   "' is not a number of microseconds"));
    }
  }
  ::unsetenv("COMMGRAD_SHM_SPIN_US");
  EXPECT_EQ(env::get_count("COMMGRAD_SHM_SPIN_US", "microseconds"), std::nullopt);
}

}  // namespace
}  // namespace commgrad::testing
