// A rank's last word on an uncaught error (see the header).

#include "commgrad/dist/uncaught_error.h"

#include "commgrad/util/env.h"

#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <fstream>
#include <iostream>
#include <typeinfo>

namespace commgrad {
namespace {

struct Described {
  std::string summary;  // "type: message"
  std::string full;     // the summary, with LibTorch's backtrace where it has one
};

Described describe(const std::exception_ptr& error) {
  if (!error) return {"unknown error", "unknown error"};
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    const std::string type = c10::demangle(typeid(e).name());
    return {type + ": " + e.what_without_backtrace(), type + ": " + e.what()};
  } catch (const std::exception& e) {
    const std::string text = c10::demangle(typeid(e).name()) + ": " + e.what();
    return {text, text};
  } catch (...) {
  }
  return {"an exception of unknown type", "an exception of unknown type"};
}

bool backtrace_asked() { return env::get("COMMGRAD_BACKTRACE").value_or("0") == "1"; }

// torchrun's error file: {"message": {"message": ..., "extraInfo":
// {"py_callstack": ..., "timestamp": ...}}}; its agent prints py_callstack.
bool write_error_file(const std::string& path, const Described& d, const std::string& context) {
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  nlohmann::json extra = {{"py_callstack", context + (backtrace_asked() ? d.full : d.summary)},
                          {"timestamp", std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now).count())}};
  const nlohmann::json data = {{"message", {{"message", d.summary}, {"extraInfo", extra}}}};
  std::ofstream out(path, std::ios::trunc);
  out << data.dump() << "\n";
  return static_cast<bool>(out.flush());
}

}  // namespace

std::string describe_error(const std::exception_ptr& error) { return describe(error).summary; }

void report_uncaught_error(const std::exception_ptr& error, const std::string& context) {
  try {
    const Described d = describe(error);
    const std::string prefix = context.empty() ? "" : context + "\n";
    const auto file = env::get("TORCHELASTIC_ERROR_FILE");
    if (file && !file->empty() && write_error_file(*file, d, prefix)) return;
    const auto rank = env::get("RANK");
    std::cerr << prefix << "[commgrad] " << (rank ? "rank " + *rank + ": " : std::string())
              << (backtrace_asked() ? d.full : d.summary) << std::endl;
  } catch (...) {  // a dying process: say nothing rather than throw
  }
}

}  // namespace commgrad
