#include "io/tensor_store.h"

#include "core/error.h"

namespace dsv4 {

void TensorStore::check_new(const std::string& name) const {
  DSV4_CHECK(!views_.count(name), "tensor store: duplicate tensor '", name, "'");
}

void TensorStore::add(const std::string& name, DType dtype, std::vector<int64_t> shape,
                      std::vector<uint8_t> bytes) {
  check_new(name);
  TensorView v;
  v.name = name;
  v.dtype = dtype;
  v.shape = std::move(shape);
  DSV4_CHECK(v.numel() >= 0 && uint64_t(v.numel()) * dtype_size(dtype) == bytes.size(),
             "tensor store: tensor '", name, "' shape ", shape_str(v.shape), " of ",
             dtype_name(dtype), " does not match ", bytes.size(), " bytes");
  buffers_.push_back(std::move(bytes));
  v.data = buffers_.back().data();
  v.nbytes = buffers_.back().size();
  owned_bytes_ += v.nbytes;
  view_bytes_ += v.nbytes;
  views_.emplace(name, std::move(v));
}

void TensorStore::alias(const std::string& name, const std::string& of) {
  check_new(name);
  auto it = views_.find(of);
  DSV4_CHECK(it != views_.end(), "tensor store: '", name, "' aliases '", of,
             "', which is not in the store");
  TensorView v = it->second;
  v.name = name;
  view_bytes_ += v.nbytes;
  views_.emplace(name, std::move(v));
}

}  // namespace dsv4
