"""Benchmark kiln's MinHash near dedup side by side with datatrove's, on planted near-duplicates.

Corpus: the first N documents of ../shared/data/bench/en_10m.txt.gz; 10% of them (seeded) get a
copy with 3-5% of the words substituted (by a random corpus word) or deleted, inserted at a
random position. Both sides use word 5-grams, 14 bands x 8 rows, 64-bit hashes, and run end
to end in this process:
- kiln: MinHasher.signatures + band_keys, the band keys written as one .npy per band and read
  back (as the pipeline shards them), near_duplicate_clusters, then the keep mask applied;
- datatrove: MinhashDedupSignature, MinhashDedupBuckets (one rank per bucket),
  MinhashDedupCluster (save_cluster_id, to score clusters), MinhashDedupFilter, all writing
  their files to a temporary folder as they do in production.
CPU time is time.process_time() plus any child processes' (RUSAGE_CHILDREN).

Offline notes on datatrove: its English word tokenizer is spaCy's, not installed here; it runs
with a whitespace tokenizer instead, which after its own `simplify_text` (lowercase, punctuation
to spaces) splits the same words and is the cheapest tokenizer it could have, so its speed here
is an upper bound. Its default 64-bit hash (xxhash) is passed `str`, which the installed xxhash
rejects; the bench wraps it to hash the UTF-8 bytes, as older xxhash releases did internally.

Scores, on the planted pairs: recall = pairs placed in one cluster / pairs (with the mean
14x8 catch probability of their true Jaccard as the expectation for an ideal MinHash);
precision = removed documents whose true word-5-gram Jaccard with another member of their
cluster is >= 0.5 / removed documents, each side's Jaccard computed on its own words (kiln:
GPT-3's lowercase, punctuation-free words; datatrove: `simplify_text`, which also maps every
number to 0, so templated documents that differ only in numbers are duplicates to it). The
corpus has natural near-duplicates, so more documents are removed than were planted. datasketch's MinHash (signatures only, 112
permutations, the same shingles) is timed for orientation. Last, kiln's clustering alone runs
on 1 M synthetic documents' band keys: CPU time and peak memory per document (tracemalloc).

    python bench/data_dedup.py                 # 5,000 documents
    python bench/data_dedup.py --docs 1000 --scale-docs 0     # quick look
"""

from __future__ import annotations

import argparse
import gzip
import platform
import resource
import struct
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

# The peer is imported before any timing starts, as kiln is.
from datatrove.data import Document
from datatrove.pipeline.dedup.minhash import (
    MinhashConfig,
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupFilter,
    MinhashDedupSignature,
)
from datatrove.utils.hashing import HashConfig
from datatrove.utils.text import simplify_text
from datatrove.utils.word_tokenizers import WordTokenizer
from loguru import logger

# Run as a script from a plain checkout too.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._load import add_noisy_flag, begin  # noqa: E402
from kiln.data.pipeline.dedup.minhash import MinHashConfig, MinHasher, normalized_words  # noqa: E402
from kiln.data.pipeline.dedup.near import near_duplicate_clusters  # noqa: E402

CORPUS = REPO.parent / "shared" / "data" / "bench" / "en_10m.txt.gz"
EOT_LINE = "\n<|endoftext|>\n"
PLANT_FRACTION = 0.10
EDIT_RATE = (0.03, 0.05)
TRUE_DUP_JACCARD = 0.5


# ------------------------------------------------------------------------------------ corpus
def load_docs(n_docs: int, path: Path = CORPUS) -> list[str]:
    """The first `n_docs` non-empty documents of the corpus."""
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        docs = [d.strip() for d in handle.read().split(EOT_LINE)]
    return [d for d in docs if d][:n_docs]


def plant_near_duplicates(
    docs: list[str], seed: int = 0
) -> tuple[list[str], list[tuple[int, int]]]:
    """Docs plus edited copies of 10% of them, shuffled; returns (docs, [(original, copy)])."""
    rng = np.random.default_rng(seed)
    vocabulary = sorted({w for d in docs[:500] for w in d.split()})
    sources = rng.choice(len(docs), size=round(PLANT_FRACTION * len(docs)), replace=False)
    texts, copy_of = list(docs), {}
    for src in sources.tolist():
        words = docs[src].split()
        edits = rng.random(len(words)) < rng.uniform(*EDIT_RATE)
        out = []
        for word, edit in zip(words, edits, strict=True):
            if not edit:
                out.append(word)
            elif rng.random() < 0.5:  # substitute; otherwise delete
                out.append(vocabulary[rng.integers(len(vocabulary))])
        copy_of[len(texts)] = src
        texts.append(" ".join(out))
    perm = rng.permutation(len(texts))  # new position -> old index
    where = np.empty_like(perm)
    where[perm] = np.arange(len(texts))  # old index -> new position
    shuffled = [texts[i] for i in perm]
    pairs = sorted((int(where[src]), int(where[c])) for c, src in copy_of.items())
    return shuffled, pairs


