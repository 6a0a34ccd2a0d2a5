// Output files written safely: the bytes go to a temporary file in the target's directory,
// which is renamed over the target only once complete. Only a regular file or a new path is
// ever replaced: a directory, symbolic link, FIFO, device or socket at the path is refused
// with a one-line dsv4::Error before anything is written, and the temporary never outlives
// the writer (it is removed on every failure).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace dsv4 {

// Throws unless `path` names a regular file or nothing, in an existing directory.
void check_output_path(const std::string& path);

class OutputFile {
 public:
  // Checks the path (check_output_path) and creates the temporary beside it.
  explicit OutputFile(const std::string& path);
  ~OutputFile();  // removes the temporary unless commit() succeeded
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  void write(const void* data, size_t bytes);
  // Flushes the data to disk and renames the temporary over the target.
  void commit();
  const std::string& path() const { return path_; }

 private:
  void discard();
  std::string path_, tmp_;
  int fd_ = -1;
  unsigned mode_ = 0644;
};

// The whole file at once.
void write_output_file(const std::string& path, std::string_view bytes);

}  // namespace dsv4
