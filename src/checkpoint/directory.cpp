// Step directories, the `latest` pointer, and cleaning up after crashes.
//
// Names are fixed-width (step-%08lld) so that a directory listing sorts by
// step. Only a directory named exactly like that and holding index.json is
// a complete step: everything a save writes before it is done lives in a
// hidden ".step-N.partial" directory, which the next save removes.

#include "commgrad/checkpoint/directory.h"

#include "detail/directory.h"
#include "detail/files.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <filesystem>

namespace commgrad::checkpoint {

namespace fs = std::filesystem;

std::string step_directory_name(int64_t step) {
  TORCH_CHECK(step >= 0, "[commgrad] checkpoint: steps are non-negative, got ", step);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%08" PRId64, step);
  return buf;
}

namespace detail {

int64_t parse_step_name(const std::string& name) {
  constexpr size_t kPrefix = 5;  // "step-"
  if (name.size() < kPrefix + 8 || name.compare(0, kPrefix, "step-") != 0) return -1;
  int64_t step = 0;
  for (size_t i = kPrefix; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || step > INT64_MAX / 10 - 9) return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

std::string partial_directory_name(int64_t step) { return "." + step_directory_name(step) + ".partial"; }

int remove_stale_partials(const std::string& root) {
  int removed = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    const bool partial = name.rfind(".step-", 0) == 0 &&
                         (name.find(".partial") != std::string::npos || name.find(".old") != std::string::npos);
    if (!partial) continue;
    fs::remove_all(e.path(), ec);
    ++removed;
  }
  return removed;
}

void prune_steps(const std::string& root, int64_t keep, int64_t current) {
  if (keep <= 0) return;
  auto steps = saved_steps(root);
  const int64_t excess = static_cast<int64_t>(steps.size()) - keep;
  std::error_code ec;
  for (int64_t i = 0, removed = 0; i < static_cast<int64_t>(steps.size()) && removed < excess; ++i) {
    if (steps[i] == current) continue;
    fs::remove_all(fs::path(root) / step_directory_name(steps[i]), ec);
    ++removed;
  }
}

}  // namespace detail

std::optional<int64_t> latest_step(const std::string& root) {
  const fs::path path = fs::path(root) / kLatestFileName;
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  std::string text = detail::read_whole_file(path.string());
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  const int64_t step = detail::parse_step_name(text);
  TORCH_CHECK(step >= 0, "[commgrad] checkpoint: ", path.string(), " does not name a step directory (it holds '",
              text.substr(0, 64), "')");
  return step;
}

std::vector<int64_t> saved_steps(const std::string& root) {
  std::vector<int64_t> steps;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const int64_t step = detail::parse_step_name(e.path().filename().string());
    if (step >= 0 && fs::exists(e.path() / kIndexFileName, ec)) steps.push_back(step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

}  // namespace commgrad::checkpoint
