// A checkpoint: a directory (one safetensors file or shards listed by
// model.safetensors.index.json, memory-mapped) or a TensorStore in memory (random weights
// generated at load). Tensors are looked up by their release names.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "io/tensor_store.h"

namespace dsv4 {

class Checkpoint {
 public:
  // Opens `dir`: model.safetensors.index.json if present (every listed shard must exist and
  // hold exactly the tensors the index assigns to it), else model.safetensors, else the only
  // *.safetensors file. Throws dsv4::Error naming the file at fault.
  explicit Checkpoint(const std::string& dir);
  // The tensors of `store`, kept alive with the checkpoint; `name` stands for the directory
  // in messages (e.g. "random weights (flash, nvfp4, seed 1)").
  Checkpoint(const std::string& name, std::shared_ptr<const TensorStore> store);

  // The directory, or an in-memory checkpoint's name.
  const std::string& dir() const { return dir_; }
  // The in-memory store, null for a directory.
  const TensorStore* store() const { return store_.get(); }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  // Throws naming the tensor if absent.
  const TensorView& get(const std::string& name) const;
  std::vector<std::string> names() const;
  size_t num_tensors() const { return where_.size(); }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::shared_ptr<const TensorStore> store_;
  std::map<std::string, const TensorView*> where_;
};

}  // namespace dsv4
