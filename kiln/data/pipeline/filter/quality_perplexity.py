"""CCNet's perplexity buckets (Wenzek et al. 2020, "CCNet", Sec. 3.3) with a kiln n-gram LM.

CCNet scores every paragraph with a 5-gram KenLM model trained on Wikipedia and splits each
language's documents into head, middle and tail at the 30th and 60th percentile of perplexity,
the cutoffs computed once on a sample of the crawl (`cutoff.csv`). kiln does the same with its
own word n-gram model (`kiln data perplexity train`): interpolated absolute discounting
(Ney et al. 1994, D = 0.75) down to an add-one unigram that gives unseen words their share,
each non-empty line a sentence between <s> and </s>, words the lowercased `\\w+` runs. The model
file holds the perplexity quantiles of a sample of pipeline input, so the bucket of a document
depends only on the document: any worker count gives the same buckets.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data.pipeline.document import Document
from kiln.errors import KilnError
from kiln.io import atomic_write

FORMAT = "kiln-ngram-lm"
VERSION = 1
WORD_RE = re.compile(r"\w+")
DISCOUNT = 0.75
ID_BITS = 21  # up to 2M word types; an n-gram of ids packs into one integer
UNK, BOS, EOS = 0, 1, 2
BUCKETS = ("head", "middle", "tail")


def sentences(text: str) -> list[list[str]]:
    """The lowercased words of each non-empty line."""
    out = []
    for line in text.lower().splitlines():
        words = WORD_RE.findall(line)
        if words:
            out.append(words)
    return out


def _pack(ids: Iterable[int]) -> int:
    key = 0
    for i in ids:
        key = (key << ID_BITS) | i
    return key


@dataclass
class NGramLM:
    """Word n-gram counts, with the vocabulary that numbers the words."""

    order: int
    vocab: dict[str, int]
    counts: list[dict[int, int]]  # counts[k]: (k+1)-grams (packed ids) -> count
    contexts: list[dict[int, tuple[int, int]]]  # contexts[k]: k-gram -> (total, distinct next)
    info: dict[str, Any]

    def _ids(self, words: list[str]) -> list[int]:
        return [BOS] * (self.order - 1) + [self.vocab.get(w, UNK) for w in words] + [EOS]

    def _prob(self, history: list[int], word: int) -> float:
        unigrams = self.counts[0]
        total = self.info["tokens"]
        p = (unigrams.get(word, 0) + 1) / (total + len(self.vocab))
        for k in range(1, self.order):
            context = history[len(history) - k :]
            seen = self.contexts[k].get(_pack(context))
            if seen is None:
                break  # a longer context than one never seen cannot have been seen either
            count = self.counts[k].get(_pack([*context, word]), 0)
            ctx_total, distinct = seen
            p = max(count - DISCOUNT, 0.0) / ctx_total + DISCOUNT * distinct / ctx_total * p
        return p

    def log_prob(self, text: str) -> tuple[float, int]:
        """(natural-log probability of the text's words and sentence ends, how many there are)."""
        logp, n = 0.0, 0
        for words in sentences(text):
            ids = self._ids(words)
            for i in range(self.order - 1, len(ids)):
                logp += math.log(self._prob(ids[i - self.order + 1 : i], ids[i]))
                n += 1
        return logp, n

    def perplexity(self, text: str) -> float:
        """exp of the mean negative log-probability per word (a text without words: inf)."""
        logp, n = self.log_prob(text)
        return math.exp(-logp / n) if n else math.inf

    def save(self, path: str | Path) -> None:
        """Write the model as one `.npz` (packed n-gram keys and counts), atomically."""
        words = sorted(self.vocab, key=self.vocab.__getitem__)
        header = {"format": FORMAT, "version": VERSION, "order": self.order, **self.info}
        arrays: dict[str, np.ndarray] = {
            "header": np.array(json.dumps(header, sort_keys=True)),
            "vocab": np.array("\n".join(words)),
        }
        for k, table in enumerate(self.counts):
            keys = sorted(table)
            # Keys can exceed 64 bits for high orders: stored as decimal text.
            arrays[f"keys{k}"] = np.array(" ".join(map(str, keys)))
            arrays[f"counts{k}"] = np.array([table[key] for key in keys], dtype=np.int64)
        with atomic_write(path, "wb") as handle:
            np.savez_compressed(handle, **arrays)

    @classmethod
    def load(cls, path: str | Path, where: str = "quality.perplexity.model") -> NGramLM:
        """Read a model written by `save`; a missing or foreign file is one clear error."""
        try:
            with np.load(path, allow_pickle=False) as data:
                header = json.loads(str(data["header"]))
                if header.get("format") != FORMAT or header.get("version") != VERSION:
                    raise ValueError(f"not a {FORMAT} v{VERSION} file")
                words = str(data["vocab"]).split("\n")
                counts = []
                for k in range(int(header["order"])):
                    keys = [int(x) for x in str(data[f"keys{k}"]).split()]
                    counts.append(dict(zip(keys, data[f"counts{k}"].tolist(), strict=True)))
        except FileNotFoundError:
            raise KilnError(
                f"{where} = {str(path)!r}: no such file; train one with "
                f"`kiln data perplexity train`"
            ) from None
        except (OSError, ValueError, KeyError) as e:
            raise KilnError(f"{where} = {str(path)!r}: not a kiln n-gram LM file ({e})") from None
        order = int(header.pop("order"))
        header.pop("format")
        header.pop("version")
        vocab = {w: i for i, w in enumerate(words)}
        return cls(order, vocab, counts, _contexts(counts), header)


def _contexts(counts: list[dict[int, int]]) -> list[dict[int, tuple[int, int]]]:
    """For each order k >= 1: k-gram context -> (count of (k+1)-grams after it, distinct ones)."""
    out: list[dict[int, tuple[int, int]]] = [{}]
    for table in counts[1:]:
        ctx: dict[int, list[int]] = {}
        for key, c in table.items():
            entry = ctx.setdefault(key >> ID_BITS, [0, 0])
            entry[0] += c
            entry[1] += 1
        out.append({k: (v[0], v[1]) for k, v in ctx.items()})
    return out


def train_ngram(texts: Iterable[str], order: int = 3, min_count: int = 1) -> NGramLM:
    """Count the n-grams of the texts; words seen fewer than `min_count` times become <unk>."""
    if order < 1:
        raise KilnError(f"order = {order}: expected >= 1")
    corpus = [s for t in texts for s in sentences(t)]
    if not corpus:
        raise KilnError("the reference corpus has no words")
    freq = Counter(w for s in corpus for w in s)
    kept = sorted((w for w, c in freq.items() if c >= min_count), key=lambda w: (-freq[w], w))
    if len(kept) + 3 >= 1 << ID_BITS:
        raise KilnError(f"vocabulary of {len(kept):,} words: raise min_count")
    vocab = {"<unk>": UNK, "<s>": BOS, "</s>": EOS}
    vocab.update({w: i + 3 for i, w in enumerate(kept)})
    counts: list[Counter[int]] = [Counter() for _ in range(order)]
    tokens = 0
    for words in corpus:
        ids = [BOS] * (order - 1) + [vocab.get(w, UNK) for w in words] + [EOS]
        for i in range(order - 1, len(ids)):
            tokens += 1
            for k in range(order):
                counts[k][_pack(ids[i - k : i + 1])] += 1
    tables = [dict(c) for c in counts]
    info = {"tokens": tokens, "sentences": len(corpus), "vocab_size": len(vocab)}
    return NGramLM(order, vocab, tables, _contexts(tables), info)


@dataclass(frozen=True)
class PerplexityConfig:
    """Bucket documents by the reference LM's perplexity (CCNet) and keep the chosen buckets."""

    enabled: bool = False
    model: str = ""  # a file written by `kiln data perplexity train`
    percentile_head: float = 30.0  # below this percentile of the sample's perplexity: head
    percentile_tail: float = 60.0  # above this one: tail; between: middle
    keep: tuple[str, ...] = ("head", "middle")

    def __post_init__(self) -> None:
        where = "quality.perplexity"
        if not 0.0 <= self.percentile_head <= self.percentile_tail <= 100.0:
            raise KilnError(
                f"[{where}] percentile_head = {self.percentile_head}, percentile_tail = "
                f"{self.percentile_tail}: expected 0 <= head <= tail <= 100"
            )
        bad = [b for b in self.keep if b not in BUCKETS]
        if bad or not self.keep:
            raise KilnError(f"[{where}] keep = {list(self.keep)}: expected some of {BUCKETS}")
        if self.enabled and not self.model:
            raise KilnError(f"[{where}] model: give the file `kiln data perplexity train` wrote")


class PerplexityFilter:
    """Scores each document, records its perplexity and bucket, removes unwanted buckets."""

    name = "perplexity"

    def __init__(self, config: PerplexityConfig) -> None:
        self.config = config
        self.model = NGramLM.load(config.model)
        quantiles = self.model.info.get("sample_quantiles")
        if not quantiles:
            raise KilnError(
                f"quality.perplexity.model = {config.model!r}: holds no sample quantiles; "
                f"retrain it with a [[sample]] source"
            )
        q = np.asarray(quantiles, dtype=np.float64)
        grid = np.linspace(0.0, 100.0, q.size)
        self.head_cutoff = float(np.interp(config.percentile_head, grid, q))
        self.tail_cutoff = float(np.interp(config.percentile_tail, grid, q))

    def bucket(self, perplexity: float) -> str:
        """head, middle or tail for a perplexity, by the sample's cutoffs."""
        if perplexity <= self.head_cutoff:
            return "head"
        return "middle" if perplexity <= self.tail_cutoff else "tail"

    def apply(self, doc: Document) -> str | None:
        """Keep `doc` if its bucket is kept; record perplexity and bucket in `meta`."""
        ppl = self.model.perplexity(doc.text)
        bucket = self.bucket(ppl)
        doc.meta.setdefault("scores", {})["perplexity"] = round(ppl, 3) if ppl < math.inf else None
        doc.meta["perplexity_bucket"] = bucket
        return None if bucket in self.config.keep else f"perplexity.{bucket}"
