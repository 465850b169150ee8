// Step directories, the `latest` pointer, and cleaning up after crashes.
//
// Names are fixed-width (step-%08lld) so that a directory listing sorts by
// step. Only a directory named exactly like that and holding index.json is
// a complete step: everything a save writes before it is done lives in a
// hidden ".step-N.partial" directory, which the next save removes.

#include "commgrad/checkpoint/directory.h"

#include "detail/directory.h"
#include "detail/files.h"
#include "detail/index.h"

#include "commgrad/util/logging.h"

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

std::string partial_directory_name(int64_t step) {
  // Appended piecewise: GCC 12 warns (-Wrestrict, a false positive) on "." + std::string in C++20.
  std::string name(".");
  name += step_directory_name(step);
  name += ".partial";
  return name;
}

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

void prune_before_save(const std::string& root, int64_t keep, int64_t step) {
  if (keep <= 0) return;
  std::vector<int64_t> others;
  for (const int64_t s : saved_steps(root)) {
    if (s != step) others.push_back(s);
  }
  // Never the newest: a save that fails must leave a step to resume from.
  const int64_t room = std::max<int64_t>(keep - 1, 1);
  std::error_code ec;
  for (size_t i = 0; static_cast<int64_t>(others.size() - i) > room; ++i) {
    fs::remove_all(fs::path(root) / step_directory_name(others[i]), ec);
  }
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

namespace {

// Why step directory `dir` cannot be loaded, or "" when it looks intact.
std::string damage_of(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(dir / kIndexFileName, ec)) return "it has no index.json";
  detail::Index index;
  try {
    index =
        detail::parse_index(detail::read_whole_file((dir / kIndexFileName).string()), (dir / kIndexFileName).string());
  } catch (const std::exception& e) {
    const std::string what = e.what();
    return "its index does not parse: " + what.substr(0, what.find('\n'));
  }
  for (const auto& [name, file] : index.files) {
    const auto size = fs::file_size(dir / name, ec);
    if (ec) return name + " is missing";
    if (static_cast<int64_t>(size) != file.bytes) {
      return c10::str(name, " has ", size, " bytes, the index records ", file.bytes);
    }
  }
  return "";
}

}  // namespace

LatestComplete latest_complete_step(const std::string& root) {
  LatestComplete found;
  std::vector<int64_t> candidates = saved_steps(root);
  int64_t latest = -1;  // -1: no `latest` (or one that names no step)
  try {
    latest = latest_step(root).value_or(-1);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    found.skipped.push_back("latest: " + what.substr(0, what.find('\n')));
  }
  if (latest >= 0) {
    candidates.erase(std::remove_if(candidates.begin(), candidates.end(), [&](int64_t s) { return s >= latest; }),
                     candidates.end());
    candidates.push_back(latest);
  }
  for (auto it = candidates.rbegin(); it != candidates.rend() && !found.step; ++it) {
    const std::string damage = damage_of(fs::path(root) / step_directory_name(*it));
    if (damage.empty()) {
      found.step = *it;
    } else {
      found.skipped.push_back(step_directory_name(*it) + ": " + damage);
    }
  }
  for (const auto& s : found.skipped) {
    COMMGRAD_LOG(kWarn, "checkpoint ", root, ": skipped ", s,
                 found.step ? c10::str("; resuming from step ", *found.step) : std::string("; no step is intact"));
  }
  return found;
}

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