def cpu_seconds() -> float:
    """This process's CPU time plus that of its finished children."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn(), CPU seconds it took)."""
    start = cpu_seconds()
    out = fn()
    return out, cpu_seconds() - start


# -------------------------------------------------------------------------------------- kiln
def run_kiln(texts: list[str], workdir: Path) -> dict[str, Any]:
    """Signatures -> per-band .npy shards -> clusters -> kept documents; cluster labels."""
    cfg = MinHashConfig()
    hasher = MinHasher(cfg)
    keys = hasher.band_keys(hasher.signatures(texts))
    for b in range(cfg.bands):
        np.save(workdir / f"band_{b:03d}.npy", np.ascontiguousarray(keys[:, b]))
    columns = [np.load(workdir / f"band_{b:03d}.npy") for b in range(cfg.bands)]
    representative, keep = near_duplicate_clusters(columns, np.arange(len(texts)))
    kept = [t for t, k in zip(texts, keep, strict=True) if k]
    return {"cluster": representative, "removed": np.flatnonzero(~keep), "kept": len(kept)}


# --------------------------------------------------------------------------------- datatrove
class WhitespaceTokenizer(WordTokenizer):
    """str.split: what a word tokenizer returns on datatrove's simplified text."""

    def word_tokenize(self, text: str) -> list[str]:
        return text.split()

    def sent_tokenize(self, text: str) -> list[str]:
        return [text]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return [(0, len(text))]


def run_datatrove(texts: list[str], workdir: Path) -> dict[str, Any]:
    """datatrove's four MinHash steps on the same texts, files in `workdir`."""
    sigs, buckets, remove_ids = (str(workdir / name) for name in ("sigs", "buckets", "remove_ids"))
    cfg = MinhashConfig(
        n_grams=5, num_buckets=14, hashes_per_bucket=8, hash_config=HashConfig(precision=64)
    )
    docs = [Document(text=t, id=str(i)) for i, t in enumerate(texts)]
    signature = MinhashDedupSignature(sigs, config=cfg, language=WhitespaceTokenizer())
    signature._hash_func = lambda s: xxhash.xxh64_intdigest(s.encode("utf-8"))
    signature.run(iter(docs))
    for bucket in range(cfg.num_buckets):
        MinhashDedupBuckets(sigs, buckets, config=cfg).run(rank=bucket, world_size=cfg.num_buckets)
    MinhashDedupCluster(buckets, remove_ids, config=cfg, save_cluster_id=True).run()
    kept = list(MinhashDedupFilter(remove_ids).run(iter(docs)))
    kept_ids = {int(d.id) for d in kept}
    cluster = np.arange(len(texts))  # singletons unless listed
    clusters_file = workdir / "remove_ids" / "000000.clusters"
    if clusters_file.exists():
        data = clusters_file.read_bytes()
        for doc, cid in struct.iter_unpack("<II", data):
            cluster[doc] = len(texts) + cid  # cluster ids apart from document indices
    removed = np.array(sorted(set(range(len(texts))) - kept_ids), dtype=np.int64)
    return {"cluster": cluster, "removed": removed, "kept": len(kept)}


# --------------------------------------------------------------------------------- datasketch
def datasketch_signatures(texts: list[str]) -> int:
    """datasketch MinHash signatures (112 permutations) over the same word 5-grams."""
    from datasketch import MinHash

    for text in texts:
        words = normalized_words(text)
        shingles = [" ".join(words[i : i + 5]).encode() for i in range(max(len(words) - 4, 1))]
        m = MinHash(num_perm=112, seed=1)
        m.update_batch(shingles)
    return len(texts)


# --------------------------------------------------------------------------- clustering scale
def clustering_scale(n_docs: int, seed: int = 0) -> dict[str, float]:
    """near_duplicate_clusters alone on n synthetic documents (10% share some bands with
    another): CPU seconds and peak memory it allocates beyond its input, per document."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 2**63, size=(n_docs, 14), dtype=np.uint64)
    dup, src = (
        rng.choice(n_docs, n_docs // 10, replace=False),
        rng.integers(0, n_docs, n_docs // 10),
    )
    for b in range(14):
        linked = rng.random(len(dup)) < 0.3
        keys[dup[linked], b] = keys[src[linked], b]
    columns = [np.ascontiguousarray(keys[:, b]) for b in range(14)]
    del keys
    tracemalloc.start()
    (_, keep), cpu = timed(lambda: near_duplicate_clusters(columns, np.arange(n_docs)))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "docs": n_docs,
        "cpu_s": cpu,
        "peak_bytes_per_doc": peak / n_docs,
        "kept": int(keep.sum()),
    }


# ----------------------------------------------------------------------------------- scoring
def ngram_set(text: str, words_of: Callable[[str], list[str]] = normalized_words) -> set[tuple]:
    """The word 5-grams of a text (the whole word sequence if shorter)."""
    words = words_of(text)
    return {tuple(words[i : i + 5]) for i in range(max(len(words) - 4, 1))}


def datatrove_words(text: str) -> list[str]:
    """Words as datatrove's MinHash sees them: simplify_text (numbers -> 0, ...), split."""
    return simplify_text(text).split()


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def score(
    result: dict[str, Any], pairs: list[tuple[int, int]], sets: Callable[[int], set]
) -> dict[str, Any]:
    """Recall on the planted pairs and verified precision of the removals."""
    cluster = result["cluster"]
    caught = sum(int(cluster[a] == cluster[b]) for a, b in pairs)
    members: dict[int, list[int]] = {}
    for i, c in enumerate(cluster.tolist()):
        members.setdefault(c, []).append(i)
    correct = 0
    for i in result["removed"].tolist():
        mates = [j for j in members[int(cluster[i])] if j != i]
        correct += any(jaccard(sets(i), sets(j)) >= TRUE_DUP_JACCARD for j in mates)
    removed = len(result["removed"])
    return {
        "recall": caught / len(pairs),
        "pairs_caught": caught,
        "removed": removed,
        "precision": correct / removed if removed else 1.0,
    }


