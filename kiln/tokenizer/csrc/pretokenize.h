// Hand-written matchers for the gpt2, cl100k and o200k split patterns (see patterns.py).
//
// Each `match_*` returns the end of the regex match that starts at byte `i`, following the
// pattern's alternatives in order, with the same backtracking outcome as the `regex` module.
// Every code point is covered by some alternative, so consecutive matches tile the text.
// Input must be valid UTF-8 (the Python layer guarantees it).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "unicode_tables.h"

namespace kiln {

enum class PatternKind { GPT2, CL100K, O200K };

inline bool pattern_from_name(const std::string& name, PatternKind* out) {
  if (name == "gpt2") { *out = PatternKind::GPT2; return true; }
  if (name == "cl100k") { *out = PatternKind::CL100K; return true; }
  if (name == "o200k") { *out = PatternKind::O200K; return true; }
  return false;
}

class Splitter {
 public:
  Splitter(const uint8_t* s, size_t n) : s_(s), n_(n) {}

  size_t next(PatternKind kind, size_t i) const {
    switch (kind) {
      case PatternKind::GPT2: return gpt2(i);
      case PatternKind::CL100K: return cl100k(i);
      default: return o200k(i);
    }
  }

 private:
  const uint8_t* s_;
  size_t n_;

  // Length in bytes of the UTF-8 sequence starting at i (1 for a stray byte).
  size_t clen(size_t i) const {
    uint8_t c = s_[i];
    size_t len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    return i + len <= n_ ? len : 1;
  }
  uint32_t cp(size_t i) const {
    uint8_t c = s_[i];
    switch (clen(i)) {
      case 1: return c;
      case 2: return ((c & 0x1Fu) << 6) | (s_[i + 1] & 0x3Fu);
      case 3: return ((c & 0x0Fu) << 12) | ((s_[i + 1] & 0x3Fu) << 6) | (s_[i + 2] & 0x3Fu);
      default:
        return ((c & 0x07u) << 18) | ((s_[i + 1] & 0x3Fu) << 12) | ((s_[i + 2] & 0x3Fu) << 6) |
               (s_[i + 3] & 0x3Fu);
    }
  }
  uint8_t flags(size_t i) const { return kl_flags(cp(i)); }
  bool is_other(size_t i) const { return !(flags(i) & (KL_SPACE | KL_LETTER | KL_NUMBER)); }
  bool is_crlf(size_t i) const { return s_[i] == '\r' || s_[i] == '\n'; }

  // End of the maximal run of code points from i whose flags intersect `mask`.
  size_t run(size_t i, uint8_t mask) const {
    while (i < n_ && (flags(i) & mask)) i += clen(i);
    return i;
  }
  size_t run_other(size_t i) const {
    while (i < n_ && is_other(i)) i += clen(i);
    return i;
  }
  size_t run_n(size_t i, int max_count) const {
    for (int k = 0; k < max_count && i < n_ && (flags(i) & KL_NUMBER); ++k) i += clen(i);
    return i;
  }
  size_t prev_start(size_t k) const {  // start of the code point that ends at k
    do { --k; } while (k > 0 && (s_[k] & 0xC0) == 0x80);
    return k;
  }

  // `\s+(?!\S)|\s+` at a whitespace code point i.
  size_t whitespace(size_t i) const {
    size_t k = run(i, KL_SPACE);
    if (k == n_) return k;
    size_t last = prev_start(k);
    return last > i ? last : k;
  }

  // Case-sensitive `'s|'t|'re|'ve|'m|'ll|'d` at i; 0 when none.
  size_t contraction_gpt2(size_t i) const {
    if (s_[i] != '\'' || i + 1 >= n_) return 0;
    uint8_t a = s_[i + 1];
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if (i + 2 < n_) {
      uint8_t b = s_[i + 2];
      if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
    }
    return 0;
  }

  // `(?i:'s|'t|'re|'ve|'m|'ll|'d)` at i; 0 when none. Case folding also maps U+017F to s.
  size_t contraction_ci(size_t i) const {
    if (i >= n_ || s_[i] != '\'' || i + 1 >= n_) return 0;
    uint8_t a = s_[i + 1] | 0x20;
    if (s_[i + 1] == 0xC5 && i + 2 < n_ && s_[i + 2] == 0xBF) return i + 3;  // U+017F
    if (s_[i + 1] >= 0x80) return 0;
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if (i + 2 < n_ && s_[i + 2] < 0x80) {
      uint8_t b = s_[i + 2] | 0x20;
      if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
    }
    return 0;
  }

