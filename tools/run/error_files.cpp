// Per-rank error files and the launcher's report of them (see the header).

#include "error_files.h"

#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

namespace commgrad::run {
namespace {

// The text of one error file: torchrun's agent prints extraInfo.py_callstack
// when there is one (commgrad puts the message there, and the backtrace
// when asked), else the message.
std::optional<std::string> read_error(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  const auto data = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!data.is_object() || !data.contains("message")) return std::nullopt;
  const auto& message = data["message"];
  if (message.is_string()) return message.get<std::string>();
  if (!message.is_object()) return std::nullopt;
  if (message.contains("extraInfo") && message["extraInfo"].contains("py_callstack") &&
      message["extraInfo"]["py_callstack"].is_string()) {
    return message["extraInfo"]["py_callstack"].get<std::string>();
  }
  if (message.contains("message") && message["message"].is_string()) return message["message"].get<std::string>();
  return std::nullopt;
}

std::string ranks_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

}  // namespace

ErrorFiles::~ErrorFiles() {
  std::error_code ignored;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
}

bool ErrorFiles::create() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/commgrad-run-errors.XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) return false;
  dir_ = pattern;
  return true;
}

std::string ErrorFiles::path_for(int rank) const {
  return dir_.empty() ? "" : dir_ + "/rank-" + std::to_string(rank) + ".json";
}

std::vector<std::string> ErrorFiles::report(const std::vector<int>& ranks, std::optional<int> first_failed) {
  struct Error {
    std::string text;  // as the first of its ranks wrote it
    std::vector<int> ranks;
  };
  std::vector<Error> errors;
  std::map<std::string, size_t> index;  // the text without the rank's number -> errors[i]
  std::vector<int> order = ranks;
  if (first_failed) {  // the first failure's error first
    order.erase(std::remove(order.begin(), order.end(), *first_failed), order.end());
    order.insert(order.begin(), *first_failed);
  }
  for (int rank : order) {
    const std::string path = path_for(rank);
    const auto text = path.empty() ? std::nullopt : read_error(path);
    if (!text) continue;
    std::remove(path.c_str());
    const auto [it, added] = index.emplace(without_own_rank(*text, rank), errors.size());
    if (added) errors.push_back({*text, {}});
    errors[it->second].ranks.push_back(rank);
  }
  std::vector<std::string> lines;
  for (auto& e : errors) {
    std::sort(e.ranks.begin() + 1, e.ranks.end());
    std::string who = "error on " + ranks_list({e.ranks.front()});
    if (first_failed && e.ranks.front() == *first_failed) who += " (the first to fail)";
    if (e.ranks.size() > 1) {
      who += ", and alike on " + ranks_list(std::vector<int>(e.ranks.begin() + 1, e.ranks.end()));
    }
    lines.push_back(who + ": " + e.text);
  }
  return lines;
}

std::string without_own_rank(const std::string& message, int rank) {
  static const std::regex own("\\brank (\\d+)");
  std::string out;
  auto begin = message.cbegin();
  for (std::sregex_iterator it(message.begin(), message.end(), own), end; it != end; ++it) {
    const auto& m = *it;
    out.append(begin, m[0].first);
    out += m[1].str() == std::to_string(rank) ? std::string("rank <r>") : m[0].str();
    begin = m[0].second;
  }
  out.append(begin, message.cend());
  return out;
}

}  // namespace commgrad::run
