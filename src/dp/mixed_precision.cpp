#include "commgrad/dp/mixed_precision.h"

#include <c10/util/Exception.h>

namespace commgrad::dp {

std::string MixedPrecisionPolicy::describe() const {
  if (full_precision()) return "full precision";
  std::string out;
  auto add = [&out](const char* what, const c10::optional<at::ScalarType>& t) {
    if (!t) return;
    if (!out.empty()) out += ", ";
    out += std::string(what) + " " + c10::toString(*t);
  };
  add("param", param_dtype());
  add("reduce", reduce_dtype());
  add("output", output_dtype());
  return out;
}

void check_policy(const MixedPrecisionPolicy& policy, const char* op) {
  for (const auto& t : {policy.param_dtype(), policy.reduce_dtype(), policy.output_dtype()}) {
    TORCH_CHECK_VALUE(!t || at::isFloatingType(*t), "[commgrad] ", op, ": the mixed-precision policy (",
                      policy.describe(), ") names ", c10::toString(*t), ", which is not a floating dtype");
  }
}

double predivide_factor(int64_t world_size) {
  // FSDP's rule, kept as it is so that sums match FSDP's in 16-bit dtypes.
  int64_t factor = 1;
  while (world_size % factor == 0 && world_size / factor > factor) factor *= 2;
  return static_cast<double>(factor);
}

AverageSplit split_average(const MixedPrecisionPolicy& policy, at::ScalarType reduce_dtype, int64_t divisor) {
  if (divisor <= 1) return {};
  const bool half = reduce_dtype == at::kHalf || reduce_dtype == at::kBFloat16;
  if (!half || policy.full_precision()) return {static_cast<double>(divisor), 1.0};
  const double before = predivide_factor(divisor);
  return {before, static_cast<double>(divisor) / before};
}

}  // namespace commgrad::dp
