#pragma once
// The environment variables commgrad reads: one list, one way to read them.
//
// Every variable the library reads is in variables() (and in the table of
// docs/launching.md, which a test keeps in step with it), and is read only
// through get(), each in one place in the code. Reading a name that is not
// listed is a programming error and throws, so the list cannot go stale.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace commgrad::env {

/// One environment variable: its name, the values it takes and what it does.
struct Variable {
  const char* name;
  const char* values;
  const char* meaning;
};

/// Every variable commgrad reads, in the order docs/launching.md lists them.
const std::vector<Variable>& variables();

/// The value of `name`, or std::nullopt when it is unset. `name` must be in variables().
std::optional<std::string> get(const std::string& name);

/// `name` as an integer >= 0 (`unit` names what it counts in the error), or
/// std::nullopt when it is unset or empty; anything else throws, naming the
/// variable and its value.
std::optional<int64_t> get_count(const std::string& name, const char* unit);

}  // namespace commgrad::env
