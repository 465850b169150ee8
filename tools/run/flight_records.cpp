#include "flight_records.h"

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <regex>

namespace commgrad::run {
namespace {

namespace fs = std::filesystem;

bool has_records(const std::string& dir) {
  std::error_code ec;
  const std::regex name("rank_[0-9]+\\.json");
  for (const auto& f : fs::directory_iterator(dir, ec)) {
    if (std::regex_match(f.path().filename().string(), name)) return true;
  }
  return false;
}

// commgrad-trace next to this launcher, else from PATH.
std::string trace_program() {
  std::error_code ec;
  const auto self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const auto sibling = self.parent_path() / "commgrad-trace";
    if (access(sibling.c_str(), X_OK) == 0) return sibling.string();
  }
  return "commgrad-trace";
}

std::string shell_quoted(const std::string& s) {
  std::string out = "'";
  for (const char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs `commgrad-trace dir` and hands each line of its output to `report`.
void run_trace(const std::string& dir, const std::function<void(const std::string&)>& report) {
  const std::string command = shell_quoted(trace_program()) + " " + shell_quoted(dir) + " 2>&1";
  FILE* out = popen(command.c_str(), "r");
  if (out == nullptr) {
    report("cannot run commgrad-trace");
    return;
  }
  std::string line;
  for (int c = std::fgetc(out); c != EOF; c = std::fgetc(out)) {
    if (c != '\n') {
      line += static_cast<char>(c);
      continue;
    }
    report(line);
    line.clear();
  }
  if (!line.empty()) report(line);
  pclose(out);
}

}  // namespace

FlightRecords prepare_flight_records() {
  FlightRecords records;
  if (const char* dir = std::getenv("COMMGRAD_TRACE_DIR"); dir != nullptr && *dir != '\0') {
    records.dir = dir;
    return records;
  }
  // Named, not made: the ranks make it when they first write (a launcher
  // killed outright leaves nothing behind).
  const char* tmp = std::getenv("TMPDIR");
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  char name[64];
  std::snprintf(name, sizeof(name), "/commgrad-trace-%d-%llx", static_cast<int>(getpid()),
                static_cast<unsigned long long>(std::chrono::duration_cast<std::chrono::microseconds>(now).count()));
  records.dir = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + name;
  records.created = true;
  return records;
}

void finish_flight_records(const FlightRecords& records, bool failed,
                           const std::function<void(const std::string&)>& report) {
  if (records.dir.empty()) return;
  if (has_records(records.dir)) {
    if (failed) {
      report("flight records of the ranks are in " + records.dir + "; commgrad-trace says:");
      run_trace(records.dir, report);
    } else {
      report("flight records written on request are in " + records.dir);
    }
  }
  if (records.created) {
    std::error_code ec;
    fs::remove(records.dir, ec);  // only when empty
  }
}

}  // namespace commgrad::run
