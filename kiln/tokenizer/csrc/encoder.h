// Encoding: pre-tokenize, then apply merges by rank inside each pre-token (merge_ref semantics:
// the lowest-ranked adjacent pair first, the leftmost occurrence on ties, one merge at a time).
#pragma once
#include <algorithm>
#include <cstdint>
#include <queue>
#include <string>
#include <tuple>
#include <vector>

#include "flat_map.h"
#include "pretokenize.h"

namespace kiln {

class Encoder {
 public:
  static constexpr uint32_t kNoRank = 0xFFFFFFFFu;

  Encoder(const std::vector<uint32_t>& byte_ids,
          const std::vector<std::tuple<uint32_t, uint32_t, uint32_t>>& merges,
          std::vector<std::string> decoder, std::vector<bool> valid, bool has_pattern,
          PatternKind kind)
      : decoder_(std::move(decoder)), valid_(std::move(valid)), has_pattern_(has_pattern), kind_(kind) {
    std::copy(byte_ids.begin(), byte_ids.end(), byte_ids_);
    rank_index_.reserve(merges.size());
    for (uint32_t r = 0; r < merges.size(); ++r) {
      auto [a, b, c] = merges[r];
      bool inserted;
      rank_index_.get_or_insert(pair_key(a, b), static_cast<uint32_t>(rank_new_.size()), &inserted);
      if (inserted) rank_new_.push_back({r, c});
    }
    // Whole pre-tokens that BPE turns into exactly one token can skip the merge loop. Only ids
    // for which that is true are listed, so the shortcut never changes a result.
    std::vector<uint32_t> out;
    for (uint32_t id = 0; id < decoder_.size(); ++id) {
      if (!valid_[id] || decoder_[id].size() < 2) continue;
      const std::string& t = decoder_[id];
      out.clear();
      bpe_slow(reinterpret_cast<const uint8_t*>(t.data()), t.size(), out);
      if (out.size() == 1 && out[0] == id) whole_.add(reinterpret_cast<const uint8_t*>(t.data()), t.size(), id);
    }
  }

  bool has_pattern() const { return has_pattern_; }

  void encode(const uint8_t* s, size_t n, std::vector<uint32_t>& out) const {
    for_each_pretoken(kind_, s, n, [&](size_t b, size_t e) { bpe(s + b, e - b, out); });
  }

  void bpe(const uint8_t* p, size_t n, std::vector<uint32_t>& out) const {
    if (n == 1) { out.push_back(byte_ids_[p[0]]); return; }
    if (const int64_t* id = whole_.find(p, n)) { out.push_back(static_cast<uint32_t>(*id)); return; }
    bpe_slow(p, n, out);
  }

  // Appends the bytes of token `id` to out; false if the id names no token.
  bool append_token(int64_t id, std::string& out) const {
    if (id < 0 || static_cast<uint64_t>(id) >= decoder_.size() || !valid_[id]) return false;
    out += decoder_[id];
    return true;
  }

 private:
  struct RankNew { uint32_t rank, id; };
  uint32_t byte_ids_[256];
  U64IndexMap rank_index_;
  std::vector<RankNew> rank_new_;
  BytesMap whole_;
  std::vector<std::string> decoder_;
  std::vector<bool> valid_;
  bool has_pattern_;
  PatternKind kind_;

  RankNew lookup(uint32_t a, uint32_t b) const {
    uint32_t k = rank_index_.get(pair_key(a, b));
    return k == U64IndexMap::kMissing ? RankNew{kNoRank, 0} : rank_new_[k];
  }

  void bpe_slow(const uint8_t* p, size_t n, std::vector<uint32_t>& out) const {
    if (n <= 256) bpe_scan(p, n, out);
    else bpe_heap(p, n, out);
  }

  // Quadratic but allocation-light: right for the short pieces that dominate real text.
  void bpe_scan(const uint8_t* p, size_t n, std::vector<uint32_t>& out) const {
    uint32_t sym[256];
    RankNew rk[256];
    size_t m = n;
    for (size_t i = 0; i < n; ++i) sym[i] = byte_ids_[p[i]];
    for (size_t i = 0; i + 1 < m; ++i) rk[i] = lookup(sym[i], sym[i + 1]);
    while (m > 1) {
      size_t best = 0;
      for (size_t i = 1; i + 1 < m; ++i)
        if (rk[i].rank < rk[best].rank) best = i;
      if (rk[best].rank == kNoRank) break;
      sym[best] = rk[best].id;
      for (size_t i = best + 1; i + 1 < m; ++i) { sym[i] = sym[i + 1]; rk[i] = rk[i + 1]; }
      --m;
      if (best > 0) rk[best - 1] = lookup(sym[best - 1], sym[best]);
      if (best + 1 < m) rk[best] = lookup(sym[best], sym[best + 1]);
    }
    out.insert(out.end(), sym, sym + m);
  }

  // O(n log n) for long pieces: a linked list of symbols and a heap of (rank, position).
  void bpe_heap(const uint8_t* p, size_t n, std::vector<uint32_t>& out) const {
    std::vector<uint32_t> sym(n);
    std::vector<int64_t> next(n), prev(n);
    std::vector<bool> alive(n, true);
    for (size_t i = 0; i < n; ++i) { sym[i] = byte_ids_[p[i]]; next[i] = i + 1 < n ? i + 1 : -1; prev[i] = int64_t(i) - 1; }
    using Item = std::pair<uint32_t, uint32_t>;  // (rank, position); min-heap
    std::priority_queue<Item, std::vector<Item>, std::greater<Item>> heap;
    for (size_t i = 0; i + 1 < n; ++i) {
      RankNew r = lookup(sym[i], sym[i + 1]);
      if (r.rank != kNoRank) heap.push({r.rank, static_cast<uint32_t>(i)});
    }
    while (!heap.empty()) {
      auto [rank, i] = heap.top();
      heap.pop();
      if (!alive[i] || next[i] < 0) continue;
      RankNew r = lookup(sym[i], sym[next[i]]);
      if (r.rank != rank) continue;
      int64_t j = next[i];
      sym[i] = r.id;
      alive[j] = false;
      next[i] = next[j];
      if (next[j] >= 0) prev[next[j]] = i;
      if (prev[i] >= 0) {
        RankNew l = lookup(sym[prev[i]], sym[i]);
        if (l.rank != kNoRank) heap.push({l.rank, static_cast<uint32_t>(prev[i])});
      }
      if (next[i] >= 0) {
        RankNew q = lookup(sym[i], sym[next[i]]);
        if (q.rank != kNoRank) heap.push({q.rank, i});
      }
    }
    for (int64_t i = 0; i >= 0; i = next[i]) out.push_back(sym[i]);
  }
};

}  // namespace kiln
