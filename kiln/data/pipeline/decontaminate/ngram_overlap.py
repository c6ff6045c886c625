"""Decontamination against evaluation sets: remove 13-gram overlaps the way GPT-3 did.

GPT-3 (Brown et al. 2020, appendix C): words are lowercased, whitespace-delimited and stripped of
punctuation (`minhash.normalized_words`); every 13-gram of a training document that also occurs
in an evaluation set is removed together with a 200-character window on each side of it (as in
lm-evaluation-harness's `Janitor`, which reimplements the procedure); the rest of the document
falls apart into pieces; pieces shorter than 200 characters are dropped; a document split into
more than 10 pieces is dropped entirely. kiln joins the kept pieces with a blank line ("\\n\\n").
Unlike GPT-3, a window's edge snaps outwards to a word boundary (`snap = "word"`, the default) or a
sentence boundary (`"sentence"`), so the text left in the shard never starts or ends mid-word
(`"none"`: the exact 200-character windows). Every cut is recorded in `doc.meta["decontam_cuts"]`:
its offsets in the text as it reached this stage, its length in characters and words, and the
benchmark items it matched (0-based item numbers in the evaluation file); pieces dropped as too
short are recorded there too.
Not reproduced: GPT-3 also ignored 13-grams occurring in more than 10 training documents (common
phrases, boilerplate). That needs a corpus-wide count before filtering; kiln removes every match.

Evaluation n-grams are built per item over each full candidate text — context + " " + choice
for every choice (GPT-3 scanned whole examples), so n-grams that cross from the context into an
answer are caught too. Items with fewer than 13 words contribute nothing (as in GPT-3's filter).
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.config import ConfigError
from kiln.data.pipeline.dedup.minhash import hash_word_ngrams, normalized_word_spans
from kiln.data.pipeline.document import Document
from kiln.errors import KilnError, json_error_reason
from kiln.io import open_binary, strip_compression

_SPLIT_SUFFIXES = ("_val", "_validation", "_dev", "_test")
_HASH_BATCH = 2048  # eval texts hashed per NumPy call
_DOCS_PER_LOOKUP = 256  # training documents hashed per NumPy call
_BIT = np.array([1 << k for k in range(8)], dtype=np.uint8)  # bit k of a bitmap byte
SNAP_MODES = ("none", "word", "sentence")
_MAX_WORD_SNAP = 100  # characters a cut's edge may move to reach a word boundary
_MAX_SENTENCE_SNAP = 600  # ... or a sentence boundary
# A sentence ends at . ! or ? (with any closing quotes or brackets) before whitespace, or at a
# line break.
_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*(?=\s)|\n")


@dataclass(frozen=True)
class DecontamConfig:
    """Decontamination parameters; defaults are GPT-3's (Brown et al. 2020, appendix C)."""

    enabled: bool = True
    eval_files: tuple[str, ...] = ()
    ngram: int = 13
    window_chars: int = 200
    min_piece_chars: int = 200
    max_pieces: int = 10
    snap: str = "word"  # widen each cut to a word ("word") or sentence boundary, or "none"

    def __post_init__(self) -> None:
        if self.snap not in SNAP_MODES:
            raise ConfigError(f"decontaminate.snap = {self.snap!r}: expected one of {SNAP_MODES}")
        for name, low in (("ngram", 1), ("window_chars", 0), ("min_piece_chars", 0)):
            if getattr(self, name) < low:
                raise ConfigError(
                    f"decontaminate.{name}: expected >= {low}, got {getattr(self, name)}"
                )
        if self.max_pieces < 1:
            raise ConfigError(f"decontaminate.max_pieces: expected >= 1, got {self.max_pieces}")


def task_name(path: str | os.PathLike[str]) -> str:
    """The task an evaluation file holds, from its name: `hellaswag_val.txt.bz2` -> `hellaswag`."""
    stem = Path(strip_compression(os.fspath(path))).name
    for extension in (".jsonl", ".txt"):
        stem = stem.removesuffix(extension)
    for suffix in _SPLIT_SUFFIXES:
        if stem.endswith(suffix) and len(stem) > len(suffix):
            return stem[: -len(suffix)]
    return stem


