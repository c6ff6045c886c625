// kiln.tokenizer._native: the hot loops of the byte-level BPE tokenizer (see merge_ref.py and
// tokenizer.py for the reference semantics these must equal).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <exception>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "encoder.h"
#include "flat_map.h"
#include "merge_engine.h"
#include "pretokenize.h"

namespace py = pybind11;
using namespace kiln;

namespace {

struct Span {
  const uint8_t* data;
  size_t size;
};

// The byte strings of a Python list, viewed without copying. The list's items are referenced
// here, so the views stay valid while the GIL is released even if the list itself changes.
struct BytesViews {
  std::vector<py::object> keep_alive;
  std::vector<Span> spans;
};

BytesViews views_of(const py::list& items) {
  BytesViews v;
  v.keep_alive.reserve(items.size());
  v.spans.reserve(items.size());
  for (py::handle h : items) {
    if (!PyBytes_Check(h.ptr())) throw py::type_error("expected a list of bytes");
    v.keep_alive.push_back(py::reinterpret_borrow<py::object>(h));
    v.spans.push_back({reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(h.ptr())),
                       static_cast<size_t>(PyBytes_GET_SIZE(h.ptr()))});
  }
  return v;
}

// Splits spans into `parts` contiguous groups of about equal total bytes.
std::vector<size_t> balance(const std::vector<Span>& spans, size_t parts) {
  size_t total = 0;
  for (const Span& s : spans) total += s.size;
  std::vector<size_t> bounds{0};
  size_t acc = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    acc += spans[i].size;
    if (bounds.size() < parts && acc * parts >= total * bounds.size()) bounds.push_back(i + 1);
  }
  while (bounds.size() <= parts) bounds.push_back(spans.size());
  bounds.back() = spans.size();
  return bounds;
}

// Runs fn(0..threads-1) on threads; an exception in any is rethrown here after all have joined
// (an exception escaping a std::thread would terminate the process).
template <typename Fn>
void run_parallel(size_t threads, Fn&& fn) {
  if (threads <= 1) { fn(0); return; }
  std::vector<std::exception_ptr> errors(threads);
  std::vector<std::thread> pool;
  for (size_t t = 0; t < threads; ++t)
    pool.emplace_back([&fn, &errors, t] {
      try { fn(t); } catch (...) { errors[t] = std::current_exception(); }
    });
  for (auto& th : pool) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

py::list to_pylist(const std::vector<uint32_t>& ids) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(ids.size()));
  if (!list) throw py::error_already_set();
  for (size_t i = 0; i < ids.size(); ++i) {
    PyObject* item = PyLong_FromUnsignedLong(ids[i]);
    if (!item) { Py_DECREF(list); throw py::error_already_set(); }
    PyList_SET_ITEM(list, i, item);
  }
  return py::reinterpret_steal<py::list>(list);
}

PatternKind parse_pattern(const std::string& name) {
  PatternKind kind;
  if (!pattern_from_name(name, &kind)) throw py::value_error("unknown built-in pattern: " + name);
  return kind;
}

// Finds special tokens in one segment: the leftmost occurrence, the longest on ties. Each
// token's next occurrence is cached, so a scan over the segment is linear in its length even
// with several tokens (some of which may never occur).
class SpecialFinder {
 public:
  SpecialFinder(const std::vector<std::string>& specials, std::string_view segment)
      : specials_(specials), segment_(segment), next_(specials.size(), kUnknown) {}

  // Position and length of the next special token at or after `from`; npos if none.
  std::pair<size_t, size_t> next(size_t from) {
    size_t best = std::string_view::npos, len = 0;
    for (size_t k = 0; k < specials_.size(); ++k) {
      if (next_[k] == kUnknown || (next_[k] != std::string_view::npos && next_[k] < from))
        next_[k] = segment_.find(specials_[k], from);
      size_t p = next_[k];
      if (p < best || (p == best && p != std::string_view::npos && specials_[k].size() > len)) {
        best = p;
        len = specials_[k].size();
      }
    }
    return {best, len};
  }

 private:
  static constexpr size_t kUnknown = std::string_view::npos - 1;
  const std::vector<std::string>& specials_;
  std::string_view segment_;
  std::vector<size_t> next_;
};

