#pragma once
// Command-line options of every commgrad program (the examples, the
// benchmarks, commgrad-run and commgrad-bench): CLI11 with one set of house
// rules, so that every program takes its options the same way.
//
//   --name VALUE and --name=VALUE (short names: -n VALUE, -nVALUE); -h, --help
//   lists every option with its default; a flag takes no value (--check=1 is
//   an error); a repeated option keeps its last value.
//
// A bad command line ends the program before it starts a rank or builds a
// model, with two lines on stderr and exit code 2:
//
//   gpt_train: --microbatches: expected an integer in [1, 2147483647], got '0'
//   see gpt_train --help
//
// Example:
//   int steps = 10;
//   commgrad::cli::App app("gpt_train", "A small GPT trained TP x PP x DP.");
//   app.add_option("--steps", steps, "steps to train")->check(commgrad::cli::positive<int>());
//   if (auto code = commgrad::cli::parse(app, argc, argv)) return *code;
//
// Header-only (CLI11 is too); programs link the commgrad_cli target, the
// library does not.

#include <CLI/CLI.hpp>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace commgrad::cli {

/// Exit code of a bad command line (as commgrad-run, torchrun and most Unix tools).
constexpr int kExitUsage = 2;

namespace detail {

// The whole of `text` as a decimal integer in [lo, hi] (no sign games, no trailing junk).
template <class T>
bool parse_integer(const std::string& text, T lo, T hi, T* out) {
  static_assert(std::is_integral<T>::value, "an integer type");
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return false;
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || value < static_cast<long long>(lo) || value > static_cast<long long>(hi)) {
    return false;
  }
  *out = static_cast<T>(value);
  return true;
}

inline std::string got(const std::string& text) { return ", got '" + text + "'"; }

// "--flag=value" for a flag is an error that names the flag (CLI11's own
// message drops the dashes). Stops where the options end: at "--", and at
// the first word that is neither an option nor an option's value when the
// rest belongs to a program (prefix_command).
inline void reject_flag_values(const CLI::App& app, int argc, const char* const* argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") return;
    if (arg.size() < 2 || arg[0] != '-') {
      if (app.get_prefix_command()) return;
      continue;
    }
    const bool is_long = arg.rfind("--", 0) == 0;
    const auto eq = is_long ? arg.find('=') : std::string::npos;
    const std::string name = is_long ? arg.substr(0, eq) : arg.substr(0, 2);
    const CLI::Option* option = app.get_option_no_throw(name);
    if (option == nullptr) continue;
    if (option->get_expected_max() == 0) {
      if (eq != std::string::npos) throw CLI::ArgumentMismatch(name + " takes no value, got '" + arg + "'");
    } else if (eq == std::string::npos && arg.size() == name.size()) {
      ++i;  // its value
    }
  }
}

}  // namespace detail

/// A CLI11 application with the house rules. `program` is the name its
/// messages start with (not argv[0], which may be a path).
class App : public CLI::App {
 public:
  App(std::string program, std::string description) : CLI::App(std::move(description), std::move(program)) {
    option_defaults()->disable_flag_override()->always_capture_default()->multi_option_policy(
        CLI::MultiOptionPolicy::TakeLast);
    get_formatter()->column_width(32);
  }
};

/// The message of a bad command line found after parsing (two options that
/// do not go together): throw it from the program's check and `parse` prints
/// it as it prints CLI11's own.
inline CLI::ValidationError usage_error(const std::string& message) { return CLI::ValidationError(message); }

/// Prints "<program>: <message>" and "see <program> --help" to stderr and
/// returns kExitUsage.
inline int report_usage_error(const CLI::App& app, const std::string& message) {
  std::cerr << app.get_name() << ": " << message << "\nsee " << app.get_name() << " --help\n";
  return kExitUsage;
}

