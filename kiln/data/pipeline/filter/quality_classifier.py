"""A fastText-style quality classifier: a linear model over hashed bags of word n-grams.

The DCLM recipe (Li et al. 2024, "DataComp-LM", Sec. 4.4) trains fastText to tell a
high-quality reference set from random pipeline input and keeps the documents it scores
highest. kiln trains the same kind of model itself (`kiln data classifier train`): fastText's
supervised mode with its default 2-gram features reduces, for two labels, to logistic regression
on the average of the document's n-gram vectors; here that vector is one weight per hash bucket.
Features are the lowercased `\\w+` words and their n-grams up to `ngrams`, hashed (CRC-32) into
`buckets` buckets, as fastText hashes its n-grams. Training is plain SGD in a seeded order with
fastText's linearly decaying learning rate, single-threaded, so the same inputs give the same
model bytes. (The `fasttext` wheel installs here but its `predict` fails on NumPy 2, and its
multi-threaded training is not reproducible.)

The model file also holds the score quantiles of the negative (pipeline input) sample, so a
keep-fraction becomes a fixed threshold per document, as CCNet's perplexity cutoffs are: the
verdict never depends on which other documents a worker sees.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data.pipeline.document import Document
from kiln.errors import KilnError
from kiln.io import atomic_write

FORMAT = "kiln-quality-classifier"
VERSION = 1
WORD_RE = re.compile(r"\w+")
QUANTILES = 1001  # score quantiles of the negative sample, at steps of 0.1 %


def features(text: str, ngrams: int, buckets: int) -> np.ndarray:
    """The hash buckets of a text's word n-grams (1..ngrams), one entry per occurrence."""
    words = WORD_RE.findall(text.lower())
    grams = list(words)
    for n in range(2, ngrams + 1):
        grams.extend(" ".join(words[i : i + n]) for i in range(len(words) - n + 1))
    return np.fromiter(
        (zlib.crc32(g.encode("utf-8")) % buckets for g in grams), dtype=np.int64, count=len(grams)
    )


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


@dataclass
class LinearClassifier:
    """Weights per hash bucket and a bias; `score` is P(positive | text)."""

    weights: np.ndarray  # (buckets,) float32
    bias: float
    ngrams: int
    info: dict[str, Any]  # training record: sources, counts, held-out accuracy, quantiles

    @property
    def buckets(self) -> int:
        """How many hash buckets the features fall into."""
        return int(self.weights.shape[0])

    def score(self, text: str) -> float:
        """The probability that `text` is from the positive (high-quality) source."""
        idx = features(text, self.ngrams, self.buckets)
        if idx.size == 0:
            return _sigmoid(self.bias)
        # Summed in float64 in index order: the same score on every machine and worker.
        return _sigmoid(self.bias + float(self.weights[idx].astype(np.float64).mean()))

    def threshold_for_keep_fraction(self, keep_fraction: float) -> float:
        """The score above which `keep_fraction` of the negative (pipeline input) sample lies."""
        quantiles = self.info.get("negative_quantiles")
        if not quantiles:
            raise KilnError("the classifier file has no negative-sample quantiles; retrain it")
        q = np.asarray(quantiles, dtype=np.float64)
        return float(np.interp(1.0 - keep_fraction, np.linspace(0.0, 1.0, q.size), q))

    def save(self, path: str | Path) -> None:
        """Write the model as one `.npz`, atomically."""
        header = {"format": FORMAT, "version": VERSION, "ngrams": self.ngrams, **self.info}
        with atomic_write(path, "wb") as handle:
            np.savez(
                handle,
                weights=self.weights.astype(np.float32),
                bias=np.array([self.bias], dtype=np.float64),
                header=np.array(json.dumps(header, sort_keys=True)),
            )

    @classmethod
    def load(cls, path: str | Path, where: str = "quality.classifier.model") -> LinearClassifier:
        """Read a model written by `save`; a missing or foreign file is one clear error."""
        try:
            with np.load(path, allow_pickle=False) as data:
                header = json.loads(str(data["header"]))
                weights, bias = data["weights"], float(data["bias"][0])
        except FileNotFoundError:
            raise KilnError(
                f"{where} = {str(path)!r}: no such file; train one with "
                f"`kiln data classifier train`"
            ) from None
        except (OSError, ValueError, KeyError) as e:
            raise KilnError(f"{where} = {str(path)!r}: not a kiln classifier file ({e})") from None
        if header.get("format") != FORMAT or header.get("version") != VERSION:
            raise KilnError(f"{where} = {str(path)!r}: not a {FORMAT} v{VERSION} file")
        ngrams = int(header.pop("ngrams"))
        header.pop("format")
        header.pop("version")
        return cls(weights, bias, ngrams, header)