class PretokenCounter {
 public:
  PretokenCounter(const std::string& pattern, std::vector<std::string> specials)
      : kind_(parse_pattern(pattern)), specials_(std::move(specials)) {
    for (const std::string& s : specials_)
      if (s.empty()) throw py::value_error("special tokens must be non-empty");
  }

  void add(const py::list& segments, size_t threads) {
    BytesViews views = views_of(segments);
    const std::vector<Span>& spans = views.spans;
    threads = std::max<size_t>(1, std::min(threads, spans.size()));
    if (maps_.size() < threads) maps_.resize(threads);
    std::vector<size_t> bounds = balance(spans, threads);
    py::gil_scoped_release release;
    run_parallel(threads, [&](size_t t) {
      BytesMap& map = maps_[t];
      for (size_t i = bounds[t]; i < bounds[t + 1]; ++i) count_segment(spans[i], map);
    });
  }

  // (words sorted by bytes, counts, number pruned, occurrences pruned)
  py::tuple items(int64_t min_count) {
    BytesMap merged;
    {
      py::gil_scoped_release release;
      for (BytesMap& m : maps_) {
        m.for_each([&](std::string_view k, uint64_t h, int64_t v) {
          merged.add_hashed(reinterpret_cast<const uint8_t*>(k.data()), k.size(), h, v);
        });
        m = BytesMap();
      }
    }
    std::vector<std::pair<std::string_view, int64_t>> kept;
    int64_t pruned = 0, pruned_occ = 0;
    merged.for_each([&](std::string_view k, uint64_t, int64_t v) {
      if (v >= min_count) kept.emplace_back(k, v);
      else { ++pruned; pruned_occ += v; }
    });
    std::sort(kept.begin(), kept.end());
    py::list words(kept.size()), counts(kept.size());
    for (size_t i = 0; i < kept.size(); ++i) {
      words[i] = py::bytes(kept[i].first.data(), kept[i].first.size());
      counts[i] = py::int_(kept[i].second);
    }
    return py::make_tuple(words, counts, pruned, pruned_occ);
  }

 private:
  PatternKind kind_;
  std::vector<std::string> specials_;
  std::vector<BytesMap> maps_;

  void count_ordinary(const uint8_t* s, size_t n, BytesMap& map) const {
    for_each_pretoken(kind_, s, n, [&](size_t b, size_t e) { map.add(s + b, e - b, 1); });
  }
  void count_segment(const Span& span, BytesMap& map) const {
    if (specials_.empty()) { count_ordinary(span.data, span.size, map); return; }
    SpecialFinder finder(specials_, std::string_view(reinterpret_cast<const char*>(span.data), span.size));
    size_t pos = 0;
    while (pos < span.size) {
      auto [p, len] = finder.next(pos);
      size_t end = p == std::string_view::npos ? span.size : p;
      count_ordinary(span.data + pos, end - pos, map);
      if (p == std::string_view::npos) break;
      pos = p + len;
    }
  }
};

std::vector<uint32_t> encode_span(const Encoder& enc, const Span& s) {
  std::vector<uint32_t> out;
  out.reserve(s.size / 3 + 4);
  enc.encode(s.data, s.size, out);
  return out;
}

std::unique_ptr<Encoder> make_encoder(const std::vector<uint32_t>& byte_ids,
                                      const std::vector<std::tuple<uint32_t, uint32_t, uint32_t>>& merges,
                                      const py::list& decoder, const std::vector<bool>& valid,
                                      const std::string& pattern) {
  if (byte_ids.size() != 256) throw py::value_error("byte_ids must have 256 entries");
  if (decoder.size() != valid.size()) throw py::value_error("decoder and valid differ in length");
  std::vector<std::string> dec;
  dec.reserve(decoder.size());
  for (py::handle h : decoder) dec.push_back(h.cast<std::string>());
  for (auto& [a, b, c] : merges)
    if (a >= dec.size() || b >= dec.size() || c >= dec.size()) throw py::value_error("merge id out of range");
  bool has = !pattern.empty();
  PatternKind kind = has ? parse_pattern(pattern) : PatternKind::GPT2;
  return std::make_unique<Encoder>(byte_ids, merges, std::move(dec), valid, has, kind);
}

