// The BPE merge loop with incremental pair counts; same semantics as merge_ref.py.
//
// Words are the unique pre-tokens as id sequences, each with its count. For every pair we keep
// its weighted count and the (append-only, possibly stale) list of words that may hold it; a lazy
// max-heap orders pairs by (count, bytes of first token, bytes of second token). Existing pairs'
// counts only fall after they are pushed; pairs with the merged token are pushed once their count
// is final, at the end of the merge, so a popped entry whose count is current is the true maximum.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "flat_map.h"

namespace kiln {

class MergeEngine {
 public:
  MergeEngine(const std::vector<std::string>& words, const std::vector<int64_t>& counts) {
    vocab_.reserve(65536);
    for (int b = 0; b < 256; ++b) {
      vocab_.emplace_back(1, static_cast<char>(b));
      id_of_.emplace(vocab_.back(), b);
    }
    words_.resize(words.size());
    counts_ = counts;
    stamp_.assign(words.size(), 0);
    for (size_t w = 0; w < words.size(); ++w) {
      const std::string& s = words[w];
      auto& ids = words_[w];
      ids.reserve(s.size());
      for (unsigned char c : s) ids.push_back(c);
      for (size_t k = 0; k + 1 < ids.size(); ++k) {
        PairInfo& info = pair(ids[k], ids[k + 1]);
        info.count += counts_[w];
        if (info.where.empty() || info.where.back() != w) info.where.push_back(static_cast<uint32_t>(w));
      }
    }
    for (uint32_t p = 0; p < pairs_.size(); ++p)
      if (pairs_[p].count > 0) heap_.push_back({pairs_[p].count, p});
    std::make_heap(heap_.begin(), heap_.end(), Less{this});
  }

  size_t vocab_size() const { return vocab_.size(); }
  const std::string& token(uint32_t id) const { return vocab_.at(id); }

  // Merges the pair (a, b) in every word; returns the id of the merged token.
  uint32_t apply(uint32_t a, uint32_t b) {
    std::string merged = vocab_[a] + vocab_[b];
    uint32_t new_id;
    auto found = id_of_.find(merged);
    if (found != id_of_.end()) {
      new_id = found->second;
    } else {
      new_id = static_cast<uint32_t>(vocab_.size());
      id_of_.emplace(merged, new_id);
      vocab_.push_back(std::move(merged));
    }
    uint32_t p = pair_index_.get(pair_key(a, b));
    if (p == U64IndexMap::kMissing) return new_id;
    std::vector<uint32_t> where;
    where.swap(pairs_[p].where);
    ++epoch_;
    touched_.clear();
    for (uint32_t w : where) {
      if (stamp_[w] == epoch_) continue;
      stamp_[w] = epoch_;
      merge_in_word(w, a, b, new_id);
    }
    pairs_[p].count = 0;
    std::sort(touched_.begin(), touched_.end());
    touched_.erase(std::unique(touched_.begin(), touched_.end()), touched_.end());
    for (uint32_t t : touched_) {
      if (pairs_[t].count > 0) {
        heap_.push_back({pairs_[t].count, t});
        std::push_heap(heap_.begin(), heap_.end(), Less{this});
      }
    }
    return new_id;
  }

  // Learns up to max_merges merges while the vocab has fewer than max_vocab tokens.
  std::vector<std::pair<uint32_t, uint32_t>> step(size_t max_merges, size_t max_vocab) {
    std::vector<std::pair<uint32_t, uint32_t>> done;
    while (done.size() < max_merges && vocab_.size() < max_vocab) {
      int64_t best = -1;
      while (!heap_.empty()) {
        std::pop_heap(heap_.begin(), heap_.end(), Less{this});
        Entry top = heap_.back();
        heap_.pop_back();
        int64_t current = pairs_[top.pair].count;
        if (current == top.count) { best = top.pair; break; }
        if (current > 0) {
          heap_.push_back({current, top.pair});
          std::push_heap(heap_.begin(), heap_.end(), Less{this});
        }
      }
      if (best < 0) break;
      uint32_t a = pairs_[best].a, b = pairs_[best].b;
      apply(a, b);
      done.emplace_back(a, b);
    }
    return done;
  }

 private:
  struct PairInfo {
    uint32_t a, b;
    int64_t count = 0;
    std::vector<uint32_t> where;
  };
  struct Entry {
    int64_t count;
    uint32_t pair;
  };
  struct Less {  // heap order: higher count, then greater (bytes(a), bytes(b)), comes first
    const MergeEngine* e;
    bool operator()(const Entry& x, const Entry& y) const {
      if (x.count != y.count) return x.count < y.count;
      const PairInfo& px = e->pairs_[x.pair];
      const PairInfo& py = e->pairs_[y.pair];
      int c = e->vocab_[px.a].compare(e->vocab_[py.a]);
      if (c != 0) return c < 0;
      return e->vocab_[px.b].compare(e->vocab_[py.b]) < 0;
    }
  };

  std::vector<std::string> vocab_;
  std::unordered_map<std::string, uint32_t> id_of_;
  std::vector<std::vector<uint32_t>> words_;
  std::vector<int64_t> counts_;
  std::vector<uint32_t> stamp_;
  uint32_t epoch_ = 0;
  std::vector<PairInfo> pairs_;
  U64IndexMap pair_index_;
  std::vector<Entry> heap_;
  std::vector<uint32_t> touched_;
  std::vector<uint32_t> scratch_ids_;
  std::vector<uint8_t> scratch_new_;

  PairInfo& pair(uint32_t a, uint32_t b) { return pairs_[pair_id(a, b)]; }
  uint32_t pair_id(uint32_t a, uint32_t b) {
    bool inserted;
    uint32_t p = pair_index_.get_or_insert(pair_key(a, b), static_cast<uint32_t>(pairs_.size()), &inserted);
    if (inserted) pairs_.push_back(PairInfo{a, b, 0, {}});
    return p;
  }

  void merge_in_word(uint32_t w, uint32_t a, uint32_t b, uint32_t new_id) {
    std::vector<uint32_t>& old = words_[w];
    const size_t n = old.size();
    const int64_t c = counts_[w];
    std::vector<uint32_t>& out = scratch_ids_;
    std::vector<uint8_t>& fresh = scratch_new_;  // out[k] was made by this merge
    out.clear();
    fresh.clear();
    bool any = false;
    // Old pairs that touch a merged occurrence lose this word's count.
    size_t last_removed = SIZE_MAX;  // index k of the last old pair (k, k+1) already removed
    for (size_t i = 0; i < n;) {
      if (i + 1 < n && old[i] == a && old[i + 1] == b) {
        any = true;
        if (i > 0 && last_removed != i - 1) { pair(old[i - 1], old[i]).count -= c; }
        pair(a, b).count -= c;
        if (i + 2 < n) { pair(old[i + 1], old[i + 2]).count -= c; last_removed = i + 1; }
        out.push_back(new_id);
        fresh.push_back(1);
        i += 2;
      } else {
        out.push_back(old[i]);
        fresh.push_back(0);
        i += 1;
      }
    }
    if (!any) return;
    for (size_t k = 0; k + 1 < out.size(); ++k) {
      if (!fresh[k] && !fresh[k + 1]) continue;
      uint32_t p = pair_id(out[k], out[k + 1]);
      PairInfo& info = pairs_[p];
      info.count += c;
      if (info.where.empty() || info.where.back() != w) info.where.push_back(w);
      touched_.push_back(p);
    }
    old.assign(out.begin(), out.end());
  }
};

}  // namespace kiln
