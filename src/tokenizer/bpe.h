// BPE merging over token ids: a merge-rank hash table, the merge loop (a linear scan for short
// words, a heap for long ones; both pick the lowest rank, leftmost first, as tokenizers does) and
// a cache of whole words. Internal; exposed for tests.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace qt::tok {

// Open-addressing map (left id, right id) -> (rank, merged id). Fixed capacity.
class MergeTable {
 public:
  struct Merge {
    std::int32_t rank = -1;  // -1: no such merge
    std::int32_t merged = -1;
  };
  explicit MergeTable(std::size_t expected = 0);
  // False when the pair is already present (the first rank is kept).
  bool insert(std::int32_t a, std::int32_t b, Merge m);
  Merge find(std::int32_t a, std::int32_t b) const {
    const std::uint64_t key = pack(a, b);
    for (std::size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == key) return s.value;
      if (s.key == kEmpty) return {};
    }
  }
  std::size_t size() const { return size_; }

 private:
  static constexpr std::uint64_t kEmpty = ~std::uint64_t{0};
  struct Slot {
    std::uint64_t key = kEmpty;
    Merge value;
  };
  static std::uint64_t pack(std::int32_t a, std::int32_t b) {
    return (std::uint64_t{static_cast<std::uint32_t>(a)} << 32) | static_cast<std::uint32_t>(b);
  }
  static std::size_t hash(std::uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return static_cast<std::size_t>(k);
  }
  void grow();
  std::vector<Slot> slots_;
  std::size_t mask_ = 0, size_ = 0;
};

// Merges `ids` (one word's symbols) in place until no adjacent pair has a merge.
void bpe_merge_scan(const MergeTable& merges, std::vector<std::int32_t>& ids);
void bpe_merge_heap(const MergeTable& merges, std::vector<std::int32_t>& ids);
// The scan up to kHeapFrom symbols, the heap from there.
inline constexpr std::size_t kHeapFrom = 48;
void bpe_merge(const MergeTable& merges, std::vector<std::int32_t>& ids);

// Byte-level BPE of one pre-token given as raw bytes, with a word cache (thread safe).
class BpeModel {
 public:
  MergeTable merges;
  std::array<std::int32_t, 256> byte_id{};  // id of each byte's one-character token
  // ignore_merges (Llama 3 style): a word that is a vocabulary entry is taken whole.
  bool ignore_merges = false;
  std::unordered_map<std::string, std::int32_t> whole_words;  // raw bytes -> id; ignore_merges

  // Appends the ids of `word`.
  void encode_word(std::string_view word, std::vector<std::int32_t>& out) const;

 private:
  static constexpr std::size_t kCacheMaxWords = std::size_t{1} << 18;
  static constexpr std::size_t kCacheMaxBytes = 64;  // longer words are not cached
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<std::int32_t>> cache_;
};

}  // namespace qt::tok
