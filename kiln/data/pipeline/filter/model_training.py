"""`kiln data classifier train` and `kiln data perplexity train`: the models of the two
model-based quality stages, trained from sources named in TOML like the pipeline's.

The classifier follows DCLM: positive documents from a high-quality reference set, negative
ones from random pipeline input. A seeded hash puts `held_out` of each class aside; the model
is trained on the rest and its accuracy on the held-out documents is stored in the model file
(and shown in the pipeline report). With `[[annotations]]` instead (FineWeb-Edu, Penedo et al.
2024): documents scored 0-5 by an LM (`kiln data annotate`), positive at `positive_score` or
above (FineWeb-Edu's 3); the held-out report then adds the Spearman correlation between the
classifier's score and the annotations. The perplexity LM is trained on `reference` sources and
its percentile cutoffs are taken from `sample` sources (pipeline input), as CCNet's are.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln import config as cfgio
from kiln.data.pipeline.config import SourceSpec
from kiln.data.pipeline.filter.quality_classifier import QUANTILES, train_linear
from kiln.data.pipeline.filter.quality_perplexity import train_ngram
from kiln.data.pipeline.read.readers import ReadIssues, detect_format, iter_records
from kiln.data.pipeline.records import unit_interval
from kiln.errors import KilnError


@dataclass(frozen=True)
class ClassifierTrainConfig:
    """Positive vs negative sources (or LM-scored annotations), the held-out share, and
    fastText-like settings."""

    positive: tuple[SourceSpec, ...] = ()
    negative: tuple[SourceSpec, ...] = ()
    annotations: tuple[SourceSpec, ...] = ()  # JSONL with a text and a 0-5 score per document
    score_field: str = "score"
    positive_score: float = 3.0  # an annotated document at or above this is positive
    output: str = "quality_classifier.npz"
    max_documents: int = 20_000  # per class, the first ones in source order
    held_out: float = 0.1
    seed: int = 0
    epochs: int = 10  # fastText's 5 underfits a few hundred documents a class
    lr: float = 2.0  # per-document steps are shared over its n-grams (averaged features)
    ngrams: int = 2
    buckets: int = 1 << 20

    def __post_init__(self) -> None:
        if self.annotations and (self.positive or self.negative):
            raise KilnError("annotations: give [[annotations]] or [[positive]]/[[negative]], "
                            "not both")  # fmt: skip
        if not self.annotations:
            if not self.positive:
                raise KilnError("positive: give at least one [[positive]] source")
            if not self.negative:
                raise KilnError("negative: give at least one [[negative]] source")
        if not 0.0 < self.held_out < 1.0:
            raise KilnError(f"held_out = {self.held_out}: expected a fraction in (0, 1)")
        for name in ("max_documents", "epochs", "ngrams", "buckets"):
            if getattr(self, name) < 1:
                raise KilnError(f"{name} = {getattr(self, name)}: expected >= 1")
        if self.lr <= 0:
            raise KilnError(f"lr = {self.lr}: expected > 0")


@dataclass(frozen=True)
class PerplexityTrainConfig:
    """The reference corpus of the LM and the pipeline-input sample its cutoffs come from."""

    reference: tuple[SourceSpec, ...]
    sample: tuple[SourceSpec, ...]
    output: str = "perplexity_lm.npz"
    order: int = 3
    min_count: int = 1
    max_documents: int = 50_000  # per role, the first ones in source order

    def __post_init__(self) -> None:
        if not self.reference:
            raise KilnError("reference: give at least one [[reference]] source")
        if not self.sample:
            raise KilnError("sample: give at least one [[sample]] source (pipeline input)")
        for name in ("order", "min_count", "max_documents"):
            if getattr(self, name) < 1:
                raise KilnError(f"{name} = {getattr(self, name)}: expected >= 1")


def _resolve(path: str, base: Path) -> str:
    expanded = os.path.expanduser(path)
    return expanded if os.path.isabs(expanded) else os.path.normpath(base / expanded)


def source_texts(specs: tuple[SourceSpec, ...], base: Path, role: str, limit: int) -> list[str]:
    """The first `limit` document texts of the sources, files in sorted order per pattern."""
    texts: list[str] = []
    for spec in specs:
        for pattern in spec.paths:
            hits = sorted(h for h in glob.glob(_resolve(pattern, base)) if os.path.isfile(h))
            if not hits:
                raise KilnError(f"{role}[{spec.name!r}]: {pattern} matches no file")
            for path in hits:
                fmt = detect_format(path) if spec.format == "auto" else spec.format
                texts.extend(_texts(path, fmt, spec, limit - len(texts)))
                if len(texts) >= limit:
                    return texts
    if not texts:
        names = ", ".join(s.name for s in specs)
        raise KilnError(f"{role}: the sources ({names}) hold no documents")
    return texts


def _texts(path: str, fmt: str, spec: SourceSpec, limit: int) -> Iterator[str]:
    records = iter_records(
        path,
        fmt,
        text_field=spec.text_field,
        separator=spec.separator,
        issues=ReadIssues(),
    )
    for n, doc in enumerate(d for d in records if d is not None):
        if n >= limit:
            return
        yield doc.text


def _split(texts: list[str], seed: int, role: str, share: float) -> tuple[list[str], list[str]]:
    """(training, held-out) by a seeded hash of each document's role and position."""
    held = [unit_interval(seed, "held_out", role, i) < share for i in range(len(texts))]
    train = [t for t, h in zip(texts, held, strict=True) if not h]
    test = [t for t, h in zip(texts, held, strict=True) if h]
    if not train:
        raise KilnError(f"{role}: all {len(texts)} documents fell in the held-out share")
    return train, test