def train_linear(
    positive: list[str],
    negative: list[str],
    *,
    ngrams: int = 2,
    buckets: int = 1 << 20,
    epochs: int = 5,
    lr: float = 0.1,
    seed: int = 0,
) -> LinearClassifier:
    """SGD on the logistic loss, averaged n-gram features, learning rate decaying to 0."""
    if not positive or not negative:
        raise KilnError("classifier training needs positive and negative documents")
    docs = [features(t, ngrams, buckets) for t in positive + negative]
    labels = np.array([1.0] * len(positive) + [0.0] * len(negative))
    # Each class weighs the same in the loss whatever the sizes, as DCLM samples them equally.
    class_weight = np.where(labels == 1.0, 0.5 / len(positive), 0.5 / len(negative)) * len(docs)
    weights = np.zeros(buckets, dtype=np.float64)
    bias = 0.0
    rng = np.random.default_rng(seed)
    steps, step = epochs * len(docs), 0
    for _ in range(epochs):
        for i in rng.permutation(len(docs)):
            rate = lr * (1.0 - step / steps)
            step += 1
            idx = docs[i]
            z = bias + (weights[idx].mean() if idx.size else 0.0)
            grad = (_sigmoid(z) - labels[i]) * class_weight[i] * rate
            bias -= grad
            if idx.size:
                np.add.at(weights, idx, -grad / idx.size)
    return LinearClassifier(weights.astype(np.float32), bias, ngrams, {})


@dataclass(frozen=True)
class ClassifierConfig:
    """Keep documents the model scores at or above a threshold (or in the top keep-fraction)."""

    enabled: bool = False
    model: str = ""  # a file written by `kiln data classifier train`
    threshold: float | None = None  # keep a document whose P(positive) >= threshold
    keep_fraction: float | None = None  # or: keep this share of pipeline-like input

    def __post_init__(self) -> None:
        where = "quality.classifier"
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise KilnError(f"[{where}] threshold = {self.threshold}: expected a value in [0, 1]")
        if self.keep_fraction is not None and not 0.0 < self.keep_fraction <= 1.0:
            raise KilnError(
                f"[{where}] keep_fraction = {self.keep_fraction}: expected a fraction in (0, 1]"
            )
        if not self.enabled:
            return
        if not self.model:
            raise KilnError(f"[{where}] model: give the file `kiln data classifier train` wrote")
        if (self.threshold is None) == (self.keep_fraction is None):
            raise KilnError(f"[{where}]: give threshold or keep_fraction (one of them)")


class ClassifierFilter:
    """Scores each document; removes it below the threshold, with its score in the audit."""

    name = "classifier"

    def __init__(self, config: ClassifierConfig) -> None:
        self.config = config
        self.model = LinearClassifier.load(config.model)
        if config.keep_fraction is not None:
            self.threshold = self.model.threshold_for_keep_fraction(config.keep_fraction)
        else:
            self.threshold = float(config.threshold or 0.0)

    def apply(self, doc: Document) -> str | None:
        """Keep `doc` if its score reaches the threshold; record the score in `meta["scores"]`."""
        score = self.model.score(doc.text)
        doc.meta.setdefault("scores", {})["classifier"] = round(score, 6)
        return None if score >= self.threshold else "classifier.low_score"
