"""Language: identify each document's language offline (py3langid) and keep the chosen ones.

The model ships inside the py3langid wheel (nothing is downloaded) and is loaded once per
process. Scores are py3langid's normalised probabilities. The 0.65 threshold is FineWeb's (and
datatrove's `LanguageFilter` default), set there for fastText's lid.176 model: py3langid's
probabilities are calibrated differently, so the same number is not the same cut; on kiln's
English benchmark corpus it keeps 86% of documents, and the ones it drops are mostly tables,
JSON records, worked arithmetic and one-word texts (see docs/data_pipeline_stages.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.data.pipeline.document import Document
from kiln.errors import KilnError

BACKENDS = ("py3langid",)


@dataclass(frozen=True)
class LanguageConfig:
    """Which languages to keep and how sure the classifier must be (FineWeb: en, 0.65)."""

    enabled: bool = True
    languages: tuple[str, ...] = ("en",)  # ISO 639-1 codes; () keeps every language (annotates)
    threshold: float = 0.65  # FineWeb's minimum language score
    backend: str = "py3langid"
    # Classify only the first this many characters (0: all): the cost grows with the text,
    # and a long prefix decides a book's language as well as the whole book does.
    max_chars: int = 10_000


@functools.lru_cache(maxsize=1)
def langid_model() -> Any:
    """py3langid's model with normalised probabilities, loaded once per process (~1 s)."""
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


@functools.lru_cache(maxsize=1)
def _classifier() -> Callable[[str], tuple[str, float]]:
    """The fastest exact classifier available: the vectorised walk, else py3langid's own."""
    identifier = langid_model()
    try:
        return VectorisedLangid(identifier).classify
    except AttributeError:  # a py3langid whose internals differ: use its (slower) classify
        return identifier.classify


class VectorisedLangid:
    """py3langid's `classify`, with its byte-by-byte Python feature walk done in NumPy.

    py3langid finds its byte n-gram features with a DFA (Aho-Corasick over the n-grams) walked
    one byte at a time in Python. The DFA state after byte i depends only on the last `depth`
    bytes (the longest n-gram), so every position's state is found at once by walking all
    windows `depth` steps in parallel. Scoring then follows py3langid exactly (same features,
    counts, temperature and softmax); tests check both agree on real text.
    """

    def __init__(self, identifier: Any) -> None:
        self._encode = identifier._encode
        moves = identifier.tk_nextmove  # an array.array: viewed, not copied (39 MB)
        self._next = np.frombuffer(moves, dtype=np.dtype(moves.typecode))
        self._rowbase = np.asarray(identifier._rowbase, dtype=np.int32)
        self._output = np.asarray(identifier.tk_output, dtype=np.int32)
        # float32 copy (57 MB): NumPy converts float16 in software, 2x the cost of the walk.
        self._ptc = np.asarray(identifier.nb_ptc, dtype=np.float32)
        self._pc = identifier.nb_pc
        self._classes = identifier.nb_classes
        self._aliases = identifier._alias_pairs
        if not identifier._norm_probs:
            raise AttributeError("expected a model with normalised probabilities")
        self._depth = self._max_depth()

    def _max_depth(self) -> int:
        """The longest n-gram: the deepest state of a breadth-first walk from the start."""
        seen = np.zeros(len(self._rowbase), dtype=bool)
        seen[0] = True
        frontier, depth = np.array([0]), 0
        steps = np.arange(256, dtype=np.int32)
        while True:
            reached = np.zeros_like(seen)
            reached[self._next[(self._rowbase[frontier][:, None] + steps).ravel()]] = True
            frontier = np.flatnonzero(reached & ~seen)
            if not len(frontier):
                return depth
            seen[frontier] = True
            depth += 1

    def features(self, data: bytes) -> np.ndarray:
        """The feature index emitted at each byte position (-1: none), as py3langid's walk."""
        x = np.frombuffer(data, dtype=np.uint8).astype(np.int32)  # (n,)
        state = np.zeros(len(x), dtype=np.int32)  # (n,) state of the window ending at i
        for back in range(min(self._depth, len(x)) - 1, -1, -1):
            # Windows that start before the text begins just start later (from state 0).
            state[back:] = self._next[self._rowbase[state[back:]] + x[: len(x) - back]]
        return self._output[state]

    def classify(self, text: str) -> tuple[str, float]:
        """The most likely language and its probability, as `LanguageIdentifier.classify`."""
        data = self._encode(text)
        found = self.features(data)
        found = found[found >= 0]
        if len(found):
            index, counts = np.unique(found, return_counts=True)
            scores = np.log1p(counts.astype(np.float32)) @ self._ptc[index] + self._pc
        else:
            scores = np.zeros(len(self._classes), dtype=np.float32)
        scores *= 1.0 / math.sqrt(len(data) or 1)  # py3langid's length temperature
        np.exp(scores - scores.max(), out=scores)
        scores /= scores.sum()
        for first, dupe in self._aliases:  # one label under two columns: merge them
            scores[first] += scores[dupe]
            scores[dupe] = 0.0
        best = int(scores.argmax())
        return self._classes[best], float(scores[best])


class LanguageFilter:
    """Annotate `meta["lang"]`/`meta["lang_score"]`; remove documents not in `languages`."""

    name = "language"

    def __init__(self, config: LanguageConfig) -> None:
        if config.backend not in BACKENDS:
            raise KilnError(
                f"language.backend: unknown backend {config.backend!r}; expected one of "
                f"{', '.join(BACKENDS)}"
            )
        if not 0.0 <= config.threshold <= 1.0:
            raise KilnError(
                f"language.threshold: expected a value in [0, 1], got {config.threshold}"
            )
        identifier = langid_model()
        unknown = sorted(set(config.languages) - set(identifier.labels))
        if unknown:
            raise KilnError(
                f"language.languages: {', '.join(unknown)} not known to {config.backend} "
                f"(it knows ISO 639 codes such as en, fr, de, zh)"
            )
        self.config = config
        self._classify = _classifier()
        self._keep = frozenset(config.languages)

    def __reduce__(self) -> tuple[type, tuple[LanguageConfig]]:
        # Pickle the config, not the model: the receiving process loads its own copy once.
        return (LanguageFilter, (self.config,))

    def identify(self, text: str) -> tuple[str, float]:
        """The most likely language of `text` and its probability."""
        limit = self.config.max_chars
        return self._classify(text[:limit] if limit > 0 else text)

    def apply(self, doc: Document) -> str | None:
        """Record the language and score; return why the document is removed, if it is."""
        lang, score = self.identify(doc.text)
        doc.meta["lang"] = lang
        doc.meta["lang_score"] = round(float(score), 4)
        if not self._keep:
            return None
        if lang not in self._keep:
            return "language.other"
        if score < self.config.threshold:
            return "language.low_score"
        return None
