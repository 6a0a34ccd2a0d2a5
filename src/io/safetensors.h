// safetensors files: a memory-mapped reader that validates the whole header before any
// tensor is used, and a writer.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "io/tensor_view.h"

namespace dsv4 {

// Read-only memory map of a whole file.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

class SafetensorsFile {
 public:
  // Maps `path` and validates the header: its length, that it is a JSON object, every
  // dtype, every shape against its byte range, ranges inside the file and not overlapping.
  // Throws dsv4::Error naming the file (and tensor) on any defect.
  explicit SafetensorsFile(const std::string& path);
  // The same validation of bytes the caller owns (and keeps alive); `name` stands for the
  // path in errors. For tests and the header fuzzer.
  SafetensorsFile(const std::string& name, const uint8_t* data, size_t size);

  const std::string& path() const { return path_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  // Throws if absent.
  const TensorView& get(const std::string& name) const;
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  void parse(const uint8_t* data, size_t size);

  std::unique_ptr<MappedFile> file_;  // null for caller-owned bytes
  std::string path_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Collects tensors and writes one safetensors file (header padded to 8 bytes).
class SafetensorsWriter {
 public:
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data,
           size_t nbytes);
  template <typename T>
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape,
           const std::vector<T>& v) {
    add(name, dtype, std::move(shape), v.data(), v.size() * sizeof(T));
  }
  // The bytes of tensor `name`, added earlier (throws if absent).
  const std::vector<uint8_t>& bytes(const std::string& name) const;
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  // Writes atomically (temporary file, then rename). Throws on I/O failure.
  void write(const std::string& path) const;
  size_t total_bytes() const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace dsv4
