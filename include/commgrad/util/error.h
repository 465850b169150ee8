#pragma once
// The errors commgrad raises, as types: what kind of failure, and where.
//
// Every error is a c10::Error, so code that catches LibTorch's errors catches
// commgrad's, and Python sees them through LibTorch's own translation: an
// invalid argument as RuntimeError, a failed transport or a disagreement
// between ranks as torch.distributed.DistBackendError, a timeout as
// torch.distributed.DistNetworkError (LibTorch 2.1+; all RuntimeError on
// 1.13). Each is also a commgrad::Error, which carries the kind and the site
// (op, this rank, the group, the collective's number): catch commgrad::Error
// to read them, or the type of one kind. docs/errors.md lists the cases.
//
// Example:
//   try {
//     ops::all_reduce(x, {}, group);
//   } catch (const commgrad::TimeoutError& e) {
//     std::cerr << "collective #" << e.site().collective << " timed out\n";
//   }

#include "commgrad/detail/torch_compat.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <string>

namespace commgrad {

/// What went wrong, and so whether the group can still be used.
enum class ErrorKind {
  kInvalidArgument,  // caught before anything reached the transport: the group works as before
  kMismatch,         // the ranks disagree (COMMGRAD_DEBUG checks); nothing was sent
  kPeerFailed,       // a transport failed half way (a peer died, a connection closed)
  kTimeout,          // a wait outlived its timeout
};

/// "invalid argument", "mismatch", "peer failed", "timeout".
const char* to_string(ErrorKind kind);

/// Where an error was raised. Fields that do not apply are empty or -1.
struct ErrorSite {
  std::string op;           // "all_gather", "DistributedDataParallel", ...
  std::string where;        // "rank 2/4 group 'tp0' (gloo)": Group::describe()
  std::string group;        // "tp0"
  int rank = -1;            // this process's rank in the group
  int group_size = -1;      // the group's size
  int64_t collective = -1;  // the collective's number in its group (#0 is the first); -1 when none
};

/// A site known only by its op and where ("rank 2/4 group 'tp0' (shm)").
ErrorSite make_site(std::string op, std::string where = {});

/// What every commgrad error carries, whatever its c10 class.
class Error {
 public:
  virtual ~Error() = default;

  ErrorKind kind() const { return kind_; }
  const ErrorSite& site() const { return site_; }
  /// What happened, without the "[commgrad] <op> <where>: " prefix.
  const std::string& detail() const { return detail_; }
  /// The whole message, without LibTorch's backtrace.
  const std::string& message() const { return message_; }
  /// True when the group the error names can still be used: nothing reached
  /// the transport (kInvalidArgument, kMismatch).
  bool group_usable() const { return kind_ == ErrorKind::kInvalidArgument || kind_ == ErrorKind::kMismatch; }

  /// "[commgrad] <op> <where>: <detail>" (the op and where left out when empty).
  static std::string format(const ErrorSite& site, const std::string& detail);

 protected:
  Error(ErrorKind kind, ErrorSite site, std::string detail, std::string message)
      : kind_(kind), site_(std::move(site)), detail_(std::move(detail)), message_(std::move(message)) {}

 private:
  ErrorKind kind_;
  ErrorSite site_;
  std::string detail_;
  std::string message_;
};

/// A bad argument, caught on the rank that passed it before its collective
/// started (c10::Error; RuntimeError in Python).
class InvalidArgumentError : public c10::Error, public commgrad::Error {
 public:
  InvalidArgumentError(c10::SourceLocation location, ErrorSite site, std::string detail, std::string message);
};

/// The ranks disagree on a collective (COMMGRAD_DEBUG's checks); nothing
/// was sent and the group is still usable.
class MismatchError : public detail::DistErrorBase, public commgrad::Error {
 public:
  MismatchError(c10::SourceLocation location, ErrorSite site, std::string detail, std::string message);
};

/// A transport that failed half way: a peer died or closed its connection,
/// or a group could not be connected. The group cannot be used any more.
class CommunicationError : public detail::DistErrorBase, public commgrad::Error {
 public:
  CommunicationError(c10::SourceLocation location, ErrorSite site, std::string detail, std::string message);
};

/// A wait that outlived its timeout (a collective, a rendezvous, a group's
/// connection). The group cannot be used any more.
class TimeoutError : public detail::TimeoutErrorBase, public commgrad::Error {
 public:
  TimeoutError(c10::SourceLocation location, ErrorSite site, std::string detail, std::string message);
};

namespace detail {
/// Throws the error class of `kind`: the message is Error::format(site, detail).
[[noreturn]] void throw_error(c10::SourceLocation location, ErrorKind kind, ErrorSite site, std::string detail);
/// Throws the error class of `kind` with a message built by the caller (no
/// site: errors raised before a group exists, or in another library's words).
[[noreturn]] void throw_error_message(c10::SourceLocation location, ErrorKind kind, std::string message);
}  // namespace detail

/// The commgrad::Error inside `e`, or nullptr when `e` is not one of ours.
const Error* as_commgrad_error(const std::exception& e);

}  // namespace commgrad

/// Throws kind `kind` (ErrorKind::k...) at `site` (an ErrorSite) with a
/// message built from the remaining arguments, as TORCH_CHECK builds one.
#define COMMGRAD_THROW(kind, site, ...)                                                                  \
  ::commgrad::detail::throw_error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, (kind), (site), \
                                  ::c10::str(__VA_ARGS__))

/// Throws kind `kind` with the message built from the arguments, as is.
#define COMMGRAD_THROW_MESSAGE(kind, ...)                                                                \
  ::commgrad::detail::throw_error_message({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, (kind), \
                                          ::c10::str(__VA_ARGS__))
