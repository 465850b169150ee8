#pragma once
// The loss curve of a run, written at the end as CSV (step, loss, and the
// one-rank loss with --check) and as an SVG line plot.

#include <optional>
#include <string>
#include <vector>

namespace gpt {

struct CurvePoint {
  int step = 0;
  double loss = 0;
  std::optional<double> reference;  // the one-rank loss (--check)
};

/// "step,loss[,one_rank_loss]" then one row per point. Throws when the file
/// cannot be written.
void write_csv(const std::string& path, const std::vector<CurvePoint>& points);

/// A line plot of loss against step (and the one-rank curve, dashed), with
/// axes, ticks and a legend. Throws when the file cannot be written.
void write_svg(const std::string& path, const std::vector<CurvePoint>& points, const std::string& title);

}  // namespace gpt
