// Byte-level BPE over one pre-tokenized piece: the piece's bytes start as single-byte tokens and
// the adjacent pair with the lowest merge rank is merged, leftmost first, until no pair has a
// merge (HF tokenizers' BPE without dropout). Results of frequent pieces are cached.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace dsv4::tok {

class BytePairEncoder {
 public:
  // `byte_token[b]`: id of the token for the single byte b.
  explicit BytePairEncoder(const std::vector<int32_t>& byte_token);

  // Registers merge (left, right) -> merged with priority `rank` (lower merges first). A pair
  // registered again takes the later rank, as HF tokenizers' merge map does.
  void add_merge(int32_t left, int32_t right, int32_t merged, int32_t rank);

  // Appends the ids of `piece` to `out`.
  void encode(std::string_view piece, std::vector<int32_t>& out) const;

 private:
  struct Merge {
    int32_t rank, merged;
  };
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };

  const Merge* find_merge(int32_t left, int32_t right) const;
  void merge_small(std::vector<int32_t>& ids) const;
  void merge_large(std::vector<int32_t>& ids) const;

  std::vector<int32_t> byte_token_;
  std::unordered_map<uint64_t, Merge> merges_;

  // Piece -> ids. Pieces of natural text repeat a lot; the cache is bounded and cleared when
  // full. Guarded by a mutex so one tokenizer can be shared by threads.
  static constexpr size_t kCacheCapacity = 1 << 16, kMaxCachedPieceBytes = 64;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache_;
};

}  // namespace dsv4::tok
