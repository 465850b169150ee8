#pragma once

// The files in which ranks leave their last error (TORCHELASTIC_ERROR_FILE,
// torchrun's JSON form, written by commgrad's terminate handler or by any
// torchrun-aware program), and the launcher's report of them: each distinct
// error of the job once, with the ranks it came from, so a job whose every
// rank fails alike prints one message rather than one per rank.

#include <optional>
#include <string>
#include <vector>

namespace commgrad::run {

/// A private directory of per-rank error files, removed with the object.
///
/// Example:
///   ErrorFiles errors;
///   errors.create();
///   env.push_back("TORCHELASTIC_ERROR_FILE=" + errors.path_for(rank));
///   ... the job runs ...
///   for (const auto& line : errors.report(ranks, first_failed)) print(line);
class ErrorFiles {
 public:
  ErrorFiles() = default;
  ErrorFiles(const ErrorFiles&) = delete;
  ErrorFiles& operator=(const ErrorFiles&) = delete;
  ~ErrorFiles();

  /// Makes the directory (under TMPDIR); false, with errno set, on failure.
  bool create();
  /// True once create() succeeded.
  bool created() const { return !dir_.empty(); }
  /// The file rank `rank` writes; empty when create() was not called or failed.
  std::string path_for(int rank) const;

  /// One line per distinct error left by `ranks` (errors equal but for the
  /// rank's own number are one), the one of `first_failed` first, each
  /// naming its ranks; the files read are removed. Empty when none left one.
  std::vector<std::string> report(const std::vector<int>& ranks, std::optional<int> first_failed);

 private:
  std::string dir_;
};

/// `message` with "rank <rank>" written "rank <r>", so that the same error
/// raised on two ranks compares equal.
std::string without_own_rank(const std::string& message, int rank);

}  // namespace commgrad::run