def annotated_texts(
    specs: tuple[SourceSpec, ...], base: Path, score_field: str, limit: int
) -> list[tuple[str, float]]:
    """(text, score) of the first `limit` records of the annotation JSONL files."""
    out: list[tuple[str, float]] = []
    for spec in specs:
        for pattern in spec.paths:
            hits = sorted(h for h in glob.glob(_resolve(pattern, base)) if os.path.isfile(h))
            if not hits:
                raise KilnError(f"annotations[{spec.name!r}]: {pattern} matches no file")
            for path in hits:
                out.extend(_scored(path, spec.text_field, score_field, limit - len(out)))
                if len(out) >= limit:
                    return out
    if not out:
        names = ", ".join(s.name for s in specs)
        raise KilnError(f"annotations: the sources ({names}) hold no documents")
    return out


def _scored(
    path: str, text_field: str, score_field: str, limit: int
) -> Iterator[tuple[str, float]]:
    with open(path, encoding="utf-8") as handle:
        for n, line in enumerate(handle, 1):
            if n > limit:
                return
            try:
                record = json.loads(line)
                text, score = record[text_field], float(record[score_field])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise KilnError(
                    f"{path}:{n}: expected a JSON object with {text_field!r} and a numeric "
                    f"{score_field!r} ({type(exc).__name__}: {exc})"
                ) from None
            yield str(text), score


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties); nan when a side is constant."""
    if a.size < 2 or np.all(a == a[0]) or np.all(b == b[0]):
        return float("nan")
    ra, rb = _average_ranks(a), _average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / np.sqrt((ra * ra).sum() * (rb * rb).sum()))


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, tied values sharing the mean of their ranks."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return ((ends - counts + 1 + ends) / 2.0)[inverse]


def _train_on_annotations(cfg: ClassifierTrainConfig, base: Path) -> tuple[Any, dict[str, Any]]:
    """The classifier trained on scores >= positive_score vs the rest, and its held-out report."""
    scored = annotated_texts(cfg.annotations, base, cfg.score_field, cfg.max_documents)
    texts = [t for t, _ in scored]
    scores = np.array([s for _, s in scored])
    held = np.array(
        [
            unit_interval(cfg.seed, "held_out", "annotations", i) < cfg.held_out
            for i in range(len(texts))
        ]
    )
    label = scores >= cfg.positive_score
    pos = [t for t, h, y in zip(texts, held, label, strict=True) if not h and y]
    neg = [t for t, h, y in zip(texts, held, label, strict=True) if not h and not y]
    for name, docs in (("positive", pos), ("negative", neg)):
        if not docs:
            raise KilnError(
                f"annotations: no {name} training document (score {'>=' if name == 'positive' else '<'} "
                f"positive_score = {cfg.positive_score}); change positive_score"
            )
    model = train_linear(pos, neg, ngrams=cfg.ngrams, buckets=cfg.buckets, epochs=cfg.epochs,
                         lr=cfg.lr, seed=cfg.seed)  # fmt: skip
    test = [t for t, h in zip(texts, held, strict=True) if h]
    predicted = np.array([model.score(t) for t in test])
    truth, truth_scores = label[held], scores[held]
    right = (predicted >= 0.5) == truth
    report = {
        "annotations": [s.name for s in cfg.annotations],
        "positive_score": cfg.positive_score,
        "positive_documents": len(pos),
        "negative_documents": len(neg),
        "held_out": {
            "documents": len(test),
            "accuracy": float(right.mean()) if test else float("nan"),
            "positive_accuracy": float(right[truth].mean()) if truth.any() else float("nan"),
            "negative_accuracy": float(right[~truth].mean()) if (~truth).any() else float("nan"),
            "spearman": spearman(predicted, truth_scores),
        },
    }
    return model, {**report, "_reference": predicted if test else None, "_train": pos + neg}


def train_classifier(path: str | Path, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Train the quality classifier a TOML names, write it, and return its training record."""
    cfg = cfgio.load(ClassifierTrainConfig, path, overrides)
    base = Path(path).resolve().parent
    if cfg.annotations:
        return _write_annotated(cfg, base)
    pos = source_texts(cfg.positive, base, "positive", cfg.max_documents)
    neg = source_texts(cfg.negative, base, "negative", cfg.max_documents)
    pos_train, pos_test = _split(pos, cfg.seed, "positive", cfg.held_out)
    neg_train, neg_test = _split(neg, cfg.seed, "negative", cfg.held_out)
    model = train_linear(
        pos_train,
        neg_train,
        ngrams=cfg.ngrams,
        buckets=cfg.buckets,
        epochs=cfg.epochs,
        lr=cfg.lr,
        seed=cfg.seed,
    )
    pos_scores = np.array([model.score(t) for t in pos_test])
    neg_scores = np.array([model.score(t) for t in neg_test])
    right = int((pos_scores >= 0.5).sum() + (neg_scores < 0.5).sum())
    n_test = len(pos_test) + len(neg_test)
    # Quantiles of unseen pipeline input: training negatives would score too low.
    reference = neg_scores if neg_scores.size else np.array([model.score(t) for t in neg_train])
    model.info = {
        "positive": [s.name for s in cfg.positive],
        "negative": [s.name for s in cfg.negative],
        "positive_documents": len(pos_train),
        "negative_documents": len(neg_train),
        "held_out": {
            "documents": n_test,
            "accuracy": right / n_test if n_test else float("nan"),
            "positive_accuracy": float((pos_scores >= 0.5).mean()) if pos_test else float("nan"),
            "negative_accuracy": float((neg_scores < 0.5).mean()) if neg_test else float("nan"),
        },
        "settings": {
            "epochs": cfg.epochs,
            "lr": cfg.lr,
            "ngrams": cfg.ngrams,
            "buckets": cfg.buckets,
            "seed": cfg.seed,
        },
        "quantile_documents": int(reference.size),
        "negative_quantiles": np.quantile(reference, np.linspace(0, 1, QUANTILES)).tolist(),
    }
    out = _resolve(cfg.output, base)
    model.save(out)
    return {"output": out, **{k: v for k, v in model.info.items() if k != "negative_quantiles"}}


