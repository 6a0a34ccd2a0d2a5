#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/excerpt.h"
#include "io/json_keys.h"
#include "io/output_file.h"

namespace dsv4 {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DSV4_CHECK(fd >= 0, path, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    throw Error(cat(path, ": cannot stat: ", std::strerror(e)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(cat(path, ": not a regular file"));
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      throw Error(cat(path, ": mmap failed: ", std::strerror(e)));
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

namespace {

constexpr uint64_t kMaxHeaderBytes = 512ull << 20;
// Tensor names quoted in errors (real ones are under 60 characters).
constexpr size_t kNameChars = 120;

// Product of dims, or nullopt-equivalent (-1) on negative dims or overflow.
int64_t checked_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) return -1;
    n *= d;
  }
  return n;
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path)
    : file_(std::make_unique<MappedFile>(path)), path_(path) {
  parse(file_->data(), file_->size());
}

SafetensorsFile::SafetensorsFile(const std::string& name, const uint8_t* data, size_t size)
    : path_(name) {
  parse(data, size);
}

void SafetensorsFile::parse(const uint8_t* file_data, size_t size) {
  const std::string& path = path_;
  DSV4_CHECK(size >= 8, path, ": truncated safetensors file (", size,
             " bytes, shorter than the 8-byte header length)");
  uint64_t hlen = 0;
  std::memcpy(&hlen, file_data, 8);  // little-endian on every platform we build for
  DSV4_CHECK(hlen <= kMaxHeaderBytes, path, ": corrupt safetensors header length ", hlen);
  DSV4_CHECK(hlen <= size - 8, path, ": truncated safetensors file: header of ", hlen,
             " bytes but only ", size - 8, " bytes follow the length field");
  const char* hbeg = reinterpret_cast<const char*>(file_data + 8);
  nlohmann::json header;
  DuplicateKey dup;
  try {
    header = parse_json_noting_duplicates(std::string_view(hbeg, hlen), &dup);
  } catch (const nlohmann::json::exception& e) {
    throw Error(cat(path, ": safetensors header is not valid JSON: ", parser_message(e.what())));
  }
  DSV4_CHECK(header.is_object(), path, ": safetensors header is not a JSON object");
  DSV4_CHECK(dup.key.empty(), path, ": safetensors header names ",
             dup.depth == 1 ? "tensor " : "key ", excerpt(dup.key), " twice (duplicate ",
             dup.depth == 1 ? "tensor name)" : "key)");

  const uint8_t* data_start = file_data + 8 + hlen;
  const uint64_t data_len = size - 8 - hlen;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  std::vector<const std::string*> range_names;

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      DSV4_CHECK(v.is_object(), path, ": __metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        DSV4_CHECK(m.value().is_string(), path, ": __metadata__ value of ",
                   excerpt(m.key(), kNameChars), " is not a string");
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto where = [&] { return cat(path, ": tensor ", excerpt(name, kNameChars)); };
    DSV4_CHECK(v.is_object(), where(), ": entry is not an object");
    DSV4_CHECK(v.contains("dtype") && v["dtype"].is_string(), where(), ": missing dtype");
    DSV4_CHECK(v.contains("shape") && v["shape"].is_array(), where(), ": missing shape");
    DSV4_CHECK(
        v.contains("data_offsets") && v["data_offsets"].is_array() && v["data_offsets"].size() == 2,
        where(), ": missing or malformed data_offsets");
    const std::string dt = v["dtype"].get<std::string>();
    auto dtype = dtype_from_name(dt);
    DSV4_CHECK(dtype.has_value(), where(), ": unsupported dtype ", excerpt(dt));
    TensorView t;
    t.name = name;
    t.dtype = *dtype;
    for (const auto& d : v["shape"]) {
      DSV4_CHECK(d.is_number_integer() && d.get<int64_t>() >= 0, where(),
                 ": shape has a non-integer or negative dimension");
      t.shape.push_back(d.get<int64_t>());
    }
    const auto& off = v["data_offsets"];
    DSV4_CHECK(off[0].is_number_unsigned() && off[1].is_number_unsigned(), where(),
               ": data_offsets are not non-negative integers");
    uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    DSV4_CHECK(b <= e, where(), ": data_offsets [", b, ", ", e, "] are reversed");
    DSV4_CHECK(e <= data_len, where(), ": data [", b, ", ", e, ") runs past the end of the file (",
               data_len, " data bytes): truncated or corrupt file");
    int64_t numel = checked_numel(t.shape);
    DSV4_CHECK(numel >= 0, where(), ": shape ", shape_str(t.shape), " overflows");
    uint64_t expect = static_cast<uint64_t>(numel) * dtype_size(t.dtype);
    DSV4_CHECK(e - b == expect, where(), ": shape ", shape_str(t.shape), " of ", dt, " needs ",
               expect, " bytes but data_offsets span ", e - b);
    t.data = data_start + b;
    t.nbytes = e - b;
    auto [pos, inserted] = tensors_.emplace(name, std::move(t));
    DSV4_CHECK(inserted, where(), ": duplicate tensor name");
    ranges.emplace_back(b, e);
    range_names.push_back(&pos->first);
  }
  // Tensors must not share bytes.
  std::vector<size_t> order(ranges.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ranges[a] < ranges[b]; });
  for (size_t i = 1; i < order.size(); ++i) {
    const auto& prev = ranges[order[i - 1]];
    const auto& cur = ranges[order[i]];
    DSV4_CHECK(cur.first >= prev.second || cur.first == cur.second || prev.first == prev.second,
               path, ": tensors ", excerpt(*range_names[order[i - 1]], kNameChars), " and ",
               excerpt(*range_names[order[i]], kNameChars), " overlap");
  }
}

