#pragma once
// Durable file operations of the checkpoint layer (POSIX): whole-file writes
// that reach the disk before they return, atomic replacement by rename, and
// the fsync of a directory that makes a rename itself durable.

#include <cstdint>
#include <string>

namespace commgrad::checkpoint::detail {

/// Writes `bytes` into a new file `path` (truncating one that exists) and
/// fsyncs it. Throws, naming the path and errno's message.
void write_file_durably(const std::string& path, const std::string& bytes);

/// Replaces `path` atomically: writes `bytes` to `path`.tmp, fsyncs it,
/// renames it over `path` and fsyncs the directory. A crash at any point
/// leaves either the old or the new content, never a mix.
void replace_file_atomically(const std::string& path, const std::string& bytes);

/// fsync of a directory (makes the renames and creations inside it durable).
void fsync_directory(const std::string& path);

/// Renames directory `from` to `to`. When `to` exists, the two are exchanged
/// atomically (renameat2 RENAME_EXCHANGE; two renames where the filesystem
/// lacks it) and the old `to` is removed afterwards.
void rename_directory_into_place(const std::string& from, const std::string& to);

/// The whole content of `path`; throws naming the path when it cannot be read.
std::string read_whole_file(const std::string& path);

/// errno's message for the last failed call ("No such file or directory").
std::string errno_message();

/// Writes all of `data` to `fd`, retrying after signals; on failure closes
/// `fd` and throws naming `path`.
void write_all(int fd, const void* data, size_t size, const std::string& path);

}  // namespace commgrad::checkpoint::detail
