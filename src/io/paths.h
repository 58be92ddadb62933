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
/// The permissions of the file it will replace, if there is one (a 0600 weights file came back
/// 0644), else 0666 less the umask. It is created with no more than those (no window in which
/// another user may open a private file's replacement), and with them exactly when `final_mode`;
/// otherwise owner-writable as well, for a writer that opens the name again (cairo), which then
/// calls take_mode_of before the rename.
inline int create_temp_beside(const char* fn, const std::string& path, std::string& tmp, bool final_mode = true) {
  struct stat existing {};
  const bool replaces = ::stat(path.c_str(), &existing) == 0 && S_ISREG(existing.st_mode);
  const mode_t at_open = replaces ? (existing.st_mode & 0777) | (final_mode ? 0 : 0600) : 0666;
  for (int attempt = 0; attempt < 64; ++attempt) {
    tmp = temp_path_beside(path);
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, at_open);
    if (fd >= 0) {
      if (replaces && final_mode) (void)::fchmod(fd, existing.st_mode & 0777);  // the umask left out
      return fd;
    }
    if (errno != EEXIST) fail(fn, ": ", path, ": cannot create ", tmp, ": ", std::strerror(errno));
  }
  fail(fn, ": ", path, ": cannot create a temporary file beside it: 64 names taken (", tmp, " the last)");
}

/// Gives `tmp` the permissions of the file at `path` it is about to replace (if any): for a
/// temporary made with create_temp_beside(…, final_mode = false) once its writer is done.
inline void take_mode_of(const std::string& path, const std::string& tmp) {
  struct stat existing {};
  if (::stat(path.c_str(), &existing) == 0 && S_ISREG(existing.st_mode))
    (void)::chmod(tmp.c_str(), existing.st_mode & 0777);
}

}  // namespace mha::io::detail
