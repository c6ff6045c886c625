"""The new pipeline stages on a planted corpus: precision, recall and speed, beside datatrove's.

Corpus: clean TinyStories (validation stories, then training stories the models never saw) with
planted cases, each in documents of its own so a stage's hits can be scored:
- low quality: web-like text (en_10m documents the classifier did not train on) and word salad
  (stories with their words shuffled), for the classifier and perplexity stages;
- bad words: a story with one sentence holding an LDNOOBW English word;
- phone: a story ending with a phone number in one of several national/international formats;
- URL: stories whose `url` is on a blocked domain (every document has a URL);
- boilerplate: ten distinct footer lines, each appended to many stories;
- near duplicates: copies of stories with words replaced until the shingle Jaccard lands in
  0.5-0.6, ..., 0.9-1.0 (a pair counts as a duplicate at Jaccard >= `--jaccard`).

Per stage: precision and recall against the planted labels (documents; lines for line dedup;
pairs for MinHash), and documents per CPU-second (time.process_time, the stage's own work:
documents are built beforehand). datatrove 0.10.1 runs beside kiln where it has the stage and
it runs offline: C4BadWordsFilter (its LDNOOBW download replaced by the same list kiln ships),
PIIFormatter (e-mail and IP only: it has no phone rule, so its phone recall is 0), sentence dedup
on lines (SentDedupConfig(n_sentences=1, split_sentences=False): it keeps the first copy of a
repeated line, kiln removes a line from every document once it is in `min_documents`), and its
four-step MinHash dedup (no Jaccard check), and its SingleBloomFilter beside kiln's Bloom exact
dedup (planted verbatim copies; kiln's achieved false-positive rate is printed against the rate
its filter's load implies). Its fastText, KenLM-perplexity and URL filters need
fasttext, kenlm and pyahocorasick/tldextract, which are not installed: those rows say so.

    python bench/data_planted.py            # full: ~3,800 documents, a few minutes
    python bench/data_planted.py --tiny     # a few hundred documents, for the test
"""

from __future__ import annotations

import argparse
import gc
import gzip
import importlib
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._load import add_noisy_flag, begin  # noqa: E402

SHARED = REPO.parent / "shared" / "data"
EOT = "<|endoftext|>"
PHONES = ("+1 415 555 0132", "(415) 555-0198", "415-555-0147", "+44 20 7946 0958",
          "020 7946 0321", "+49 30 901820", "+33 1 42 68 53 00", "06 12 34 56 78")  # fmt: skip
BOILERPLATE = tuple(
    f"{line} (Story Corner edition {k})"
    for k, line in enumerate(
        [
            "Share this story with your friends and family.",
            "Subscribe to our newsletter for a new story every week.",
            "All rights reserved. Do not copy without permission.",
            "Click here to read more stories like this one.",
            "Follow us on social media for daily bedtime tales.",
            "Download our free app to listen to this story.",
            "Rate this story and leave a comment below.",
            "Back to the list of stories for children.",
            "Sign in to save your favourite stories.",
            "Advertisement: toys and books for every age.",
        ]
    )
)
BAD_SENTENCES = ("The pirate shouted a word like {w} at the sea.",
                 "Someone had written {w} on the old fence.")  # fmt: skip
BLOOM_RATE = 0.01  # high enough that a few thousand documents show false positives
# The sample the perplexity cutoffs come from is 1/9 web text: its top decile is the tail.
PERPLEXITY_TAIL = 90.0
BINS = ((0.5, 0.6), (0.6, 0.7), (0.7, 0.8), (0.8, 0.9), (0.9, 1.0))


@dataclass(frozen=True)
class Size:
    """How big a run is."""

    clean: int
    low_quality: int  # half web-like text, half word salad
    bad_words: int
    phone: int
    url: int
    boilerplate_docs: int  # each gets one of BOILERPLATE, round robin
    pairs_per_bin: int
    exact_copies: int  # verbatim copies of clean stories, for exact dedup
    train_docs: int  # per class for the classifier; the LM's reference is twice this


FULL = Size(2500, 300, 150, 150, 150, 400, 60, 150, 800)
TINY = Size(120, 30, 12, 12, 12, 40, 4, 12, 150)


# ------------------------------------------------------------------------------------ corpus
def read_docs(path: Path, limit_chars: int) -> list[str]:
    """Documents of a `<|endoftext|>`-separated gzip file, from its first `limit_chars`."""
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        text = handle.read(limit_chars)
    return [d.strip() for d in text.split(EOT)[:-1] if len(d.split()) >= 40]


