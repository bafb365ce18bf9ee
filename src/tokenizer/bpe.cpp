// BPE merge loops and the word cache (bpe.h).
#include "tokenizer/bpe.h"

#include <limits>
#include <queue>

namespace qt::tok {

MergeTable::MergeTable(std::size_t expected) {
  std::size_t cap = 16;
  while (cap < 2 * expected) cap *= 2;
  slots_.assign(cap, Slot{});
  mask_ = cap - 1;
}

void MergeTable::grow() {
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(old.size() * 2, Slot{});
  mask_ = slots_.size() - 1;
  size_ = 0;
  for (const Slot& s : old)
    if (s.key != kEmpty)
      insert(static_cast<std::int32_t>(s.key >> 32), static_cast<std::int32_t>(s.key), s.value);
}

bool MergeTable::insert(std::int32_t a, std::int32_t b, Merge m) {
  if (2 * (size_ + 1) > slots_.size()) grow();
  const std::uint64_t key = pack(a, b);
  for (std::size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
    Slot& s = slots_[i];
    if (s.key == key) return false;
    if (s.key == kEmpty) {
      s.key = key;
      s.value = m;
      ++size_;
      return true;
    }
  }
}

void bpe_merge_scan(const MergeTable& merges, std::vector<std::int32_t>& ids) {
  constexpr std::int32_t kNone = std::numeric_limits<std::int32_t>::max();
  // rank[i], into[i]: the merge of pair (ids[i], ids[i + 1]).
  std::vector<MergeTable::Merge> pair(ids.size() > 0 ? ids.size() - 1 : 0);
  for (std::size_t i = 0; i + 1 < ids.size(); ++i) pair[i] = merges.find(ids[i], ids[i + 1]);
  while (ids.size() > 1) {
    std::int32_t best = kNone;
    std::size_t at = 0;
    for (std::size_t i = 0; i < pair.size(); ++i)
      if (pair[i].rank >= 0 && pair[i].rank < best) best = pair[i].rank, at = i;
    if (best == kNone) break;
    ids[at] = pair[at].merged;
    ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    pair.erase(pair.begin() + static_cast<std::ptrdiff_t>(at));
    if (at > 0) pair[at - 1] = merges.find(ids[at - 1], ids[at]);
    if (at < pair.size()) pair[at] = merges.find(ids[at], ids[at + 1]);
  }
}

void bpe_merge_heap(const MergeTable& merges, std::vector<std::int32_t>& ids) {
  const int n = static_cast<int>(ids.size());
  if (n < 2) return;
  struct Cand {
    std::int32_t rank, pos, left, right;  // pair (left, right) starting at node pos
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::vector<int> prev(n), next(n);  // doubly linked list over the original positions
  for (int i = 0; i < n; ++i) prev[i] = i - 1, next[i] = i + 1 < n ? i + 1 : -1;
  std::priority_queue<Cand, std::vector<Cand>, std::greater<>> heap;
  auto push = [&](int i) {
    if (i < 0 || next[i] < 0) return;
    const auto m = merges.find(ids[i], ids[next[i]]);
    if (m.rank >= 0) heap.push({m.rank, i, ids[i], ids[next[i]]});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  std::vector<char> alive(n, 1);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    const int i = c.pos, j = next[i];
    // Stale when either node changed since the candidate was pushed.
    if (!alive[i] || j < 0 || ids[i] != c.left || ids[j] != c.right) continue;
    ids[i] = merges.find(c.left, c.right).merged;
    alive[j] = 0;
    next[i] = next[j];
    if (next[j] >= 0) prev[next[j]] = i;
    push(prev[i]);
    push(i);
  }
  std::size_t k = 0;
  for (int i = 0; i >= 0; i = next[i]) ids[k++] = ids[i];
  ids.resize(k);
}

void bpe_merge(const MergeTable& merges, std::vector<std::int32_t>& ids) {
  if (ids.size() < kHeapFrom)
    bpe_merge_scan(merges, ids);
  else
    bpe_merge_heap(merges, ids);
}

void BpeModel::encode_word(std::string_view word, std::vector<std::int32_t>& out) const {
  if (word.size() == 1) {
    out.push_back(byte_id[static_cast<unsigned char>(word[0])]);
    return;
  }
  if (ignore_merges) {
    if (auto it = whole_words.find(std::string(word)); it != whole_words.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() <= kCacheMaxBytes;
  std::string key;
  if (cacheable) {
    key.assign(word);
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (auto it = cache_.find(key); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<std::int32_t> ids(word.size());
  for (std::size_t i = 0; i < word.size(); ++i)
    ids[i] = byte_id[static_cast<unsigned char>(word[i])];
  bpe_merge(merges, ids);
  out.insert(out.end(), ids.begin(), ids.end());
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() >= kCacheMaxWords) cache_.clear();
    cache_.emplace(std::move(key), std::move(ids));
  }
}

}  // namespace qt::tok
