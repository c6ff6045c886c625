// Small open-addressing hash maps for the hot loops (std::unordered_map allocates per node).
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

inline uint64_t hash_bytes(const uint8_t* p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ULL ^ (n * 0x100000001B3ULL);
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = mix64(h ^ w);
    p += 8;
    n -= 8;
  }
  uint64_t w = 0;
  std::memcpy(&w, p, n);
  return mix64(h ^ w ^ (uint64_t(n) << 59));
}

// byte string -> int64 value; keys live in one arena.
class BytesMap {
 public:
  struct Slot {
    uint64_t hash = 0;
    uint64_t offset = 0;
    uint32_t length = 0;
    bool used = false;
    int64_t value = 0;
  };

  BytesMap() { slots_.resize(1024); }

  int64_t* find(const uint8_t* p, size_t n) const {
    uint64_t h = hash_bytes(p, n);
    size_t mask = slots_.size() - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
      const Slot& s = slots_[i];
      if (!s.used) return nullptr;
      if (s.hash == h && s.length == n && std::memcmp(arena_.data() + s.offset, p, n) == 0)
        return const_cast<int64_t*>(&s.value);
    }
  }

  // Adds `delta` to the key's value, inserting it with value 0 first if absent.
  void add(const uint8_t* p, size_t n, int64_t delta) { add_hashed(p, n, hash_bytes(p, n), delta); }

  void add_hashed(const uint8_t* p, size_t n, uint64_t h, int64_t delta) {
    size_t mask = slots_.size() - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
      Slot& s = slots_[i];
      if (!s.used) {
        s.used = true;
        s.hash = h;
        s.offset = arena_.size();
        s.length = static_cast<uint32_t>(n);
        s.value = delta;
        arena_.append(reinterpret_cast<const char*>(p), n);
        if (++size_ * 4 > slots_.size() * 3) grow();
        return;
      }
      if (s.hash == h && s.length == n && std::memcmp(arena_.data() + s.offset, p, n) == 0) {
        s.value += delta;
        return;
      }
    }
  }

  size_t size() const { return size_; }

  template <typename Fn>
  void for_each(Fn&& fn) const {
    for (const Slot& s : slots_)
      if (s.used)
        fn(std::string_view(arena_.data() + s.offset, s.length), s.hash, s.value);
  }

 private:
  std::vector<Slot> slots_;
  std::string arena_;
  size_t size_ = 0;

  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    size_t mask = slots_.size() - 1;
    for (const Slot& s : old) {
      if (!s.used) continue;
      size_t i = s.hash & mask;
      while (slots_[i].used) i = (i + 1) & mask;
      slots_[i] = s;
    }
  }
};

// uint64 key -> uint32 index (keys are never removed).
class U64IndexMap {
 public:
  static constexpr uint32_t kMissing = 0xFFFFFFFFu;

  U64IndexMap() { keys_.resize(1024); vals_.resize(1024, kMissing); }

  uint32_t get(uint64_t key) const {
    size_t mask = keys_.size() - 1;
    for (size_t i = mix64(key) & mask;; i = (i + 1) & mask) {
      if (vals_[i] == kMissing) return kMissing;
      if (keys_[i] == key) return vals_[i];
    }
  }

  // The index for `key`, inserting `fresh` if absent; *inserted tells which happened.
  uint32_t get_or_insert(uint64_t key, uint32_t fresh, bool* inserted) {
    size_t mask = keys_.size() - 1;
    for (size_t i = mix64(key) & mask;; i = (i + 1) & mask) {
      if (vals_[i] == kMissing) {
        keys_[i] = key;
        vals_[i] = fresh;
        *inserted = true;
        if (++size_ * 2 > keys_.size()) grow();
        return fresh;
      }
      if (keys_[i] == key) {
        *inserted = false;
        return vals_[i];
      }
    }
  }

  void reserve(size_t n) {
    while (keys_.size() < n * 2 + 2) grow();
  }

 private:
  std::vector<uint64_t> keys_;
  std::vector<uint32_t> vals_;
  size_t size_ = 0;

  void grow() {
    std::vector<uint64_t> ok(keys_.size() * 2);
    std::vector<uint32_t> ov(vals_.size() * 2, kMissing);
    ok.swap(keys_);
    ov.swap(vals_);
    size_t mask = keys_.size() - 1;
    for (size_t j = 0; j < ok.size(); ++j) {
      if (ov[j] == kMissing) continue;
      size_t i = mix64(ok[j]) & mask;
      while (vals_[i] != kMissing) i = (i + 1) & mask;
      keys_[i] = ok[j];
      vals_[i] = ov[j];
    }
  }
};

inline uint64_t pair_key(uint32_t a, uint32_t b) { return (uint64_t(a) << 32) | b; }

}  // namespace kiln