std::string decode_ids(const Encoder& enc, const py::list& ids) {
  std::string out;
  out.reserve(ids.size() * 4);
  for (py::handle h : ids) {
    long long id = PyLong_AsLongLong(h.ptr());
    if (id == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (!enc.append_token(id, out))
      throw py::value_error("token id " + std::to_string(id) + " is not in the vocabulary");
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "kiln's native BPE hot loops: pre-tokenization, counting, merging, encoding.";

  m.def(
      "pretokenize",
      [](const std::string& pattern, py::bytes data) {
        PatternKind kind = parse_pattern(pattern);
        std::string_view sv = data;
        std::vector<std::pair<size_t, size_t>> spans;
        for_each_pretoken(kind, reinterpret_cast<const uint8_t*>(sv.data()), sv.size(),
                          [&](size_t b, size_t e) { spans.emplace_back(b, e); });
        return spans;
      },
      "Byte spans of the pre-tokens of UTF-8 `data` under a built-in pattern.");

  py::class_<PretokenCounter>(m, "PretokenCounter")
      .def(py::init<const std::string&, std::vector<std::string>>())
      .def("add", &PretokenCounter::add, py::arg("segments"), py::arg("threads") = 1)
      .def("items", &PretokenCounter::items, py::arg("min_count") = 1);

  py::class_<MergeEngine>(m, "MergeEngine")
      .def(py::init([](const py::list& words, const std::vector<int64_t>& counts) {
        if (words.size() != counts.size()) throw py::value_error("words and counts differ in length");
        std::vector<std::string> w;
        w.reserve(words.size());
        for (py::handle h : words) w.push_back(h.cast<std::string>());
        py::gil_scoped_release release;
        return std::make_unique<MergeEngine>(w, counts);
      }))
      .def("apply", [](MergeEngine& e, uint32_t a, uint32_t b) {
        if (a >= e.vocab_size() || b >= e.vocab_size()) throw py::value_error("merge id out of range");
        return e.apply(a, b);
      })
      .def("step", [](MergeEngine& e, size_t max_merges, size_t max_vocab) {
        py::gil_scoped_release release;
        return e.step(max_merges, max_vocab);
      })
      .def_property_readonly("vocab_size", &MergeEngine::vocab_size)
      .def("token", [](const MergeEngine& e, uint32_t id) {
        if (id >= e.vocab_size()) throw py::index_error("token id out of range");
        const std::string& t = e.token(id);
        return py::bytes(t.data(), t.size());
      });

  py::class_<Encoder>(m, "Encoder")
      .def(py::init(&make_encoder))
      .def("encode", [](const Encoder& enc, py::bytes data) {
        std::string_view sv = data;
        std::vector<uint32_t> out;
        {
          py::gil_scoped_release release;
          out = encode_span(enc, {reinterpret_cast<const uint8_t*>(sv.data()), sv.size()});
        }
        return to_pylist(out);
      })
      .def("encode_pieces", [](const Encoder& enc, const py::list& pieces) {
        BytesViews views = views_of(pieces);
        const std::vector<Span>& spans = views.spans;
        std::vector<uint32_t> out;
        {
          py::gil_scoped_release release;
          for (const Span& s : spans) if (s.size) enc.bpe(s.data, s.size, out);
        }
        return to_pylist(out);
      })
      .def("encode_batch", [](const Encoder& enc, const py::list& texts, size_t threads) {
        BytesViews views = views_of(texts);
        const std::vector<Span>& spans = views.spans;
        std::vector<std::vector<uint32_t>> results(spans.size());
        threads = std::max<size_t>(1, std::min(threads, spans.size()));
        std::vector<size_t> bounds = balance(spans, threads);
        {
          py::gil_scoped_release release;
          run_parallel(threads, [&](size_t t) {
            for (size_t i = bounds[t]; i < bounds[t + 1]; ++i) results[i] = encode_span(enc, spans[i]);
          });
        }
        py::list out(spans.size());
        for (size_t i = 0; i < spans.size(); ++i) out[i] = to_pylist(results[i]);
        return out;
      })
      .def("decode_bytes", [](const Encoder& enc, const py::list& ids) {
        std::string out = decode_ids(enc, ids);
        return py::bytes(out);
      })
      .def("decode", [](const Encoder& enc, const py::list& ids) {
        // Straight to str: skips the intermediate bytes object that bytes.decode would need.
        std::string out = decode_ids(enc, ids);
        PyObject* text = PyUnicode_DecodeUTF8(out.data(), static_cast<Py_ssize_t>(out.size()), "replace");
        if (!text) throw py::error_already_set();
        return py::reinterpret_steal<py::str>(text);
      });
}
