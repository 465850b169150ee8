#include "dumps.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>

namespace commgrad::trace {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

Entry parse_entry(const json& j) {
  Entry e;
  e.record = j.at("record").get<uint64_t>();
  e.op = j.at("op").get<std::string>();
  e.group = j.at("group").get<std::string>();
  if (j.contains("group_ranks")) e.ranks = j.at("group_ranks").get<std::vector<int>>();
  e.seq = j.at("seq").get<uint64_t>();
  if (j.contains("dtype")) e.dtype = j.at("dtype").get<std::string>();
  if (j.contains("sizes")) e.sizes = j.at("sizes").get<std::vector<int64_t>>();
  e.state = j.at("state").get<std::string>();
  e.queued_us = j.at("queued_us").get<int64_t>();
  if (j.contains("finished_us") && !j.at("finished_us").is_null()) e.finished_us = j.at("finished_us").get<int64_t>();
  return e;
}

Dump parse_dump(const fs::path& path) {
  std::ifstream in(path);
  const json j = json::parse(in);
  if (j.value("format", std::string()) != "commgrad-flight-recorder") {
    throw std::runtime_error("not a commgrad flight record");
  }
  Dump d;
  d.path = path.string();
  d.rank = j.at("rank").get<int>();
  d.reason = j.value("reason", std::string());
  d.host = j.value("host", std::string());
  d.dumped_us = j.value("dumped_us", int64_t{0});
  for (const auto& e : j.at("entries")) d.entries.push_back(parse_entry(e));
  return d;
}

}  // namespace

std::string format_ranks(const std::vector<int>& ranks) {
  std::string out = "[";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out + "]";
}

std::string Entry::describe() const {
  std::string out = op + " #" + std::to_string(seq);
  if (!dtype.empty()) {
    out += " " + dtype + "[";
    for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
    out += "]";
  }
  return out;
}

std::string Entry::signature() const {
  std::string out = op + " " + dtype;
  for (const int64_t s : sizes) {
    out += ' ';
    out += std::to_string(s);
  }
  return out;
}

std::string Entry::group_key() const { return group + " " + format_ranks(ranks); }

std::vector<Dump> read_dumps(const std::string& dir, std::vector<std::string>& problems) {
  std::vector<Dump> dumps;
  std::error_code ec;
  const std::regex name("rank_[0-9]+\\.json");
  for (const auto& file : fs::directory_iterator(dir, ec)) {
    if (!file.is_regular_file() || !std::regex_match(file.path().filename().string(), name)) continue;
    try {
      dumps.push_back(parse_dump(file.path()));
    } catch (const std::exception& e) {
      problems.push_back(file.path().string() + ": " + e.what());
    }
  }
  if (ec) problems.push_back(dir + ": " + ec.message());
  std::sort(dumps.begin(), dumps.end(), [](const Dump& a, const Dump& b) { return a.rank < b.rank; });
  return dumps;
}

}  // namespace commgrad::trace