def _read_lines(path: str) -> list[str]:
    """The file's lines, decompressed and decoded (UTF-8)."""
    with open_binary(path) as handle:
        data = handle.read()
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise KilnError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _hellaswag_texts(path: str, lines: list[str]) -> Iterator[list[str]]:
    """HellaSwag's 6-line items: `activity_label: context`, gold index, four endings."""
    if len(lines) % 6:
        raise KilnError(f"{path}: expected 6 lines per HellaSwag item, got {len(lines)} lines")
    for start in range(0, len(lines), 6):
        header, gold, *endings = lines[start : start + 6]
        if not gold.strip().isdigit():
            raise KilnError(f"{path}:{start + 2}: expected the gold index, got {gold[:40]!r}")
        # The activity label names the ActivityNet/WikiHow category; the context follows it.
        context = header.split(": ", 1)[1] if ": " in header else header
        yield [f"{context} {ending}" for ending in endings]


def _jsonl_texts(path: str, lines: list[str]) -> Iterator[list[str]]:
    """One item per JSON line, in the llm-foundry formats (see /work/shared/data/README.md)."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise KilnError(
                f"{path}:{number}: not a JSON object ({json_error_reason(exc, number)})"
            ) from None
        if not isinstance(item, dict):
            raise KilnError(f"{path}:{number}: expected a JSON object, got {type(item).__name__}")
        yield _item_texts(path, number, item)


def _item_texts(path: str, number: int, item: dict) -> list[str]:
    """Every full candidate text of one JSON item."""
    try:
        if "query" in item and "choices" in item:
            return [f"{item['query']} {choice}" for choice in _strings(item["choices"])]
        if "context_options" in item and "continuation" in item:
            return [
                f"{option} {item['continuation']}" for option in _strings(item["context_options"])
            ]
        if "context" in item and "continuation" in item:
            return [f"{item['context']} {item['continuation']}"]
    except TypeError:
        pass
    raise KilnError(
        f"{path}:{number}: expected fields query+choices, context_options+continuation or "
        f"context+continuation (strings), got {sorted(item)}"
    )


def _strings(value: object) -> list[str]:
    """A JSON list of strings, else TypeError."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError
    return value


def read_eval_items(path: str | os.PathLike[str]) -> list[list[str]]:
    """The candidate texts of every item of an evaluation file (HellaSwag .txt or .jsonl)."""
    name = os.fspath(path)
    lines = _read_lines(name)
    if not any(line.strip() for line in lines):
        raise KilnError(f"{name}: empty evaluation file")
    plain = strip_compression(name)
    if plain.endswith(".jsonl"):
        return list(_jsonl_texts(name, lines))
    if plain.endswith(".txt"):
        return list(_hellaswag_texts(name, lines))
    raise KilnError(f"{name}: unknown evaluation format, expected .jsonl or HellaSwag's .txt")


@dataclass(frozen=True)
class TaskStats:
    """What one evaluation file contributed to the index."""

    items: int
    ngrams: int
    items_too_short: int  # items with no text of >= ngram words: nothing to match