/// Parses argv, then runs `check` (which may throw usage_error). Returns the
/// exit code when the program should end here: 0 after --help (or
/// --version) printed to stdout, kExitUsage after a bad command line
/// (reported on stderr); nothing when the program should go on.
template <class Check>
std::optional<int> parse(CLI::App& app, int argc, const char* const* argv, Check&& check) {
  try {
    detail::reject_flag_values(app, argc, argv);
    app.parse(argc, argv);
    check();
  } catch (const CLI::ExtrasError&) {
    // CLI11 lists every extra word (last first); name the first one.
    const std::vector<std::string> extras = app.remaining();
    const std::string first = extras.empty() ? std::string() : extras.front();
    const bool option = first.size() > 1 && first[0] == '-';
    return report_usage_error(app, (option ? "unknown option '" : "unexpected argument '") + first + "'");
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::CallForVersion& e) {
    std::cout << e.what() << "\n";
    return 0;
  } catch (const CLI::ParseError& e) {
    return report_usage_error(app, e.what());
  }
  return std::nullopt;
}

inline std::optional<int> parse(CLI::App& app, int argc, const char* const* argv) {
  return parse(app, argc, argv, [] {});
}

/// `text` as a decimal integer in [lo, hi] (all of it); nothing otherwise.
/// For values inside an option's value (a list, a layout).
template <class T = int>
std::optional<T> to_integer(const std::string& text, T lo = std::numeric_limits<T>::min(),
                            T hi = std::numeric_limits<T>::max()) {
  T value{};
  if (!detail::parse_integer(text, lo, hi, &value)) return std::nullopt;
  return value;
}

/// Accepts a decimal integer in [lo, hi] (the range of T by default):
/// "expected an integer in [1, 2147483647], got 'two'".
template <class T = int>
CLI::Validator integer(T lo = std::numeric_limits<T>::min(), T hi = std::numeric_limits<T>::max()) {
  const std::string range = "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  return CLI::Validator(
      [lo, hi, range](std::string& text) -> std::string {
        T value{};
        if (detail::parse_integer(text, lo, hi, &value)) return "";
        return "expected an integer in " + range + detail::got(text);
      },
      "", "integer");
}

/// A count: an integer in [1, max of T].
template <class T = int>
CLI::Validator positive() {
  return integer<T>(1);
}

/// An integer in [0, max of T].
template <class T = int>
CLI::Validator non_negative() {
  return integer<T>(0);
}

/// Accepts a finite real number > lo (or >= lo with `inclusive`) and <= hi:
/// "expected a number > 0, got 'fast'".
inline CLI::Validator number(double lo, bool inclusive, double hi = std::numeric_limits<double>::max()) {
  auto format = [](double v) {
    std::ostringstream out;
    out << v;
    return out.str();
  };
  std::string range = std::string(inclusive ? ">= " : "> ") + format(lo);
  if (hi < std::numeric_limits<double>::max()) range += " and <= " + format(hi);
  return CLI::Validator(
      [lo, inclusive, hi, range](std::string& text) -> std::string {
        errno = 0;
        char* end = nullptr;
        const double value = std::strtod(text.c_str(), &end);
        const bool ok = !text.empty() && !std::isspace(static_cast<unsigned char>(text[0])) && errno == 0 &&
                        *end == '\0' && std::isfinite(value) && (inclusive ? value >= lo : value > lo) && value <= hi;
        return ok ? "" : "expected a number " + range + detail::got(text);
      },
      "", "number");
}

/// Accepts one of `choices`: "expected one of cpu, cuda, got 'gpu'".
inline CLI::Validator one_of(std::vector<std::string> choices) {
  std::string list;
  for (const auto& c : choices) list += (list.empty() ? "" : ", ") + c;
  return CLI::Validator(
      [choices, list](std::string& text) -> std::string {
        for (const auto& c : choices) {
          if (text == c) return "";
        }
        return "expected one of " + list + detail::got(text);
      },
      "", "one_of");
}

/// `--device cpu|cuda` (default cpu) into `cuda`, the same in every program that has it.
inline CLI::Option* add_device_option(CLI::App& app, bool& cuda, const std::string& help) {
  return app
      .add_option_function<std::string>(
          "--device", [&cuda](const std::string& device) { cuda = device == "cuda"; }, help)
      ->check(one_of({"cpu", "cuda"}))
      ->type_name("cpu|cuda")
      ->default_str("cpu");
}

}  // namespace commgrad::cli
