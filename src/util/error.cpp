// The error types of util/error.h.

#include "commgrad/util/error.h"

#include <c10/util/StringUtil.h>

namespace commgrad {

const char* to_string(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument:
      return "invalid argument";
    case ErrorKind::kMismatch:
      return "mismatch";
    case ErrorKind::kPeerFailed:
      return "peer failed";
    case ErrorKind::kTimeout:
      return "timeout";
  }
  return "unknown";
}

ErrorSite make_site(std::string op, std::string where) {
  ErrorSite site;
  site.op = std::move(op);
  site.where = std::move(where);
  return site;
}

std::string Error::format(const ErrorSite& site, const std::string& detail) {
  std::string prefix = "[commgrad]";
  if (!site.op.empty()) prefix += " " + site.op;
  if (!site.where.empty()) prefix += " " + site.where;
  return site.op.empty() && site.where.empty() ? c10::str(prefix, " ", detail) : c10::str(prefix, ": ", detail);
}

InvalidArgumentError::InvalidArgumentError(c10::SourceLocation location, ErrorSite site, std::string detail,
                                           std::string message)
    : c10::Error(location, message),
      commgrad::Error(ErrorKind::kInvalidArgument, std::move(site), std::move(detail), std::move(message)) {}

MismatchError::MismatchError(c10::SourceLocation location, ErrorSite site, std::string detail, std::string message)
    : detail::DistErrorBase(location, message),
      commgrad::Error(ErrorKind::kMismatch, std::move(site), std::move(detail), std::move(message)) {}

CommunicationError::CommunicationError(c10::SourceLocation location, ErrorSite site, std::string detail,
                                       std::string message)
    : detail::DistErrorBase(location, message),
      commgrad::Error(ErrorKind::kPeerFailed, std::move(site), std::move(detail), std::move(message)) {}

TimeoutError::TimeoutError(c10::SourceLocation location, ErrorSite site, std::string detail, std::string message)
    : detail::TimeoutErrorBase(location, message),
      commgrad::Error(ErrorKind::kTimeout, std::move(site), std::move(detail), std::move(message)) {}

namespace {
[[noreturn]] void throw_kind(c10::SourceLocation location, ErrorKind kind, ErrorSite site, std::string detail,
                             std::string message) {
  switch (kind) {
    case ErrorKind::kInvalidArgument:
      throw InvalidArgumentError(location, std::move(site), std::move(detail), std::move(message));
    case ErrorKind::kMismatch:
      throw MismatchError(location, std::move(site), std::move(detail), std::move(message));
    case ErrorKind::kTimeout:
      throw TimeoutError(location, std::move(site), std::move(detail), std::move(message));
    case ErrorKind::kPeerFailed:
      break;
  }
  throw CommunicationError(location, std::move(site), std::move(detail), std::move(message));
}
}  // namespace

void detail::throw_error(c10::SourceLocation location, ErrorKind kind, ErrorSite site, std::string detail) {
  std::string message = Error::format(site, detail);
  throw_kind(location, kind, std::move(site), std::move(detail), std::move(message));
}

void detail::throw_error_message(c10::SourceLocation location, ErrorKind kind, std::string message) {
  throw_kind(location, kind, {}, message, message);
}

const Error* as_commgrad_error(const std::exception& e) { return dynamic_cast<const Error*>(&e); }

}  // namespace commgrad
