#pragma once
// The command line of a program, probed as a user would: --help lists every
// option, and each bad option ends the program with exit code 2 and a message
// that names it, before any rank starts. Each case runs the program alone
// with a job of two ranks in its environment and no peer: a program that got
// as far as starting its rank would wait for the missing one and time out.

#include "harness/subprocess.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace commgrad::testing {

/// A bad command line and the text its error must contain (the option's name).
struct BadOption {
  std::vector<std::string> args;
  std::string message;
};

namespace detail {

inline std::string program_name(const std::string& path) { return path.substr(path.rfind('/') + 1); }

inline ProcessResult run_alone_in_a_job_of_two(const std::vector<std::string>& argv) {
  return run_process(argv,
                     clean_env({{"RANK", "0"},
                                {"WORLD_SIZE", "2"},
                                {"LOCAL_RANK", "0"},
                                {"LOCAL_WORLD_SIZE", "2"},
                                {"MASTER_ADDR", "127.0.0.1"},
                                {"MASTER_PORT", std::to_string(free_port())}}),
                     std::chrono::seconds(30));
}

}  // namespace detail

/// The options are parsed before LibTorch does anything, so the second
/// LibTorch line (1.13) would only repeat these cases: there they skip
/// (about a minute and a half of the test command).
#ifdef COMMGRAD_ON_SECOND_TORCH_LINE
#define COMMGRAD_COMMAND_LINE_CASES_ON_THE_DEFAULT_LINE_ONLY() \
  GTEST_SKIP() << "command-line cases run on the default LibTorch line only"
#else
#define COMMGRAD_COMMAND_LINE_CASES_ON_THE_DEFAULT_LINE_ONLY() \
  do {                                                         \
  } while (false)
#endif

/// `program --help` (and -h) exits 0 and its output names every one of `options`.
inline void expect_help_lists(const std::string& program, const std::vector<std::string>& options) {
  COMMGRAD_COMMAND_LINE_CASES_ON_THE_DEFAULT_LINE_ONLY();
  for (const std::string help : {"--help", "-h"}) {
    const ProcessResult r = detail::run_alone_in_a_job_of_two({program, help});
    EXPECT_EQ(r.exit_code, 0) << help << "\n" << r.out << r.err;
    EXPECT_TRUE(r.err.empty()) << r.err;
    for (const std::string& option : options) EXPECT_THAT(r.out, ::testing::HasSubstr(option)) << help;
  }
}

/// Each case: exit code 2, nothing on stdout, and on stderr
/// "<program>: ...<message>..." and "see <program> --help".
inline void expect_bad_options(const std::string& program, const std::vector<BadOption>& cases) {
  COMMGRAD_COMMAND_LINE_CASES_ON_THE_DEFAULT_LINE_ONLY();
  const std::string name = detail::program_name(program);
  for (const BadOption& c : cases) {
    std::vector<std::string> argv{program};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    std::string joined;
    for (const std::string& a : c.args) joined += " " + a;
    const ProcessResult r = detail::run_alone_in_a_job_of_two(argv);
    EXPECT_EQ(r.exit_code, 2) << name << joined << "\n" << r.out << r.err;
    EXPECT_THAT(r.err, ::testing::HasSubstr(name + ": ")) << joined;
    EXPECT_THAT(r.err, ::testing::HasSubstr(c.message)) << joined;
    EXPECT_THAT(r.err, ::testing::HasSubstr("see " + name + " --help")) << joined;
    EXPECT_TRUE(r.out.empty()) << joined << ": " << r.out;
  }
}

}  // namespace commgrad::testing
