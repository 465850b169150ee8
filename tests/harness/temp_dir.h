#pragma once
// A fresh directory path under the system's temporary directory, named after
// the running test, a tag and the pid, removed (with its contents) at the end.

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

namespace commgrad::testing {

namespace fs = std::filesystem;

class TempRoot {
 public:
  explicit TempRoot(const std::string& tag) {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("commgrad-" + std::string(info ? info->name() : "x") + "-" + tag + "-" + std::to_string(::getpid()));
    fs::remove_all(path_);
  }
  ~TempRoot() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempRoot(const TempRoot&) = delete;
  TempRoot& operator=(const TempRoot&) = delete;
  std::string str() const { return path_.string(); }
  fs::path path() const { return path_; }

 private:
  fs::path path_;
};

}  // namespace commgrad::testing