class EvalNgramIndex:
    """Sorted uint64 hashes of every evaluation n-gram, each with the task it came from.

    Lookups first test a bitmap of the hashes' top bits (about 32 bits per n-gram, so ~3% of
    clean n-grams pass), then binary-search only those: a document's n-grams are nearly all
    absent, and the bitmap answers them without a cache miss per search step.
    """

    def __init__(
        self,
        hashes: np.ndarray,
        task_ids: np.ndarray,
        tasks: Sequence[str],
        ngram: int,
        stats: dict[str, TaskStats] | None = None,
        item_ids: np.ndarray | None = None,
    ) -> None:
        items = np.zeros(len(hashes), np.int32) if item_ids is None else np.asarray(item_ids)
        order = np.lexsort((items, task_ids, hashes))
        self.hashes = np.ascontiguousarray(hashes[order])  # (N,) uint64, sorted
        self.task_ids = np.ascontiguousarray(task_ids[order])  # (N,) int32, index into tasks
        self.item_ids = np.ascontiguousarray(items[order])  # (N,) int32, first item with it
        self.tasks = list(tasks)
        self.ngram = ngram
        self.stats = stats or {}
        self._bits = max(16, (32 * max(len(self.hashes), 1) - 1).bit_length())
        self._bitmap = np.zeros(1 << (self._bits - 3), dtype=np.uint8)  # (2^bits / 8,)
        top = self.hashes >> np.uint64(64 - self._bits)  # sorted, as the hashes are
        byte = (top >> np.uint64(3)).astype(np.int64)
        run_start = np.flatnonzero(np.diff(byte, prepend=-1))  # one run per distinct byte
        if len(byte):
            bits = np.bitwise_or.reduceat(_BIT[top & np.uint64(7)], run_start)
            self._bitmap[byte[run_start]] = bits

    @classmethod
    def from_files(cls, paths: Sequence[str | os.PathLike[str]], ngram: int = 13) -> EvalNgramIndex:
        """Index every n-gram of every item of the given evaluation files."""
        all_hashes, all_ids, all_items, tasks, stats = [], [], [], [], {}
        for path in paths:
            name = task_name(path)
            if name in stats:
                raise KilnError(f"{path}: a second file for task {name!r}")
            items = read_eval_items(path)
            texts = [text for item in items for text in item]
            item_of_text = np.repeat(np.arange(len(items)), [len(item) for item in items])
            hashes, counts = _ngram_hashes(texts, ngram)
            unique, first_item = _first_items(hashes, np.repeat(item_of_text, counts))
            too_short = len(items) - len(_sorted_unique(item_of_text[counts > 0]))
            all_hashes.append(unique)
            all_ids.append(np.full(len(unique), len(tasks), dtype=np.int32))
            all_items.append(first_item)
            stats[name] = TaskStats(len(items), len(unique), too_short)
            tasks.append(name)
        if not tasks:
            return cls(np.zeros(0, np.uint64), np.zeros(0, np.int32), [], ngram)
        return cls(
            np.concatenate(all_hashes),
            np.concatenate(all_ids),
            tasks,
            ngram,
            stats,
            np.concatenate(all_items),
        )

    def __len__(self) -> int:
        return len(self.hashes)

    def contains(self, hashes: np.ndarray) -> np.ndarray:
        """(k,) bool: which of the given n-gram hashes occur in some evaluation set."""
        found = np.zeros(len(hashes), dtype=bool)
        if len(self.hashes) == 0:
            return found
        top = hashes >> np.uint64(64 - self._bits)
        maybe = (self._bitmap[top >> np.uint64(3)] & _BIT[top & np.uint64(7)]) != 0
        candidates = hashes[maybe]
        at = np.minimum(np.searchsorted(self.hashes, candidates), len(self.hashes) - 1)
        found[maybe] = self.hashes[at] == candidates
        return found

    def tasks_of(self, hashes: np.ndarray) -> list[list[str]]:
        """For each n-gram hash (uint64 array), the tasks it occurs in (empty if none)."""
        hashes = np.asarray(hashes, dtype=np.uint64)  # a Python int would make NumPy cast all
        lo = np.searchsorted(self.hashes, hashes, side="left").tolist()
        hi = np.searchsorted(self.hashes, hashes, side="right").tolist()
        return [[self.tasks[t] for t in self.task_ids[a:b]] for a, b in zip(lo, hi, strict=True)]

    def matches_of(self, hashes: np.ndarray) -> list[list[tuple[str, int]]]:
        """For each n-gram hash, the (task, first item holding it) pairs it occurs in."""
        hashes = np.asarray(hashes, dtype=np.uint64)
        lo = np.searchsorted(self.hashes, hashes, side="left").tolist()
        hi = np.searchsorted(self.hashes, hashes, side="right").tolist()
        return [
            [
                (self.tasks[t], int(k))
                for t, k in zip(self.task_ids[a:b], self.item_ids[a:b], strict=True)
            ]
            for a, b in zip(lo, hi, strict=True)
        ]


