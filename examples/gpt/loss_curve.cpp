#include "loss_curve.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace gpt {
namespace {

std::ofstream open_for_writing(const std::string& path) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write " + path);
  return out;
}

// "Nice" tick positions covering [lo, hi]: 1, 2 or 5 times a power of ten apart.
std::vector<double> ticks(double lo, double hi, int wanted) {
  const double raw = (hi - lo) / std::max(wanted, 1);
  const double power = std::pow(10.0, std::floor(std::log10(raw > 0 ? raw : 1.0)));
  double step = power;
  for (double f : {2.0, 5.0, 10.0}) {
    if (step * 1.0001 >= raw) break;
    step = power * f;
  }
  std::vector<double> out;
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-6; t += step) out.push_back(t);
  return out;
}

std::string number(double v) {
  std::ostringstream s;
  s << std::setprecision(4) << v;
  return s.str();
}

}  // namespace

void write_csv(const std::string& path, const std::vector<CurvePoint>& points) {
  auto out = open_for_writing(path);
  const bool reference = !points.empty() && points.front().reference.has_value();
  out << "step,loss" << (reference ? ",one_rank_loss" : "") << "\n" << std::setprecision(9);
  for (const auto& p : points) {
    out << p.step << "," << p.loss;
    if (reference) out << "," << p.reference.value_or(std::nan(""));
    out << "\n";
  }
}

void write_svg(const std::string& path, const std::vector<CurvePoint>& points, const std::string& title) {
  constexpr double kWidth = 640, kHeight = 400, kLeft = 70, kRight = 20, kTop = 40, kBottom = 50;
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const auto& p : points) {
    lo = std::min({lo, p.loss, p.reference.value_or(p.loss)});
    hi = std::max({hi, p.loss, p.reference.value_or(p.loss)});
  }
  if (points.empty()) lo = 0, hi = 1;
  if (hi - lo < 1e-9) lo -= 0.5, hi += 0.5;
  const int first = points.empty() ? 0 : points.front().step;
  const int last = points.empty() ? 1 : std::max(points.back().step, first + 1);
  auto x = [&](double step) { return kLeft + (step - first) / (last - first) * (kWidth - kLeft - kRight); };
  auto y = [&](double loss) { return kTop + (hi - loss) / (hi - lo) * (kHeight - kTop - kBottom); };

  auto out = open_for_writing(path);
  out << std::fixed << std::setprecision(1);
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kWidth << "\" height=\"" << kHeight
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << kWidth / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">" << title << "</text>\n";
  // Axes, ticks and grid.
  out << "<g stroke=\"#888\">\n<line x1=\"" << kLeft << "\" y1=\"" << kHeight - kBottom << "\" x2=\"" << kWidth - kRight
      << "\" y2=\"" << kHeight - kBottom << "\"/>\n<line x1=\"" << kLeft << "\" y1=\"" << kTop << "\" x2=\"" << kLeft
      << "\" y2=\"" << kHeight - kBottom << "\"/>\n</g>\n";
  for (double t : ticks(lo, hi, 5)) {
    out << "<line x1=\"" << kLeft << "\" y1=\"" << y(t) << "\" x2=\"" << kWidth - kRight << "\" y2=\"" << y(t)
        << "\" stroke=\"#eee\"/>\n<text x=\"" << kLeft - 6 << "\" y=\"" << y(t) + 4 << "\" text-anchor=\"end\">"
        << number(t) << "</text>\n";
  }
  for (double t : ticks(first, last, 8)) {
    out << "<text x=\"" << x(t) << "\" y=\"" << kHeight - kBottom + 18 << "\" text-anchor=\"middle\">" << number(t)
        << "</text>\n";
  }
  out << "<text x=\"" << (kLeft + kWidth - kRight) / 2 << "\" y=\"" << kHeight - 10
      << "\" text-anchor=\"middle\">step</text>\n<text x=\"16\" y=\"" << (kTop + kHeight - kBottom) / 2
      << "\" text-anchor=\"middle\" transform=\"rotate(-90 16 " << (kTop + kHeight - kBottom) / 2
      << ")\">loss</text>\n";
  // The curves.
  auto polyline = [&](bool reference, const char* style) {
    out << "<polyline fill=\"none\" " << style << " points=\"";
    for (const auto& p : points) {
      if (reference && !p.reference) continue;
      out << x(p.step) << "," << y(reference ? *p.reference : p.loss) << " ";
    }
    out << "\"/>\n";
  };
  const bool reference = !points.empty() && points.front().reference.has_value();
  if (reference) polyline(true, "stroke=\"#d62728\" stroke-width=\"2\" stroke-dasharray=\"6 4\"");
  polyline(false, "stroke=\"#1f77b4\" stroke-width=\"1.5\"");
  // Legend.
  const double lx = kWidth - kRight - 150;
  out << "<line x1=\"" << lx << "\" y1=\"" << kTop + 10 << "\" x2=\"" << lx + 24 << "\" y2=\"" << kTop + 10
      << "\" stroke=\"#1f77b4\" stroke-width=\"1.5\"/>\n<text x=\"" << lx + 30 << "\" y=\"" << kTop + 14
      << "\">this layout</text>\n";
  if (reference) {
    out << "<line x1=\"" << lx << "\" y1=\"" << kTop + 28 << "\" x2=\"" << lx + 24 << "\" y2=\"" << kTop + 28
        << "\" stroke=\"#d62728\" stroke-width=\"2\" stroke-dasharray=\"6 4\"/>\n<text x=\"" << lx + 30 << "\" y=\""
        << kTop + 32 << "\">one rank</text>\n";
  }
  out << "</svg>\n";
}

}  // namespace gpt