const TensorView& SafetensorsFile::get(const std::string& name) const {
  auto it = tensors_.find(name);
  DSV4_CHECK(it != tensors_.end(), path(), ": no tensor '", name, "'");
  return it->second;
}

void SafetensorsWriter::add(const std::string& name, DType dtype, std::vector<int64_t> shape,
                            const void* data, size_t nbytes) {
  int64_t numel = checked_numel(shape);
  DSV4_CHECK(numel >= 0 && static_cast<uint64_t>(numel) * dtype_size(dtype) == nbytes,
             "safetensors writer: tensor '", name, "' shape ", shape_str(shape), " of ",
             dtype_name(dtype), " does not match ", nbytes, " bytes");
  for (const auto& e : entries_)
    DSV4_CHECK(e.name != name, "safetensors writer: duplicate tensor '", name, "'");
  Entry e{name, dtype, std::move(shape), {}};
  const auto* p = static_cast<const uint8_t*>(data);
  e.bytes.assign(p, p + nbytes);
  entries_.push_back(std::move(e));
}

const std::vector<uint8_t>& SafetensorsWriter::bytes(const std::string& name) const {
  for (const auto& e : entries_)
    if (e.name == name) return e.bytes;
  throw Error(cat("safetensors writer: no tensor '", name, "'"));
}

size_t SafetensorsWriter::total_bytes() const {
  size_t n = 0;
  for (const auto& e : entries_) n += e.bytes.size();
  return n;
}

void SafetensorsWriter::write(const std::string& path) const {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  uint64_t off = 0;
  for (const auto& e : entries_) {
    header[e.name] = {{"dtype", std::string(dtype_name(e.dtype))},
                      {"shape", e.shape},
                      {"data_offsets", {off, off + e.bytes.size()}}};
    off += e.bytes.size();
  }
  std::string h = header.dump();
  while (h.size() % 8) h.push_back(' ');
  OutputFile out(path);
  const uint64_t hlen = h.size();
  out.write(&hlen, 8);
  out.write(h.data(), h.size());
  for (const auto& e : entries_) out.write(e.bytes.data(), e.bytes.size());
  out.commit();
}

}  // namespace dsv4