def shingles_of(texts: Sequence[str]) -> list[np.ndarray]:
    """Each text's distinct MinHash shingles (word 5-grams, as kiln's MinHash sees them)."""
    from kiln.data.pipeline.dedup.minhash import hash_word_ngrams
    from kiln.data.pipeline.dedup.verify import distinct_shingles

    values, offsets = distinct_shingles(*hash_word_ngrams(list(texts), 5))
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(texts))]


def near_copy(text: str, target: float, rng: np.random.Generator, vocab: list[str]) -> str:
    """A copy of `text` with words replaced until its shingle Jaccard is just below `target`."""
    from kiln.data.pipeline.dedup.verify import jaccard

    words = text.split(" ")
    order = rng.permutation(len(words))
    subs = rng.integers(len(vocab), size=len(words))
    base = shingles_of([text])[0]

    def variant(k: int) -> str:
        out = list(words)
        for i in order[:k].tolist():
            out[i] = vocab[subs[i]]
        return " ".join(out)

    lo, hi = 0, len(words)  # J(variant(lo)) >= target > J(variant(hi)) (assumed)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if jaccard(base, shingles_of([variant(mid)])[0]) >= target:
            lo = mid
        else:
            hi = mid
    return variant(hi)


@dataclass
class Planted:
    """The corpus and its labels."""

    texts: list[str] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    kind: list[str] = field(default_factory=list)  # clean, low_quality, bad_words, ...
    detail: list[str] = field(default_factory=list)  # low quality: "web" or "salad"
    lines: dict[int, str] = field(default_factory=dict)  # doc -> its planted boilerplate line
    pairs: list[tuple[int, int, float]] = field(default_factory=list)  # (original, copy, J)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (original, verbatim copy)
    blocked: list[str] = field(default_factory=list)
    train_pos: list[str] = field(default_factory=list)
    train_neg: list[str] = field(default_factory=list)
    lm_reference: list[str] = field(default_factory=list)
    lm_sample: list[str] = field(default_factory=list)

    def add(self, text: str, kind: str, url: str = "", detail: str = "") -> int:
        """Append one document; its index."""
        self.texts.append(text)
        self.kind.append(kind)
        self.detail.append(detail)
        self.urls.append(url or f"https://stories.example.org/{len(self.texts)}")
        return len(self.texts) - 1


