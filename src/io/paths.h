// io/paths.h — what the file writers (safetensors, pictures) share about paths: a NUL byte is
// refused (the OS would see only the part before it, and write or read that file instead), and
// files are written to a short temporary name in the target's directory, then renamed into place.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>

#include "mha/error.h"

namespace mha::io::detail {

/// Fails, naming `fn`, when `path` holds a NUL byte.
inline void check_path(const char* fn, const std::string& path) {
  if (path.find('\0') != std::string::npos) fail(fn, ": the path holds a NUL byte: '", path.c_str(), "\\0…'");
}

/// A temporary name beside `path`: in its directory (so the rename stays on one file system),
/// short (the target's name plus a suffix failed for names near the 255-byte limit), and unique
/// within the process (the counter keeps two threads' writes apart).
inline std::string temp_path_beside(const std::string& path) {
  static std::atomic<uint64_t> writes{0};
  const std::string dir = std::filesystem::path(path).parent_path().string();
  return (dir.empty() ? std::string() : dir + "/") + ".mha-" + std::to_string(::getpid()) + "-" +
         std::to_string(writes.fetch_add(1)) + ".tmp";
}

/// Creates a new temporary file beside `path` (temp_path_beside) for writing and returns its
/// descriptor, its name in `tmp`. Never an existing name: O_EXCL | O_NOFOLLOW, so a file or a
/// symbolic link planted at the predictable name is neither truncated nor written through (the
/// next name is tried); fails naming `fn` and `path` when none can be made.
/// Its permissions are those of the file it will replace, if there is one, else 0666 less the
/// umask (a 0600 weights file came back 0644).
inline int create_temp_beside(const char* fn, const std::string& path, std::string& tmp) {
  for (int attempt = 0; attempt < 64; ++attempt) {
    tmp = temp_path_beside(path);
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd >= 0) {
      struct stat existing {};
      if (::stat(path.c_str(), &existing) == 0 && S_ISREG(existing.st_mode))
        (void)::fchmod(fd, existing.st_mode & 07777);
      return fd;
    }
    if (errno != EEXIST) fail(fn, ": ", path, ": cannot create ", tmp, ": ", std::strerror(errno));
  }
  fail(fn, ": ", path, ": cannot create a temporary file beside it: 64 names taken (", tmp, " the last)");
}

}  // namespace mha::io::detail