# --------------------------------------------------------------------------------------- run
def run(n_docs: int = 5000, scale_docs: int = 1_000_000) -> dict[str, Any]:
    """Time and score both sides on `n_docs` documents plus their planted copies; then time
    kiln's clustering alone on `scale_docs` synthetic documents (0: skip)."""
    logger.remove()  # datatrove logs every step at INFO
    texts, pairs = plant_near_duplicates(load_docs(n_docs))

    def set_cache(words_of: Callable[[str], list[str]]) -> Callable[[int], set]:
        cache: dict[int, set] = {}

        def sets(i: int) -> set:
            if i not in cache:
                cache[i] = ngram_set(texts[i], words_of)
            return cache[i]

        return sets

    sets, peer_sets = set_cache(normalized_words), set_cache(datatrove_words)

    cfg = MinHashConfig()
    true_j = np.array([jaccard(sets(a), sets(b)) for a, b in pairs])
    expected_recall = float(np.mean([cfg.catch_probability(j) for j in true_j]))

    MinHasher(cfg).signatures(texts[:50])  # warm-up: imports, first allocations
    with tempfile.TemporaryDirectory() as kdir, tempfile.TemporaryDirectory() as ddir:
        kiln, kiln_s = timed(lambda: run_kiln(texts, Path(kdir)))
        peer, peer_s = timed(lambda: run_datatrove(texts, Path(ddir)))
    _, sketch_s = timed(lambda: datasketch_signatures(texts))

    n = len(texts)
    out = {
        "docs": n,
        "planted_pairs": len(pairs),
        "planted_jaccard_mean": float(true_j.mean()),
        "expected_recall_14x8": expected_recall,
        "kiln": {"cpu_s": kiln_s, "docs_per_cpu_s": n / kiln_s, **score(kiln, pairs, sets)},
        "datatrove": {
            "cpu_s": peer_s,
            "docs_per_cpu_s": n / peer_s,
            **score(peer, pairs, peer_sets),
        },
        "datasketch_signatures_docs_per_cpu_s": n / sketch_s,
    }
    out["ratio_kiln_over_datatrove"] = peer_s / kiln_s
    if scale_docs:
        out["kiln_clustering_scale"] = clustering_scale(scale_docs)
    return out


def print_report(r: dict[str, Any]) -> None:
    """A short human-readable table."""
    print(
        f"# near dedup, {r['docs']} docs ({r['planted_pairs']} planted copies), "
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}"
    )
    print(
        f"planted pairs: mean true Jaccard {r['planted_jaccard_mean']:.3f}, "
        f"expected recall at 14x8 {r['expected_recall_14x8']:.3f}"
    )
    print(f"{'':10} {'docs/cpu-s':>11} {'cpu s':>7} {'recall':>7} {'precision':>9} {'removed':>8}")
    for side in ("kiln", "datatrove"):
        s = r[side]
        print(
            f"{side:10} {s['docs_per_cpu_s']:11.0f} {s['cpu_s']:7.2f} {s['recall']:7.3f} "
            f"{s['precision']:9.3f} {s['removed']:8d}"
        )
    print(
        f"ratio kiln/datatrove (docs per CPU-second): {r['ratio_kiln_over_datatrove']:.2f}x "
        "(target >= 2x)"
    )
    print(
        f"datasketch MinHash, signatures only: "
        f"{r['datasketch_signatures_docs_per_cpu_s']:.0f} docs/cpu-s"
    )
    if scale := r.get("kiln_clustering_scale"):
        print(
            f"kiln clustering alone, {scale['docs']:,} docs x 14 bands: {scale['cpu_s']:.2f} "
            f"cpu-s, peak {scale['peak_bytes_per_doc']:.0f} B/doc beyond the band keys"
        )


def main() -> None:
    """Parse --docs, run, print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=5000)
    parser.add_argument("--scale-docs", type=int, default=1_000_000, help="0 to skip")
    add_noisy_flag(parser)
    args = parser.parse_args()
    measured = begin("bench/data_dedup.py", args.noisy)
    print_report(run(args.docs, args.scale_docs))
    print(measured.line())


if __name__ == "__main__":
    main()
