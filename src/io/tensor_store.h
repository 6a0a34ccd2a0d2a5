// Tensors held in memory, for a checkpoint that is not a file (random weights generated at
// load: io/checkpoint.h's in-memory Checkpoint). A tensor either owns its bytes or views
// another tensor's (an alias: the same bytes under a second name, stored once).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "io/tensor_view.h"

namespace dsv4 {

// Where tensors go as they are made (the random-checkpoint generator writes into one): a
// safetensors writer, or a TensorStore.
class TensorSink {
 public:
  virtual ~TensorSink() = default;
  // Takes `bytes`, which must be dtype x shape's size. Throws on a duplicate name.
  virtual void add(const std::string& name, DType dtype, std::vector<int64_t> shape,
                   std::vector<uint8_t> bytes) = 0;
  // `name` holds the same dtype, shape and bytes as `of`, added earlier.
  virtual void alias(const std::string& name, const std::string& of) = 0;
  // Later tensors start a new shard (where the sink has shards).
  virtual void next_shard() {}
};

class TensorStore final : public TensorSink {
 public:
  TensorStore() = default;
  // The views point into this store's buffers: a copy's would point into the original's.
  TensorStore(const TensorStore&) = delete;
  TensorStore& operator=(const TensorStore&) = delete;
  TensorStore(TensorStore&&) = default;
  TensorStore& operator=(TensorStore&&) = default;

  void add(const std::string& name, DType dtype, std::vector<int64_t> shape,
           std::vector<uint8_t> bytes) override;
  // The alias views `of`'s bytes: nothing is copied.
  void alias(const std::string& name, const std::string& of) override;

  // Every tensor by name; the views stay valid as long as the store.
  const std::map<std::string, TensorView>& tensors() const { return views_; }
  // The bytes the store holds (each owned buffer once) and the bytes its views span (an
  // alias counted again): owned_bytes() <= view_bytes(), equal without aliases.
  size_t owned_bytes() const { return owned_bytes_; }
  size_t view_bytes() const { return view_bytes_; }

 private:
  void check_new(const std::string& name) const;

  std::deque<std::vector<uint8_t>> buffers_;  // a deque: adding never moves a buffer
  std::map<std::string, TensorView> views_;
  size_t owned_bytes_ = 0, view_bytes_ = 0;
};

}  // namespace dsv4