def plant(size: Size, seed: int = 0) -> Planted:
    """Build the planted corpus and the models' training sets (all disjoint)."""
    from kiln.data.pipeline.dedup.verify import jaccard

    rng = np.random.default_rng(seed)
    need = size.clean + size.bad_words + size.phone + size.url + size.boilerplate_docs
    need += 5 * size.pairs_per_bin + size.low_quality // 2
    stories = read_docs(SHARED / "tinystories" / "valid.txt.gz", 1 << 30)
    train = read_docs(SHARED / "tinystories" / "train.txt.gz", 1 << 30)
    stories += train[4 * size.train_docs :]
    web = read_docs(SHARED / "bench" / "en_10m.txt.gz", 40_000_000)
    web = [w[:3000] for w in web if len(w) > 400]
    if len(stories) < need or len(web) < 2 * size.train_docs + size.low_quality:
        raise SystemExit(f"not enough documents for this size ({len(stories)} stories)")
    p = Planted()
    p.train_pos = train[: size.train_docs]
    p.train_neg = web[: size.train_docs]
    p.lm_reference = train[size.train_docs : 3 * size.train_docs]
    # The perplexity cutoffs come from a sample shaped like the input: mostly stories.
    p.lm_sample = (
        train[3 * size.train_docs : 4 * size.train_docs]
        + web[size.train_docs : size.train_docs + size.train_docs // 8]
    )
    held_web = web[2 * size.train_docs :]
    pool = iter(rng.permutation(len(stories)).tolist())

    def story() -> str:
        return stories[next(pool)]

    for _ in range(size.clean):
        p.add(story(), "clean")
    for i in rng.choice(size.clean, size=size.exact_copies, replace=False).tolist():
        p.copies.append((i, p.add(p.texts[i], "exact_copy")))
    for i in range(size.low_quality):
        if i % 2:
            p.add(held_web[i], "low_quality", detail="web")
        else:
            words = story().split()
            p.add(" ".join(rng.permutation(words).tolist()), "low_quality", detail="salad")
    bad = [w for w in (REPO / "kiln/assets/ldnoobw/en.txt").read_text().split("\n") if w.strip()]
    bad = [w for w in bad if " " not in w and w.isalpha()]
    for i in range(size.bad_words):
        sentences = story().split(". ")
        at = int(rng.integers(len(sentences)))
        sentences.insert(at, BAD_SENTENCES[i % 2].format(w=bad[int(rng.integers(len(bad)))])[:-1])
        p.add(". ".join(sentences), "bad_words")
    for i in range(size.phone):
        p.add(f"{story()}\nMum wrote her number on the card: {PHONES[i % len(PHONES)]}.", "phone")
    p.blocked = [f"blocked-{k}.example.com" for k in range(20)]
    for i in range(size.url):
        host = f"www.{p.blocked[i % 20]}" if i % 3 else p.blocked[i % 20]
        p.add(story(), "url", f"https://{host}/story/{i}")
    for i in range(size.boilerplate_docs):
        line = BOILERPLATE[i % len(BOILERPLATE)]
        p.lines[p.add(f"{story()}\n{line}", "boilerplate")] = line
    vocab = sorted({w for s in stories[:300] for w in s.split(" ")})
    for lo, hi in BINS:
        for _ in range(size.pairs_per_bin):
            original = story()
            target = float(rng.uniform(lo, hi))
            copy = near_copy(original, target, rng, vocab)
            a = p.add(original, "near_original")
            b = p.add(copy, "near_copy")
            p.pairs.append((a, b, jaccard(*shingles_of([original, copy]))))
    return p


# ------------------------------------------------------------------------------- measuring
def cpu(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn(), CPU seconds of this process and its finished children)."""
    import resource

    gc.collect()

    def now() -> float:
        c = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + c.ru_utime + c.ru_stime

    start = now()
    out = fn()
    return out, max(now() - start, 1e-9)


def prf(predicted: Sequence[bool], truth: Sequence[bool]) -> dict[str, float]:
    """Precision and recall of boolean predictions."""
    tp = sum(p and t for p, t in zip(predicted, truth, strict=True))
    fp = sum(p and not t for p, t in zip(predicted, truth, strict=True))
    fn = sum(t and not p for p, t in zip(predicted, truth, strict=True))
    return {
        "tp": tp,
        "fp": fp,
        "fn": fn,
        "precision": tp / (tp + fp) if tp + fp else float("nan"),
        "recall": tp / (tp + fn) if tp + fn else float("nan"),
    }


def kiln_docs(p: Planted) -> list[Any]:
    """Fresh kiln Documents with their URLs."""
    from kiln.data.pipeline.document import Document

    return [
        Document(id=str(i), text=t, source="bench", meta={"url": u})
        for i, (t, u) in enumerate(zip(p.texts, p.urls, strict=True))
    ]


def datatrove_docs(p: Planted) -> list[Any]:
    """Fresh datatrove Documents with their URLs."""
    from datatrove.data import Document

    return [
        Document(text=t, id=str(i), metadata={"url": u})
        for i, (t, u) in enumerate(zip(p.texts, p.urls, strict=True))
    ]


def doc_stage(name: str, p: Planted, truth: list[bool], kiln: Any, peer: Any = None,
              peer_missing: str = "", kiln_hit: Callable[[Any, Any], bool] | None = None,
              peer_hit: Callable[[Any, Any], bool] | None = None) -> dict[str, Any]:  # fmt: skip
    """One per-document stage on every document, kiln and (if any) datatrove."""
    docs = kiln_docs(p)
    results, k_cpu = cpu(lambda: [kiln.apply(d) for d in docs])
    hit = kiln_hit or (lambda r, d: r is not None)
    hits = [hit(r, d) for r, d in zip(results, docs, strict=True)]
    row: dict[str, Any] = {
        "stage": name,
        "docs": len(docs),
        "kiln": {**prf(hits, truth), "docs_per_cpu_s": len(docs) / k_cpu},
    }
    kinds = sorted({k for k, t in zip(p.detail, truth, strict=True) if t and k})
    if kinds:  # recall per kind of planted case
        row["kiln"]["recall_by_kind"] = {
            k: sum(h for h, d in zip(hits, p.detail, strict=True) if d == k) / p.detail.count(k)
            for k in kinds
        }
    if peer is None:
        row["datatrove"] = {"missing": peer_missing}
        return row
    pdocs = datatrove_docs(p)
    call = peer.filter if hasattr(peer, "filter") else (lambda d: peer.format(d.text))
    texts_before = [d.text for d in pdocs]

    def run_peer() -> list[Any]:
        out = []
        for d in pdocs:
            r = call(d)
            if isinstance(r, str):  # a formatter returns the new text
                d.text = r
            out.append(r)
        return out

    p_results, p_cpu = cpu(run_peer)
    p_hit = peer_hit or (lambda r, i: not (r[0] if isinstance(r, tuple) else r))
    predicted = [p_hit(r, (texts_before[i], pdocs[i].text)) for i, r in enumerate(p_results)]
    row["datatrove"] = {**prf(predicted, truth), "docs_per_cpu_s": len(pdocs) / p_cpu}
    row["ratio"] = p_cpu / k_cpu
    return row


# ------------------------------------------------------------------------ the model stages
def train_models(p: Planted, folder: Path) -> tuple[Path, Path, dict[str, Any]]:
    """kiln's classifier (stories vs web, the DCLM recipe) and n-gram LM; their files."""
    from kiln.data.pipeline.filter.model_training import train_classifier, train_perplexity_lm

    def write(name: str, texts: list[str]) -> None:
        (folder / name).write_text("".join(f"{t}\n{EOT}\n" for t in texts), encoding="utf-8")

    write("pos.txt", p.train_pos)
    write("neg.txt", p.train_neg)
    write("ref.txt", p.lm_reference)
    write("sample.txt", p.lm_sample)
    (folder / "cls.toml").write_text(
        'output = "cls.npz"\n[[positive]]\nname = "stories"\npaths = ["pos.txt"]\n'
        '[[negative]]\nname = "web"\npaths = ["neg.txt"]\n',
        encoding="utf-8",
    )
    (folder / "lm.toml").write_text(
        'output = "lm.npz"\n[[reference]]\nname = "stories"\npaths = ["ref.txt"]\n'
        '[[sample]]\nname = "input"\npaths = ["sample.txt"]\n',
        encoding="utf-8",
    )
    record, train_s = cpu(lambda: train_classifier(folder / "cls.toml"))
    _, lm_s = cpu(lambda: train_perplexity_lm(folder / "lm.toml"))
    info = {"classifier_held_out": record["held_out"], "classifier_train_cpu_s": train_s,
            "lm_train_cpu_s": lm_s}  # fmt: skip
    return folder / "cls.npz", folder / "lm.npz", info


def bad_words_peer() -> Any:
    """datatrove's C4BadWordsFilter reading kiln's shipped copy of the same LDNOOBW en list."""
    from datatrove.pipeline.filters import C4BadWordsFilter

    c4 = importlib.import_module("datatrove.pipeline.filters.c4_filters")
    en = str(REPO / "kiln" / "assets" / "ldnoobw" / "en.txt")
    c4.cached_asset_path_or_download = lambda *a, **k: en  # offline: no download
    return C4BadWordsFilter()


def doc_stages(p: Planted, folder: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Classifier, perplexity, bad words, URL blocklist and phone PII rows."""
    from datatrove.pipeline.formatters import PIIFormatter

    from kiln.data.pipeline.filter.bad_words import BadWordsConfig, BadWordsFilter
    from kiln.data.pipeline.filter.pii import PIIConfig, PIIRedact
    from kiln.data.pipeline.filter.quality_classifier import ClassifierConfig, ClassifierFilter
    from kiln.data.pipeline.filter.quality_perplexity import PerplexityConfig, PerplexityFilter
    from kiln.data.pipeline.filter.url_blocklist import UrlBlocklist, UrlBlocklistConfig

    cls, lm, info = train_models(p, folder)
    (folder / "block.txt").write_text("\n".join(p.blocked) + "\n", encoding="utf-8")
    low = [k == "low_quality" for k in p.kind]
    rows = [
        doc_stage("classifier", p, low,
                  ClassifierFilter(ClassifierConfig(enabled=True, model=str(cls), threshold=0.5)),
                  peer_missing="fastText filter: `fasttext` not installed"),
        doc_stage("perplexity", p, low,
                  PerplexityFilter(PerplexityConfig(enabled=True, model=str(lm),
                                                    percentile_tail=PERPLEXITY_TAIL)),
                  peer_missing="CCNet perplexity: `kenlm` not installed"),
        doc_stage("bad_words", p, [k == "bad_words" for k in p.kind],
                  BadWordsFilter(BadWordsConfig(enabled=True, languages=("en",))),
                  bad_words_peer()),
        doc_stage("url_blocklist", p, [k == "url" for k in p.kind],
                  UrlBlocklist(UrlBlocklistConfig(enabled=True, file=str(folder / "block.txt"))),
                  peer_missing="URLFilter: `pyahocorasick`/`tldextract` not installed"),
        doc_stage("pii_phone", p, [k == "phone" for k in p.kind],
                  PIIRedact(PIIConfig(phone=True)), PIIFormatter(),
                  kiln_hit=lambda r, d: d.meta["pii"].get("phone", 0) > 0,
                  peer_hit=lambda r, texts: texts[0] != texts[1]),
    ]  # fmt: skip
    return rows, info


# ------------------------------------------------------------------------------ line dedup
def kiln_line_dedup(texts: list[str], min_documents: int) -> list[str]:
    """kiln's line dedup in one process: keys per document, the count, the removal."""
    from kiln.data.pipeline.dedup.lines import (
        LineDedupConfig,
        document_keys,
        frequent_keys,
        remove_units,
    )

    cfg = LineDedupConfig(enabled=True, min_documents=min_documents)
    per_doc = [document_keys(t, cfg) for t in texts]
    owners = np.repeat(np.arange(len(texts)), [len(k) for k in per_doc])
    rows = np.stack([np.concatenate(per_doc), owners], axis=1)
    _, keys = frequent_keys(rows, cfg.min_documents)
    frequent = set(keys.tolist())
    return [remove_units(t, frequent, cfg)[0] for t in texts]


def datatrove_line_dedup(texts: list[str], folder: Path) -> list[str]:
    """datatrove's sentence dedup on lines (its three steps, files in `folder`)."""
    import xxhash
    from datatrove.data import Document
    from datatrove.pipeline.dedup.sentence_dedup import (
        SentDedupConfig,
        SentenceDedupFilter,
        SentenceDedupSignature,
        SentenceFindDedups,
    )

    words = importlib.import_module("bench.data_filters").peer_tokenizer("whitespace")
    cfg = SentDedupConfig(n_sentences=1, split_sentences=False, min_doc_words=0,
                          min_num_sentences=0)  # fmt: skip
    docs = [Document(text=t, id=str(i)) for i, t in enumerate(texts)]
    sig = SentenceDedupSignature(str(folder / "sigs"), config=cfg, language=words)
    # The installed xxhash wants bytes; datatrove 0.10.1 passes str (as bench/data_dedup.py).
    sig.hash_fc = lambda s: xxhash.xxh64_intdigest(s.encode("utf-8"))
    sig.run(iter(docs))
    SentenceFindDedups(str(folder / "sigs"), str(folder / "dups"), config=cfg).run()
    filt = SentenceDedupFilter(str(folder / "dups"), config=cfg, language=words)
    kept = {d.id: d.text for d in filt.run(iter(docs))}
    return [kept.get(str(i), "") for i in range(len(texts))]


def removed_lines(before: str, after: str) -> Counter[str]:
    """The stripped lines of `before` missing from `after` (with multiplicity)."""
    return Counter(s.strip() for s in before.splitlines() if s.strip()) - Counter(
        s.strip() for s in after.splitlines() if s.strip()
    )


def score_lines(p: Planted, outputs: list[str]) -> dict[str, Any]:
    """Line-level precision/recall: planted boilerplate lines removed vs any line removed."""
    tp = fp = 0
    for i, (before, after) in enumerate(zip(p.texts, outputs, strict=True)):
        for line, n in removed_lines(before, after).items():
            if p.lines.get(i) == line:
                tp += n
            else:
                fp += n
    planted = len(p.lines)
    return {"tp": tp, "fp": fp, "fn": planted - tp,
            "precision": tp / (tp + fp) if tp + fp else float("nan"),
            "recall": tp / planted if planted else float("nan")}  # fmt: skip


def line_stage(p: Planted, folder: Path, min_documents: int) -> dict[str, Any]:
    """Line dedup, kiln and datatrove, on every document."""
    out, k_cpu = cpu(lambda: kiln_line_dedup(p.texts, min_documents))
    peer, p_cpu = cpu(lambda: datatrove_line_dedup(p.texts, folder / "sentdedup"))
    n = len(p.texts)
    return {
        "stage": "line_dedup",
        "docs": n,
        "kiln": {**score_lines(p, out), "docs_per_cpu_s": n / k_cpu},
        "datatrove": {**score_lines(p, peer), "docs_per_cpu_s": n / p_cpu},
        "ratio": p_cpu / k_cpu,
    }


# ------------------------------------------------------------------------ Bloom exact dedup
def kiln_bloom(texts: list[str], rate: float, batch: int) -> tuple[np.ndarray, dict[str, Any]]:
    """kiln's Bloom exact dedup over tasks of `batch` documents: (seen (n,), filter facts)."""
    from kiln.data.pipeline.dedup.bloom import BloomFilter, bloom_size, first_seen
    from kiln.data.pipeline.dedup.exact import exact_key, keys_array

    pairs = keys_array([exact_key(t) for t in texts]).view(np.uint64).reshape(len(texts), 2)
    bits, probes = bloom_size(len(pairs), rate)
    bloom = BloomFilter(bits, probes)
    seen = [first_seen(bloom, pairs[lo : lo + batch]) for lo in range(0, len(pairs), batch)]
    return np.concatenate(seen), {"bits": bits, "probes": probes, "fill": bloom.fill()}


def datatrove_bloom(texts: list[str], folder: Path, rate: float) -> list[bool]:
    """datatrove's SingleBloomFilter (13-gram shingles, a document whose shingles were > 80%
    seen is a duplicate), sized for the corpus's shingles at `rate`: which documents it drops."""
    import xxhash
    from datatrove.data import Document
    from datatrove.pipeline.dedup.bloom_filter import BloomFilterConfig, SingleBloomFilter

    words = importlib.import_module("bench.data_filters").peer_tokenizer("whitespace")
    n = sum(max(len(t.split()) - 12, 0) for t in texts)
    bits = int(-n * np.log(rate) / np.log(2) ** 2)
    # datatrove takes a bit index as `hash & m_bytes`, so m_bytes = 2^j - 1 gives it 2^j bits.
    m_bytes = (1 << max(int(np.ceil(np.log2(bits))), 3)) - 1
    cfg = BloomFilterConfig(m_bytes=m_bytes, k=max(1, round(bits / max(n, 1) * np.log(2))))
    bloom = SingleBloomFilter(str(folder / "bloom"), config=cfg, language=words)
    bloom.hash_fc = lambda s: xxhash.xxh32_intdigest(s.encode("utf-8"))  # the installed xxhash
    return [not bloom.step(Document(text=t, id=str(i))) for i, t in enumerate(texts)]


def bloom_stage(p: Planted, folder: Path, rate: float, batch: int = 100) -> dict[str, Any]:
    """Bloom exact dedup: planted copies found, unique documents wrongly removed (achieved
    false-positive rate) against the rate the filter's load implies, kiln and datatrove."""
    from kiln.data.pipeline.dedup.exact import exact_key

    first: set[bytes] = set()
    truth = []
    for t in p.texts:  # an exact duplicate: its key was seen before (what the sort method finds)
        key = exact_key(t)
        truth.append(key in first)
        first.add(key)
    (seen, facts), k_cpu = cpu(lambda: kiln_bloom(p.texts, rate, batch))
    peer, p_cpu = cpu(lambda: datatrove_bloom(p.texts, folder, rate))
    n, unique = len(p.texts), len(truth) - sum(truth)
    # A task's keys meet the filter holding the keys before the task (Bloom's formula per task).
    before = np.arange(n) // batch * batch
    expected = float(
        np.mean((1 - np.exp(-facts["probes"] * before / facts["bits"])) ** facts["probes"])
    )
    kiln = prf(seen.tolist(), truth)
    return {
        "stage": f"bloom exact dedup (p = {rate})",
        "docs": n,
        "kiln": {**kiln, "docs_per_cpu_s": n / k_cpu, **facts, "rate": rate,
                 "achieved_false_positive_rate": kiln["fp"] / unique,
                 "expected_false_positive_rate": expected},
        "datatrove": {**prf(peer, truth), "docs_per_cpu_s": n / p_cpu},
        "ratio": p_cpu / k_cpu,
    }  # fmt: skip


# --------------------------------------------------------------------------------- MinHash
def kiln_clusters(
    texts: list[str], bands: int, rows: int, jaccard: float
) -> tuple[np.ndarray, dict[str, int]]:
    """Cluster roots of kiln's MinHash-LSH, with Jaccard verification when `jaccard` > 0."""
    from kiln.data.pipeline.dedup import near, verify
    from kiln.data.pipeline.dedup.minhash import MinHashConfig, MinHasher

    hasher = MinHasher(MinHashConfig(bands=bands, rows=rows))
    batches: list[np.ndarray] = []
    keys = hasher.band_keys(hasher.signatures(texts, batches if jaccard > 0 else None))
    n = len(texts)
    nodes = np.arange(n, dtype=np.int64)
    if jaccard <= 0:
        representative, _ = near.near_duplicate_clusters(keys, nodes)
        return representative, {}
    values, offsets = [], [0]
    for sh, off in zip(batches[0::2], batches[1::2], strict=True):
        v, o = verify.distinct_shingles(sh, off)
        values.append(v)
        offsets.extend((o[1:] + offsets[-1]).tolist())
    flat, offs = np.concatenate(values), np.array(offsets)
    us, vs = [], []
    for b in range(bands):
        order = np.lexsort((nodes, keys[:, b]))
        u, v = verify.anchor_pairs(keys[order, b], nodes[order])
        us.append(u)
        vs.append(v)
    pairs = np.unique(np.stack([np.concatenate(us), np.concatenate(vs)], axis=1), axis=0)
    ok = verify.verify_pairs(pairs[:, 0], pairs[:, 1], lambda i: flat[offs[i] : offs[i + 1]],
                             jaccard)  # fmt: skip
    parent = np.arange(n, dtype=np.int64)
    near._union(parent, pairs[ok, 0], pairs[ok, 1])
    return near._find_all(parent), {"candidates": len(pairs), "verified": int(ok.sum())}


def datatrove_clusters(texts: list[str], folder: Path, bands: int, rows: int) -> np.ndarray:
    """Cluster labels of datatrove's four MinHash steps (bench/data_dedup.py's harness)."""
    dd = importlib.import_module("bench.data_dedup")
    orig = dd.MinhashConfig

    def config(**kw: Any) -> Any:
        return orig(**{**kw, "num_buckets": bands, "hashes_per_bucket": rows})

    dd.MinhashConfig = config
    try:
        return dd.run_datatrove(texts, folder)["cluster"]
    finally:
        dd.MinhashConfig = orig


def score_pairs(p: Planted, cluster: np.ndarray, tau: float) -> dict[str, Any]:
    """Pairs merged per Jaccard bin, and precision/recall with duplicates = Jaccard >= tau;
    merges of documents that are neither a planted pair nor a verbatim copy count as false
    positives."""
    merged = [bool(cluster[a] == cluster[b]) for a, b, _ in p.pairs]
    truth = [j >= tau for _, _, j in p.pairs]
    sizes = Counter(cluster.tolist())
    all_merged = sum(s * (s - 1) // 2 for s in sizes.values())
    copies = sum(bool(cluster[a] == cluster[b]) for a, b in p.copies)
    extra = all_merged - sum(merged) - copies
    out = prf(merged, truth)
    out["fp"] += extra
    out["precision"] = out["tp"] / (out["tp"] + out["fp"]) if out["tp"] + out["fp"] else 1.0
    out["other_merges"] = extra
    out["merged_by_bin"] = [
        sum(m for m, (_, _, j) in zip(merged, p.pairs, strict=True) if lo <= j < hi)
        / max(1, sum(lo <= j < hi for _, _, j in p.pairs))
        for lo, hi in BINS
    ]
    return out


def minhash_stage(p: Planted, folder: Path, tau: float, bands: int, rows: int) -> dict[str, Any]:
    """MinHash-LSH before and after Jaccard verification (kiln), and datatrove's MinHash."""
    (before, _), b_cpu = cpu(lambda: kiln_clusters(p.texts, bands, rows, 0.0))
    (after, checks), a_cpu = cpu(lambda: kiln_clusters(p.texts, bands, rows, tau))
    sub = folder / f"dt_{bands}x{rows}"
    sub.mkdir()
    peer, p_cpu = cpu(lambda: datatrove_clusters(p.texts, sub, bands, rows))
    n = len(p.texts)
    return {
        "stage": f"minhash {bands}x{rows}",
        "docs": n,
        "kiln_lsh": {**score_pairs(p, before, tau), "docs_per_cpu_s": n / b_cpu},
        "kiln": {**score_pairs(p, after, tau), "docs_per_cpu_s": n / a_cpu, **checks},
        "datatrove": {**score_pairs(p, peer, tau), "docs_per_cpu_s": n / p_cpu},
        "ratio": p_cpu / a_cpu,
    }


# ------------------------------------------------------------------------------------- run
def run(size: Size, tau: float = 0.7, min_documents: int = 3) -> dict[str, Any]:
    """Plant, measure every stage; every number the report prints."""
    from importlib.metadata import version

    from loguru import logger

    importlib.import_module("datatrove.pipeline.dedup")  # it installs its log sink on import
    logger.remove()  # datatrove logs every step at INFO
    planted, plant_s = cpu(lambda: plant(size))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows, info = doc_stages(planted, folder)
        rows.append(line_stage(planted, folder, min_documents))
        rows.append(bloom_stage(planted, folder, BLOOM_RATE))
        rows.append(minhash_stage(planted, folder, tau, 14, 8))
        rows.append(minhash_stage(planted, folder, tau, 20, 5))
    return {
        "docs": len(planted.texts),
        "kinds": dict(Counter(planted.kind)),
        "pairs_by_bin": [sum(lo <= j < hi for *_, j in planted.pairs) for lo, hi in BINS],
        "jaccard": tau,
        "min_documents": min_documents,
        "plant_cpu_s": plant_s,
        "datatrove": version("datatrove"),
        "models": info,
        "rows": rows,
    }


def _pr(side: dict[str, Any]) -> str:
    if "missing" in side:
        return "— | — | —"
    precision = "n/a" if side["precision"] != side["precision"] else f"{side['precision']:.3f}"
    return f"{precision} | {side['recall']:.3f} | {side['docs_per_cpu_s']:,.0f}"


def report(r: dict[str, Any]) -> str:
    """The result as Markdown."""
    out = [
        f"Planted corpus: {r['docs']} documents {r['kinds']}; near-duplicate pairs per Jaccard "
        f"bin {[f'{lo}-{hi}' for lo, hi in BINS]}: {r['pairs_by_bin']}; duplicates are pairs "
        f"at Jaccard >= {r['jaccard']}; line dedup min_documents = {r['min_documents']}; "
        f"datatrove {r['datatrove']}. Classifier held-out accuracy "
        f"{r['models']['classifier_held_out']['accuracy']:.3f}.",
        "",
        "| stage | kiln P | kiln R | kiln docs/CPU-s | datatrove P | datatrove R "
        "| datatrove docs/CPU-s | × (kiln ÷ datatrove speed) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        if "kiln_lsh" in row:
            out.append(f"| {row['stage']} LSH only | {_pr(row['kiln_lsh'])} | | | | |")
            name = f"{row['stage']} + Jaccard {r['jaccard']}"
        else:
            name = row["stage"]
        ratio = f"{row['ratio']:.2f}" if "ratio" in row else row["datatrove"].get("missing", "")
        out.append(f"| {name} | {_pr(row['kiln'])} | {_pr(row['datatrove'])} | {ratio} |")
    out.append("")
    for row in r["rows"]:
        if "recall_by_kind" in row["kiln"]:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in row["kiln"]["recall_by_kind"].items())
            out.append(f"- {row['stage']}: kiln recall by kind of low-quality text: {parts}")
        if "achieved_false_positive_rate" in row["kiln"]:
            k = row["kiln"]
            out.append(
                f"- {row['stage']}: kiln's filter {k['bits']:,} bits, {k['probes']} probes, fill "
                f"{k['fill']:.3f}; achieved false-positive rate {k['achieved_false_positive_rate']:.4f} "
                f"of unique documents vs {k['expected_false_positive_rate']:.4f} expected from "
                f"its load (tasks of 100 documents); datatrove's is a shingle-level filter "
                f"(a document > 80% of whose 13-grams were seen is dropped)"
            )
        if "kiln_lsh" in row:
            bins = " / ".join(f"{lo}-{hi}" for lo, hi in BINS)
            out.append(f"- {row['stage']}: share of planted pairs merged per bin ({bins}):")
            for side in ("kiln_lsh", "kiln", "datatrove"):
                shares = " / ".join(f"{x:.2f}" for x in row[side]["merged_by_bin"])
                out.append(f"  {side}: {shares} (other merges {row[side]['other_merges']})")
            out.append(
                f"  verification: {row['kiln']['candidates']} candidate pairs, "
                f"{row['kiln']['verified']} passed"
            )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: run and print (and optionally save the JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a few hundred documents (for the test)")
    ap.add_argument("--jaccard", type=float, default=0.7, help="duplicate / verify threshold")
    ap.add_argument("--min-documents", type=int, default=3, help="line dedup threshold")
    ap.add_argument("--json", type=Path, help="also write the result here")
    add_noisy_flag(ap)
    args = ap.parse_args(argv)
    measured = begin("bench/data_planted.py", args.noisy)
    result = run(TINY if args.tiny else FULL, args.jaccard, args.min_documents)
    print(report(result))
    print(measured.line())
    if args.json:
        from kiln.io import write_json_atomic

        write_json_atomic(args.json, measured.stamp(result))


if __name__ == "__main__":
    main()
