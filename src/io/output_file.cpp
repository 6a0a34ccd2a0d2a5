#include "io/output_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "core/error.h"
#include "core/excerpt.h"

namespace dsv4 {
namespace {

std::string directory_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

const char* kind_of(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISLNK(m)) return "a symbolic link";
  if (S_ISFIFO(m)) return "a FIFO (named pipe)";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

// The process umask, read without changing it (Linux reports it in /proc/self/status).
mode_t current_umask() {
  std::ifstream is("/proc/self/status");
  std::string line;
  while (std::getline(is, line))
    if (line.rfind("Umask:", 0) == 0) return mode_t(std::strtoul(line.c_str() + 6, nullptr, 8));
  return 022;
}

}  // namespace

void check_output_path(const std::string& path) {
  DSV4_CHECK(!path.empty(), "the output path is empty");
  DSV4_CHECK(path.back() != '/', excerpt(path, 200), ": names a directory, not an output file");
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    DSV4_CHECK(S_ISREG(st.st_mode), path, ": is ", kind_of(st.st_mode),
               "; dsv4 writes output only to a regular file or a new path");
    return;
  }
  const int e = errno;
  DSV4_CHECK(e == ENOENT, path, ": cannot write: ", std::strerror(e));
  const std::string dir = directory_of(path);
  DSV4_CHECK(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), path,
             ": cannot write: directory ", dir, " does not exist");
}

OutputFile::OutputFile(const std::string& path) : path_(path) {
  check_output_path(path);
  struct stat st {};
  mode_ = ::stat(path.c_str(), &st) == 0 ? (st.st_mode & 07777) : (0666 & ~current_umask());
  const std::string dir = directory_of(path);
  const std::string base =
      path.substr(path.rfind('/') == std::string::npos ? 0 : path.rfind('/') + 1);
  std::string tmpl = (dir == "/" ? "" : dir) + "/." + base + ".tmp-XXXXXX";
  fd_ = ::mkostemp(tmpl.data(), O_CLOEXEC);
  DSV4_CHECK(fd_ >= 0, path, ": cannot create a temporary file in ", dir, ": ",
             std::strerror(errno));
  tmp_ = tmpl;
}

OutputFile::~OutputFile() {
  discard();
}

void OutputFile::discard() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
  tmp_.clear();
}

void OutputFile::write(const void* data, size_t bytes) {
  DSV4_CHECK(fd_ >= 0, path_, ": write after the file was committed or discarded");
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = n < 0 ? errno : EIO;
      discard();
      throw Error(cat(path_, ": write failed: ", std::strerror(e)));
    }
    p += n;
    bytes -= size_t(n);
  }
}

void OutputFile::commit() {
  DSV4_CHECK(fd_ >= 0, path_, ": commit after the file was committed or discarded");
  auto fail = [&](const char* what) {
    const int e = errno;
    discard();
    throw Error(cat(path_, ": ", what, ": ", std::strerror(e)));
  };
  if (::fchmod(fd_, mode_) != 0) fail("cannot set the file mode");
  if (::fsync(fd_) != 0) fail("write failed");
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("write failed");
  // The target may have changed since the check: refuse anything but a regular file still.
  check_output_path(path_);
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) fail("cannot rename the temporary file");
  tmp_.clear();
}

void write_output_file(const std::string& path, std::string_view bytes) {
  OutputFile f(path);
  f.write(bytes.data(), bytes.size());
  f.commit();
}

}  // namespace dsv4