  size_t gpt2(size_t i) const {
    if (size_t e = contraction_gpt2(i)) return e;
    size_t j = (s_[i] == ' ' && i + 1 < n_) ? i + 1 : i;
    uint8_t f = flags(j);
    if (f & KL_LETTER) return run(j, KL_LETTER);
    if (f & KL_NUMBER) return run(j, KL_NUMBER);
    if (!(f & KL_SPACE)) return run_other(j);
    return whitespace(i);
  }

  size_t cl100k(size_t i) const {
    if (size_t e = contraction_ci(i)) return e;
    uint8_t f = flags(i);
    if (f & KL_LETTER) return run(i, KL_LETTER);
    if (!is_crlf(i) && !(f & KL_NUMBER)) {  // [^\r\n\p{L}\p{N}]\p{L}+
      size_t j = i + clen(i);
      if (j < n_ && (flags(j) & KL_LETTER)) return run(j, KL_LETTER);
    }
    if (f & KL_NUMBER) return run_n(i, 3);
    size_t j = (s_[i] == ' ' && i + 1 < n_) ? i + 1 : i;
    if (is_other(j)) {  //  ?[^\s\p{L}\p{N}]+[\r\n]*
      size_t k = run_other(j);
      while (k < n_ && is_crlf(k)) ++k;
      return k;
    }
    return space_newline_or_whitespace(i);
  }

  // `\s*[\r\n]+` (up to the last newline of the whitespace run), else `\s+(?!\S)|\s+`.
  size_t space_newline_or_whitespace(size_t i) const {
    size_t k = run(i, KL_SPACE);
    for (size_t p = k; p > i; --p) {
      if (is_crlf(p - 1)) return p;
    }
    return whitespace(i);
  }

  // o200k's first word alternative after the optional prefix: [U]*[W]+ ; 0 when it fails.
  size_t o200k_word1(size_t j) const {
    if (j >= n_) return 0;
    size_t u = run(j, KL_UPPERISH);
    if (u < n_ && (flags(u) & KL_LOWERISH)) return run(u, KL_LOWERISH);
    // Backtrack [U]* to the last code point that is also in [W] (Lm, Lo, M).
    size_t last = 0;
    bool found = false;
    for (size_t p = j; p < u; p += clen(p)) {
      if (flags(p) & KL_LOWERISH) { last = p; found = true; }
    }
    return found ? last + clen(last) : 0;
  }
  // o200k's second word alternative after the optional prefix: [U]+[W]* ; 0 when it fails.
  size_t o200k_word2(size_t j) const {
    if (j >= n_ || !(flags(j) & KL_UPPERISH)) return 0;
    return run(run(j, KL_UPPERISH), KL_LOWERISH);
  }
  size_t with_contraction(size_t e) const {
    size_t c = contraction_ci(e);
    return c ? c : e;
  }

  size_t o200k(size_t i) const {
    uint8_t f = flags(i);
    bool prefix = !is_crlf(i) && !(f & (KL_LETTER | KL_NUMBER));
    size_t after = i + clen(i);
    size_t e = 0;
    if (prefix) e = o200k_word1(after);
    if (!e) e = o200k_word1(i);
    if (!e && prefix) e = o200k_word2(after);
    if (!e) e = o200k_word2(i);
    if (e) return with_contraction(e);
    if (f & KL_NUMBER) return run_n(i, 3);
    size_t j = (s_[i] == ' ' && i + 1 < n_) ? i + 1 : i;
    if (is_other(j)) {  //  ?[^\s\p{L}\p{N}]+[\r\n/]*
      size_t k = run_other(j);
      while (k < n_ && (is_crlf(k) || s_[k] == '/')) ++k;
      return k;
    }
    return space_newline_or_whitespace(i);
  }
};

// Calls fn(start, end) for every pre-token of s[0, n).
template <typename Fn>
inline void for_each_pretoken(PatternKind kind, const uint8_t* s, size_t n, Fn&& fn) {
  Splitter sp(s, n);
  size_t i = 0;
  while (i < n) {
    size_t e = sp.next(kind, i);
    fn(i, e);
    i = e;
  }
}

}  // namespace kiln
