// Durable writes for crash-safe checkpoints.
//
// A checkpoint is visible only through two renames: the step directory
// (written hidden, renamed into place once complete) and the `latest` file
// (written to latest.tmp, renamed over latest). POSIX makes each rename
// atomic; fsync of the file before the rename and of the directory after it
// makes the result survive a power loss, not only a killed process (the
// order torchtitan's and Orbax's checkpointers use).

#include "detail/files.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace commgrad::checkpoint::detail {

namespace fs = std::filesystem;

std::string errno_message() { return std::strerror(errno); }

void write_all(int fd, const void* data, size_t size, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string why = errno_message();
      ::close(fd);
      TORCH_CHECK(false, "cannot write ", path, ": ", why);
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
}

void write_file_durably(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "cannot create ", path, ": ", errno_message());
  write_all(fd, bytes.data(), bytes.size(), path);
  if (::fsync(fd) != 0) {
    const std::string why = errno_message();
    ::close(fd);
    TORCH_CHECK(false, "cannot fsync ", path, ": ", why);
  }
  TORCH_CHECK(::close(fd) == 0, "cannot close ", path, ": ", errno_message());
}

void fsync_directory(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open directory ", path, ": ", errno_message());
  const int rc = ::fsync(fd);
  const std::string why = rc != 0 ? errno_message() : "";
  ::close(fd);
  TORCH_CHECK(rc == 0, "cannot fsync directory ", path, ": ", why);
}

void replace_file_atomically(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp";
  write_file_durably(tmp, bytes);
  TORCH_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename ", tmp, " to ", path, ": ", errno_message());
  fsync_directory(fs::path(path).parent_path().string());
}

void rename_directory_into_place(const std::string& from, const std::string& to) {
  std::error_code ec;
  if (!fs::exists(to, ec)) {
    TORCH_CHECK(::rename(from.c_str(), to.c_str()) == 0, "cannot rename ", from, " to ", to, ": ", errno_message());
    return;
  }
  // Exchange: `to` names the new directory at every instant, then the old one
  // (now at `from`) is removed.
#ifdef SYS_renameat2
  constexpr unsigned kRenameExchange = 1u << 1;  // RENAME_EXCHANGE (linux/fs.h)
  if (::syscall(SYS_renameat2, AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), kRenameExchange) == 0) {
    fs::remove_all(from, ec);
    return;
  }
#endif
  const std::string old = from + ".old";
  fs::remove_all(old, ec);
  TORCH_CHECK(::rename(to.c_str(), old.c_str()) == 0, "cannot rename ", to, " to ", old, ": ", errno_message());
  TORCH_CHECK(::rename(from.c_str(), to.c_str()) == 0, "cannot rename ", from, " to ", to, ": ", errno_message());
  fs::remove_all(old, ec);
}

std::string read_whole_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "cannot read ", path, ": ", errno_message());
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace commgrad::checkpoint::detail
