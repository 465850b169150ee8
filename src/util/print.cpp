// Python-style tensor printing.
//
// This follows torch/_tensor_str.py with the default print options
// (precision 4, threshold 1000, edgeitems 3, linewidth 80): one formatter is
// chosen for the whole tensor from its non-zero finite values (integer mode
// "4.", fixed "0.1000" or scientific "1.0000e+10"), every element is padded to
// the widest one, and rows wrap at 80 columns under the opening bracket.

#include "commgrad/util/print.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <vector>

namespace commgrad {
namespace {

constexpr int kPrecision = 4;
constexpr int64_t kThreshold = 1000;
constexpr int64_t kEdgeItems = 3;
constexpr int kLineWidth = 80;

std::string printf_double(const char* fmt, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), fmt, v);
  return buf;
}

// Keeps only the first and last kEdgeItems along every dimension (the
// elements that a summarised print shows), so the formatter sees only them.
at::Tensor summarized_data(const at::Tensor& t) {
  if (t.dim() == 0) return t;
  if (t.dim() == 1) {
    if (t.size(0) > 2 * kEdgeItems) {
      return at::cat({t.slice(0, 0, kEdgeItems), t.slice(0, t.size(0) - kEdgeItems)});
    }
    return t;
  }
  std::vector<at::Tensor> parts;
  if (t.size(0) > 2 * kEdgeItems) {
    for (int64_t i = 0; i < kEdgeItems; ++i) parts.push_back(summarized_data(t[i]));
    for (int64_t i = t.size(0) - kEdgeItems; i < t.size(0); ++i) parts.push_back(summarized_data(t[i]));
  } else {
    for (int64_t i = 0; i < t.size(0); ++i) parts.push_back(summarized_data(t[i]));
  }
  return at::stack(parts);
}

class Formatter {
 public:
  explicit Formatter(const at::Tensor& t) : floating_(t.is_floating_point()) {
    at::Tensor flat = t.reshape(-1);
    if (!floating_) {
      for (int64_t i = 0; i < flat.numel(); ++i) {
        max_width_ = std::max<int>(max_width_, int(raw(flat[i]).size()));
      }
      return;
    }
    at::Tensor d = flat.to(at::kDouble);
    at::Tensor vals = d.masked_select(at::isfinite(d) & d.ne(0));
    if (vals.numel() == 0) return;
    at::Tensor abs = vals.abs();
    const double lo = abs.min().item<double>();
    const double hi = abs.max().item<double>();
    int_mode_ = vals.eq(vals.ceil()).all().item<bool>();
    const bool wide_range = hi / lo > 1000.0 || hi > 1.0e8;
    sci_mode_ = int_mode_ ? wide_range : (wide_range || lo < 1.0e-4);
    auto acc = vals.accessor<double, 1>();
    for (int64_t i = 0; i < vals.numel(); ++i) {
      int w;
      if (sci_mode_) {
        w = int(printf_double("%.4e", acc[i]).size());
      } else if (int_mode_) {
        w = int(printf_double("%.0f", acc[i]).size()) + 1;
      } else {
        w = int(printf_double("%.4f", acc[i]).size());
      }
      max_width_ = std::max(max_width_, w);
    }
  }

  int width() const { return max_width_; }

  std::string format(const at::Tensor& scalar) const {
    std::string s = raw(scalar);
    if (int(s.size()) < max_width_) s.insert(0, max_width_ - s.size(), ' ');
    return s;
  }

 private:
  std::string raw(const at::Tensor& scalar) const {
    if (scalar.scalar_type() == at::kBool) return scalar.item<bool>() ? "True" : "False";
    if (!floating_) return std::to_string(scalar.item<int64_t>());
    const double v = scalar.item<double>();
    if (std::isnan(v)) return "nan";
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
    if (sci_mode_) return printf_double("%.4e", v);
    if (int_mode_) return printf_double("%.0f", v) + ".";
    return printf_double("%.4f", v);
  }

  bool floating_;
  bool int_mode_ = true;
  bool sci_mode_ = false;
  int max_width_ = 1;
};

std::string vector_str(const at::Tensor& t, int indent, bool summarize, const Formatter& f) {
  const int element_length = f.width() + 2;
  const int per_line = std::max(1, (kLineWidth - indent) / element_length);
  std::vector<std::string> data;
  const int64_t n = t.size(0);
  if (summarize && n > 2 * kEdgeItems) {
    for (int64_t i = 0; i < kEdgeItems; ++i) data.push_back(f.format(t[i]));
    data.push_back(" ...");
    for (int64_t i = n - kEdgeItems; i < n; ++i) data.push_back(f.format(t[i]));
  } else {
    for (int64_t i = 0; i < n; ++i) data.push_back(f.format(t[i]));
  }
  std::string out = "[";
  for (size_t i = 0; i < data.size(); ++i) {
    if (i > 0) {
      out += (i % per_line == 0) ? ",\n" + std::string(indent + 1, ' ') : ", ";
    }
    out += data[i];
  }
  return out + "]";
}