def _settings(cfg: ClassifierTrainConfig) -> dict[str, Any]:
    return {"epochs": cfg.epochs, "lr": cfg.lr, "ngrams": cfg.ngrams, "buckets": cfg.buckets,
            "seed": cfg.seed}  # fmt: skip


def _write_annotated(cfg: ClassifierTrainConfig, base: Path) -> dict[str, Any]:
    model, report = _train_on_annotations(cfg, base)
    reference, train = report.pop("_reference"), report.pop("_train")
    # Annotated documents are pipeline input, so their held-out scores give the keep-fraction
    # quantiles (the training ones would score too confidently).
    if reference is None:
        reference = np.array([model.score(t) for t in train])
    model.info = {
        **report,
        "settings": _settings(cfg),
        "quantile_documents": int(reference.size),
        "negative_quantiles": np.quantile(reference, np.linspace(0, 1, QUANTILES)).tolist(),
    }
    out = _resolve(cfg.output, base)
    model.save(out)
    return {"output": out, **{k: v for k, v in model.info.items() if k != "negative_quantiles"}}


def train_perplexity_lm(path: str | Path, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Train the reference n-gram LM a TOML names, take its cutoffs, write it; its record."""
    cfg = cfgio.load(PerplexityTrainConfig, path, overrides)
    base = Path(path).resolve().parent
    reference = source_texts(cfg.reference, base, "reference", cfg.max_documents)
    sample = source_texts(cfg.sample, base, "sample", cfg.max_documents)
    lm = train_ngram(reference, order=cfg.order, min_count=cfg.min_count)
    ppl = np.array([lm.perplexity(t) for t in sample])
    ppl = ppl[np.isfinite(ppl)]
    if not ppl.size:
        raise KilnError("sample: no sample document has a word to score")
    lm.info.update(
        {
            "reference": [s.name for s in cfg.reference],
            "reference_documents": len(reference),
            "sample": [s.name for s in cfg.sample],
            "sample_documents": int(ppl.size),
            "sample_quantiles": np.quantile(ppl, np.linspace(0, 1, 101)).tolist(),
        }
    )
    out = _resolve(cfg.output, base)
    lm.save(out)
    info = {k: v for k, v in lm.info.items() if k != "sample_quantiles"}
    q = lm.info["sample_quantiles"]
    return {"output": out, "order": cfg.order, **info, "p30": q[30], "p60": q[60]}
