// Agreement between the ranks of a save or load.
//
// A checkpoint touches files, and files fail on one rank at a time (a full
// disk, a corrupt shard one rank reads). If that rank simply threw, the
// others would wait for it in their next collective until the group's
// timeout. So every phase (validate, write, read) runs locally under a
// catch, and ends in one exchange: each rank all-gathers a status string
// ("ok" plus the phase's payload, or the error). The exchange is two
// ops::raw::all_gathers (the lengths as int64, then the bytes padded to the
// longest as uint8), a few hundred bytes per rank for a status and a few
// kilobytes for piece descriptors.

#include "detail/agree.h"

#include "commgrad/dist/check.h"
#include "commgrad/ops/raw.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>

namespace commgrad::checkpoint::detail {

std::vector<std::string> exchange_strings(const std::string& mine, const Group& group) {
  const int n = group.size();
  const at::Tensor length = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  const at::Tensor lengths = ops::raw::all_gather(length, {}, group).wait().contiguous();
  const int64_t longest = std::max<int64_t>(1, lengths.max().item<int64_t>());
  at::Tensor bytes = at::zeros({longest}, at::kByte);
  if (!mine.empty()) std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  const at::Tensor all = ops::raw::all_gather(bytes, {}, group).wait().contiguous();
  std::vector<std::string> out;
  const auto* data = static_cast<const char*>(all.data_ptr());
  const auto* len = lengths.data_ptr<int64_t>();
  for (int r = 0; r < n; ++r) out.emplace_back(data + r * longest, static_cast<size_t>(len[r]));
  return out;
}

std::vector<std::string> run_phase(const char* op, const Group& group, const std::function<std::string()>& phase) {
  const std::string prefix = c10::str("[commgrad] ", op, " ", group.describe(), ": ");
  std::string status;
  // Built piecewise: GCC 12 warns (-Wrestrict, a false positive) on "+" + std::string in C++20.
  auto failed = [&](const std::string& message) {
    status.assign(1, '-');
    if (message.rfind("[commgrad]", 0) != 0) status += prefix;
    status += message;
  };
  try {
    status.assign(1, '+');
    status += phase();
  } catch (const c10::Error& e) {
    failed(e.what_without_backtrace());
  } catch (const std::exception& e) {
    failed(e.what());
  }
  auto all = exchange_strings(status, group);
  TORCH_CHECK(status[0] == '+', status.substr(1));
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty() || all[r][0] != '+') {
      TORCH_CHECK(false, prefix, "rank ", r,
                  " failed: ", all[r].empty() ? std::string("(no status)") : all[r].substr(1));
    }
    all[r].erase(0, 1);
  }
  return all;
}

}  // namespace commgrad::checkpoint::detail