std::string tensor_str(const at::Tensor& t, int indent, bool summarize, const Formatter& f) {
  if (t.dim() == 0) return f.format(t);
  if (t.dim() == 1) return vector_str(t, indent, summarize, f);
  std::vector<std::string> slices;
  const int64_t n = t.size(0);
  if (summarize && n > 2 * kEdgeItems) {
    for (int64_t i = 0; i < kEdgeItems; ++i) slices.push_back(tensor_str(t[i], indent + 1, summarize, f));
    slices.push_back("...");
    for (int64_t i = n - kEdgeItems; i < n; ++i) slices.push_back(tensor_str(t[i], indent + 1, summarize, f));
  } else {
    for (int64_t i = 0; i < n; ++i) slices.push_back(tensor_str(t[i], indent + 1, summarize, f));
  }
  const std::string sep = "," + std::string(t.dim() - 1, '\n') + std::string(indent + 1, ' ');
  std::string out = "[";
  for (size_t i = 0; i < slices.size(); ++i) {
    if (i > 0) out += sep;
    out += slices[i];
  }
  return out + "]";
}

// Python's repr of a dtype: "torch.float32".
std::string torch_dtype_name(at::ScalarType type) { return std::string("torch.") + dtype_name(type); }

std::string shape_tuple(at::IntArrayRef sizes) {
  std::string s = "(";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(sizes[i]);
  }
  if (sizes.size() == 1) s += ",";
  return s + ")";
}

// C++ custom functions are named "torch::autograd::CppNode<ns::AllReduce>";
// Python calls the same node "AllReduceBackward".
std::string grad_fn_name(std::string name) {
  const std::string node = "CppNode<";
  const auto pos = name.find(node);
  if (pos == std::string::npos) return name;
  name = name.substr(pos + node.size());
  if (!name.empty() && name.back() == '>') name.pop_back();
  const auto colon = name.rfind("::");
  if (colon != std::string::npos) name = name.substr(colon + 2);
  return name + "Backward";
}

}  // namespace

std::string format_tensor(const at::Tensor& t) {
  if (!t.defined()) return "None";
  const std::string prefix = "tensor(";
  const int indent = int(prefix.size());
  std::vector<std::string> suffixes;
  // As Python, the device comes first (and only when it is not the CPU).
  if (!t.is_cpu()) suffixes.push_back(c10::str("device='", t.device(), "'"));
  std::string body;
  // Values only: printing must not record autograd history.
  at::Tensor data = t.detach().cpu();
  if (data.scalar_type() == at::kHalf || data.scalar_type() == at::kBFloat16) data = data.to(at::kFloat);
  if (t.numel() == 0) {
    if (t.dim() != 1) suffixes.push_back("size=" + shape_tuple(t.sizes()));
    if (t.scalar_type() != at::kFloat) suffixes.push_back("dtype=" + torch_dtype_name(t.scalar_type()));
    body = "[]";
  } else {
    const bool summarize = t.numel() > kThreshold;
    Formatter f(summarize ? summarized_data(data) : data);
    body = tensor_str(data, indent, summarize, f);
    const auto type = t.scalar_type();
    if (type != at::kFloat && type != at::kLong && type != at::kBool) {
      suffixes.push_back("dtype=" + torch_dtype_name(type));
    }
  }
  if (t.grad_fn()) {
    suffixes.push_back("grad_fn=<" + grad_fn_name(t.grad_fn()->name()) + ">");
  } else if (t.requires_grad()) {
    suffixes.push_back("requires_grad=True");
  }
  std::string out = prefix + body;
  // As _add_suffixes in torch/_tensor_str.py (rfind gives -1 there when there is no newline).
  const size_t newline = out.rfind('\n');
  size_t last_line = newline == std::string::npos ? out.size() + 2 : out.size() - newline + 1;
  for (const auto& suffix : suffixes) {
    if (last_line + suffix.size() + 2 > size_t(kLineWidth)) {
      out += ",\n" + std::string(indent, ' ') + suffix;
      last_line = indent + suffix.size();
    } else {
      out += ", " + suffix;
      last_line += suffix.size() + 2;
    }
  }
  return out + ")";
}

std::ostream& operator<<(std::ostream& os, const PythonRepr& repr) { return os << format_tensor(repr.tensor); }

std::string format_ranks(const std::vector<int>& ranks) {
  // Appended piecewise: "[" + Join(...) + "]" trips GCC 12's -Wrestrict false positive in C++20.
  std::string out = "[";
  out += c10::Join(", ", ranks);
  out += ']';
  return out;
}

}  // namespace commgrad
