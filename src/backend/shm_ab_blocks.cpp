// The developer's A/B of the engine (see detail/shm_ab_blocks.h).

#include "detail/shm_ab_blocks.h"

#include <algorithm>
#include <iomanip>
#include <sstream>
#include <stdexcept>

namespace commgrad::backend::detail {

AbBlocks::AbBlocks(int64_t block) : block_(block) {
  if (block <= 0) throw std::invalid_argument("AbBlocks: the block must hold at least one collective");
}

int AbBlocks::begin(uint64_t seq, int64_t now_ns) {
  const auto block = static_cast<uint64_t>(block_);
  if (seq % block != 0) return variant_;
  // The first block holds the group's warm-up (first touches of the segment and tensors): not counted.
  if (seq >= 2 * block) per_call_ns_[static_cast<size_t>(variant_)].push_back((now_ns - block_start_ns_) / block_);
  block_start_ns_ = now_ns;
  variant_ = static_cast<int>((seq / block) % 4);
  return variant_;
}

namespace {

int64_t median(std::vector<int64_t> ns) {
  if (ns.empty()) return 0;
  std::nth_element(ns.begin(), ns.begin() + static_cast<std::ptrdiff_t>(ns.size() / 2), ns.end());
  return ns[ns.size() / 2];
}

std::vector<int64_t> joined(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  std::vector<int64_t> both = a;
  both.insert(both.end(), b.begin(), b.end());
  return both;
}

double ratio(int64_t a, int64_t b) { return b > 0 ? static_cast<double>(a) / static_cast<double>(b) : 0.0; }

}  // namespace

int64_t AbBlocks::median_ns(int v) const { return median(per_call_ns_[static_cast<size_t>(v)]); }

int64_t AbBlocks::median_a_ns() const { return median(joined(per_call_ns_[0], per_call_ns_[2])); }

int64_t AbBlocks::median_b_ns() const { return median(joined(per_call_ns_[1], per_call_ns_[3])); }

std::string AbBlocks::report(const std::string& context) const {
  std::ostringstream line;
  line << "shm A/B " << context << ": block " << block_ << ", blocks " << blocks(0) << ' ' << blocks(1) << ' '
       << blocks(2) << ' ' << blocks(3) << ", ns per collective: v0 " << median_ns(0) << " v1 " << median_ns(1)
       << " v2 " << median_ns(2) << " v3 " << median_ns(3) << ", A " << median_a_ns() << " B " << median_b_ns()
       << std::fixed << std::setprecision(3) << ", B/A " << ratio(median_b_ns(), median_a_ns()) << ", control v2/v0 "
       << ratio(median_ns(2), median_ns(0)) << " v3/v1 " << ratio(median_ns(3), median_ns(1));
  return line.str();
}

}  // namespace commgrad::backend::detail
