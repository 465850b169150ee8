#pragma once
// The one way tests look at an error: its message without LibTorch's
// backtrace, and the parts it must contain.
//
// Example:
//   EXPECT_THROW_WITH(ops::all_gather(x, {}, g), "all_gather", "rank 0/2", "not divisible");
//   EXPECT_THAT(error_of([&] { f(); }), HasSubstr("..."));

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace commgrad::testing {

/// The message of the error `f` throws, without a backtrace ("(no error)"
/// when it throws none).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

/// Runs `f`, which must throw an error whose message contains every part.
inline void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  const std::string m = error_of(f);
  if (m == "(no error)") {
    ADD_FAILURE() << "no error was raised";
    return;
  }
  for (const auto& p : parts) EXPECT_NE(m.find(p), std::string::npos) << "missing '" << p << "' in: " << m;
}

}  // namespace commgrad::testing

/// Expects `statement` to throw an error whose message contains every one of
/// the remaining arguments (strings).
#define EXPECT_THROW_WITH(statement, ...) ::commgrad::testing::expect_error([&] { statement; }, {__VA_ARGS__})