def _ngram_hashes(texts: list[str], ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """All n-gram hashes of `texts` and the count per text, hashed in batches."""
    hashes, counts = [], []
    for lo in range(0, len(texts), _HASH_BATCH):
        h, offsets = hash_word_ngrams(texts[lo : lo + _HASH_BATCH], ngram, whole_if_short=False)
        hashes.append(h)
        counts.append(np.diff(offsets))
    if not hashes:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    return np.concatenate(hashes), np.concatenate(counts)


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique by sorting (NumPy's hash-based unique is several times slower on uint64)."""
    ordered = np.sort(values)
    keep = np.ones(len(ordered), dtype=bool)
    keep[1:] = ordered[1:] != ordered[:-1]
    return ordered[keep]


def _first_items(hashes: np.ndarray, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct hashes (sorted) and, for each, the lowest item number it occurs in."""
    order = np.lexsort((items, hashes))
    ordered = hashes[order]
    first = np.ones(len(ordered), dtype=bool)
    first[1:] = ordered[1:] != ordered[:-1]
    return ordered[first], items[order][first].astype(np.int32)


@functools.lru_cache(maxsize=4)
def _cached_index(paths: tuple[str, ...], ngram: int) -> EvalNgramIndex:
    """One index per process and file set: workers build their stage many times, load once."""
    return EvalNgramIndex.from_files(paths, ngram)


class Decontaminator:
    """Removes evaluation-set 13-grams from documents (a DocumentStage)."""

    name = "decontaminate"

    def __init__(self, config: DecontamConfig, index: EvalNgramIndex | None = None) -> None:
        self.config = config
        self.index = index if index is not None else _cached_index(config.eval_files, config.ngram)
        if self.index.ngram != config.ngram:
            raise ValueError(
                f"index built for {self.index.ngram}-grams, config wants {config.ngram}"
            )

    def apply(self, doc: Document) -> str | None:
        """Cut out contaminated spans; record `doc.meta["decontam"] = {task: spans}` if any."""
        return self.apply_batch([doc])[0]

    def apply_batch(self, docs: Sequence[Document]) -> list[str | None]:
        """`apply` on many documents: their n-grams are hashed and looked up together."""
        verdicts: list[str | None] = [None] * len(docs)
        for lo in range(0, len(docs), _DOCS_PER_LOOKUP):
            chunk = docs[lo : lo + _DOCS_PER_LOOKUP]
            texts = [doc.text for doc in chunk]
            hashes, offsets = hash_word_ngrams(texts, self.config.ngram, whole_if_short=False)
            hits = np.zeros(len(hashes) + 1, dtype=np.int64)
            np.cumsum(self.index.contains(hashes), out=hits[1:])
            # The common case ends here: no document of the chunk has a match, none is touched.
            for i in np.flatnonzero(hits[offsets[1:]] > hits[offsets[:-1]]).tolist():
                verdicts[lo + i] = self._cut(chunk[i])
        return verdicts

    def _cut(self, doc: Document) -> str | None:
        """Remove the matches (with their windows) from a document known to have some."""
        text = doc.text
        spans, per_task, matched = self._contaminated_spans(text)
        if not spans:
            return None
        doc.meta["decontam"] = per_task
        pieces = _pieces(text, spans)
        kept = [p for p in pieces if p[1] - p[0] >= self.config.min_piece_chars]
        cuts = [
            _span_record(text, s, e, "match", items)
            for (s, e), items in zip(spans, matched, strict=True)
        ]
        cuts += [_span_record(text, s, e, "short_piece") for s, e in pieces if (s, e) not in kept]
        doc.meta["decontam_cuts"] = sorted(cuts, key=lambda c: c["start"])
        if len(pieces) > self.config.max_pieces:
            return "decontaminate.too_many_pieces"
        if not kept:
            return "decontaminate.empty"
        doc.text = "\n\n".join(text[s:e] for s, e in kept)
        return None

    def _contaminated_spans(
        self, text: str
    ) -> tuple[list[tuple[int, int]], dict[str, int], list[dict[str, list[int]]]]:
        """Merged character spans to remove (match + window, snapped), the spans per task, and
        per span the evaluation items it matched ({task: [item, ...]})."""
        tokens = normalized_word_spans(text)  # the words detection hashed, with positions
        n = self.config.ngram
        hashes, _ = hash_word_ngrams([" ".join(t[0] for t in tokens)], n, whole_if_short=False)
        hits = np.flatnonzero(self.index.contains(hashes))
        window = self.config.window_chars
        spans: list[list[int]] = []  # merged [start, end)
        span_items: list[dict[str, set[int]]] = []
        for i, found in zip(hits.tolist(), self.index.matches_of(hashes[hits]), strict=True):
            start, end = _snap(
                text, max(tokens[i][1] - window, 0), min(tokens[i + n - 1][2] + window, len(text)),
                self.config.snap,
            )  # fmt: skip
            if not spans or start > spans[-1][1]:
                spans.append([start, end])
                span_items.append({})
            spans[-1][1] = max(spans[-1][1], end)
            for task, item in found:
                span_items[-1].setdefault(task, set()).add(item)
        per_task: dict[str, int] = {}
        for items in span_items:
            for task in items:
                per_task[task] = per_task.get(task, 0) + 1
        matched = [{t: sorted(v) for t, v in sorted(items.items())} for items in span_items]
        return [(s, e) for s, e in spans], dict(sorted(per_task.items())), matched


def _snap(text: str, start: int, end: int, mode: str) -> tuple[int, int]:
    """Widen [start, end) to the enclosing word (or sentence) boundaries; "none" leaves it.

    A word edge moves at most `_MAX_WORD_SNAP` characters (a 5,000-character base64 "word"
    is cut inside); a sentence edge further than `_MAX_SENTENCE_SNAP` falls back to a word edge.
    """
    if mode == "none":
        return start, end
    if mode == "sentence":
        before = [
            m.end() for m in _SENTENCE_END.finditer(text, max(start - _MAX_SENTENCE_SNAP, 0), start)
        ]
        after = _SENTENCE_END.search(text, max(end - 1, 0), end + _MAX_SENTENCE_SNAP)
        if before and after:
            return before[-1], after.end()
        if start <= _MAX_SENTENCE_SNAP and not before:
            start = 0  # the document's first sentence
        if len(text) - end <= _MAX_SENTENCE_SNAP and not after:
            end = len(text)
    low, high = max(start - _MAX_WORD_SNAP, 0), min(end + _MAX_WORD_SNAP, len(text))
    while start > low and not text[start - 1].isspace() and not text[start].isspace():
        start -= 1
    while end < high and not text[end].isspace() and not text[end - 1].isspace():
        end += 1
    return start, end


def _span_record(
    text: str, start: int, end: int, kind: str, matched: dict[str, list[int]] | None = None
) -> dict[str, object]:
    """How a removed stretch of text is reported: where, how long, and why."""
    record: dict[str, object] = {
        "start": start,
        "chars": end - start,
        "words": len(text[start:end].split()),
        "kind": kind,
    }
    if matched is not None:
        record["matched"] = matched
    return record


def _pieces(text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The [start, end) of the non-blank stretches of `text` around the removed spans, stripped."""
    pieces, cursor = [], 0
    for start, end in [*spans, (len(text), len(text))]:
        piece = text[cursor:start]
        lead = len(piece) - len(piece.lstrip())
        stripped = piece.strip()
        if stripped:
            pieces.append((cursor + lead, cursor + lead + len(stripped)))
        cursor = end
    return pieces
