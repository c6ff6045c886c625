"""The work a pipeline splits into tasks: filter a slice of one input file; tokenize its survivors.

A task reads only its inputs and writes only its own files under the run's work directory,
finishing with `stats.json` (the completion marker), so a killed run redoes exactly the tasks
without one, and the output never depends on which worker ran what.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data.pipeline.config import InputFile, PipelineConfig
from kiln.data.pipeline.document import Document, DocumentStage
from kiln.data.pipeline.records import (
    load_arrays,
    read_records,
    save_array,
    save_arrays,
    unit_interval,
    write_records,
)
from kiln.data.pipeline.task_outputs import (
    DECONTAM_CODES,
    EXACT_ROWS,
    EXCERPT_CHARS,
    LINE_ROWS,
    NEAR_ROWS,
)
from kiln.io import write_json_atomic

STATS = "stats.json"
CHAR_BINS = np.arange(0.0, 7.01, 0.25)  # log10 of document length in characters
SCORE_BINS = np.linspace(0.0, 1.0, 21)
# What a per-document stage did when it rewrote a document's text, and the meta keys that say
# how (the document's history in the shard's document map records both).
CHANGES = {
    "extract": ("extracted the main text of an HTML page", ()),
    "normalise": ("normalised Unicode and whitespace", ()),
    "c4": ("removed lines that break C4's line rules", ("c4_lines_removed",)),
    "pii": ("redacted personal data (e-mail, IP, phone)", ("pii",)),
    "decontaminate": ("cut passages matching evaluation sets", ("decontam", "decontam_cuts")),
}


# Meta keys a removal record carries besides its score: what exactly made the stage remove it.
EVIDENCE = {
    "url_blocklist": ("url", "blocked_by"),
    "bad_words": ("bad_word",),
    "perplexity": ("perplexity_bucket",),
}


@dataclass(frozen=True)
class FilterTask:
    """Records [start, stop) of one input file, through the per-document stages."""

    index: int
    file: InputFile
    start: int
    stop: int
    config: PipelineConfig
    workdir: str
    text_field: str
    id_field: str
    separator: str
    offset_index: str = ""  # the file's byte-offset index, if it has one (see `offsets`)

    @property
    def dir(self) -> Path:
        """Where this task's outputs go."""
        return Path(self.workdir) / "filter" / f"{self.index:06d}"


@dataclass(frozen=True)
class TokenizeTask:
    """Encode one filter task's surviving documents."""

    index: int
    workdir: str
    tokenizer: str
    eot_token: str
    samples: int = 5  # output documents kept as examples per kind (see `_add_samples`)
    lines: Any = None  # the LineDedupConfig when line dedup is on

    @property
    def dir(self) -> Path:
        """Where this task's outputs go."""
        return Path(self.workdir) / "tokens" / f"{self.index:06d}"


def is_done(task_dir: Path) -> bool:
    """Whether a task finished (its completion marker exists)."""
    return (task_dir / STATS).is_file()


@functools.lru_cache(maxsize=2)
def build_stages(config: PipelineConfig) -> list[tuple[str, DocumentStage]]:
    """The enabled per-document stages, in pipeline order, built once per worker process."""
    from kiln.data.pipeline.filter.bad_words import BadWordsFilter
    from kiln.data.pipeline.filter.language import LanguageFilter
    from kiln.data.pipeline.filter.normalise import Normalise
    from kiln.data.pipeline.filter.pii import PIIRedact
    from kiln.data.pipeline.filter.quality_c4 import C4Filter
    from kiln.data.pipeline.filter.quality_classifier import ClassifierFilter
    from kiln.data.pipeline.filter.quality_fineweb import FineWebFilter
    from kiln.data.pipeline.filter.quality_gopher import GopherQuality, GopherRepetition
    from kiln.data.pipeline.filter.quality_perplexity import PerplexityFilter
    from kiln.data.pipeline.filter.url_blocklist import UrlBlocklist
    from kiln.data.pipeline.read.extract import Extract

    q = config.quality
    candidates: list[tuple[str, Any, Any]] = [
        ("extract", config.extract, Extract),
        ("url_blocklist", config.url_blocklist, UrlBlocklist),
        ("normalise", config.normalise, Normalise),
        ("language", config.language, LanguageFilter),
        ("bad_words", config.bad_words, BadWordsFilter),
        ("gopher_quality", q.gopher_quality, GopherQuality),
        ("gopher_repetition", q.gopher_repetition, GopherRepetition),
        ("c4", q.c4, C4Filter),
        ("fineweb", q.fineweb, FineWebFilter),
        # The model-based stages are the slowest per document: they see only the survivors.
        ("classifier", q.classifier, ClassifierFilter),
        ("perplexity", q.perplexity, PerplexityFilter),
        ("pii", config.pii, PIIRedact),
    ]
    return [(name, cls(cfg)) for name, cfg, cls in candidates if cfg.enabled]


def load_decontaminator(config: PipelineConfig) -> Any:
    """The decontamination stage; its n-gram index is loaded once per process (and n-gram size)."""
    from kiln.data.pipeline.decontaminate.ngram_overlap import Decontaminator

    cfg = config.decontaminate
    if not cfg.enabled or not cfg.eval_files:
        return None
    return Decontaminator(cfg)


@functools.lru_cache(maxsize=2)
def _minhasher(config: PipelineConfig) -> Any:
    from kiln.data.pipeline.dedup.minhash import MinHasher

    return MinHasher(config.dedup.near)


def _histogram(values: list[float], bins: np.ndarray) -> list[int]:
    counts, _ = np.histogram(np.clip(values, bins[0], bins[-1]), bins=bins)
    return counts.tolist()


def _removal(doc: Document, stage: str, reason: str, excerpt: bool) -> dict[str, Any]:
    record = {
        "id": doc.id,
        "source": doc.source,
        "file": doc.meta.get("file", ""),
        "ordinal": doc.meta.get("ordinal", -1),
        "stage": stage,
        "reason": reason,
    }
    score = doc.meta.get("scores", {}).get(stage)
    if score is not None:
        record["score"] = score
    for key in EVIDENCE.get(stage, ()):
        if key in doc.meta:
            record[key] = doc.meta[key]
    if "provenance" in doc.meta:
        record["provenance"] = doc.meta["provenance"]
    if excerpt:
        record["excerpt"] = doc.text[:EXCERPT_CHARS]
    return record


def _change(doc: Document, stage: str, before: str) -> dict[str, Any]:
    """A history entry: which stage rewrote the document, why, and its size before and after."""
    what, keys = CHANGES.get(stage, ("rewrote the text", ()))
    entry: dict[str, Any] = {
        "stage": stage,
        "change": what,
        "chars_before": len(before),
        "chars_after": len(doc.text),
    }
    entry.update({key: doc.meta[key] for key in keys if key in doc.meta})
    return entry


def run_filter_task(task: FilterTask) -> dict[str, Any]:
    """Read, filter and fingerprint one slice of an input file; write the results; return stats."""
    from kiln.data.pipeline.dedup.exact import exact_key, keys_array
    from kiln.data.pipeline.dedup.partitioned import write_exact_rows, write_near_rows
    from kiln.data.pipeline.global_stages import nodes_of
    from kiln.data.pipeline.read.readers import ReadIssues, iter_records

    cfg, f = task.config, task.file
    stages = build_stages(cfg)
    decontam = load_decontaminator(cfg)
    issues = ReadIssues()
    records = iter_records(
        f.path,
        f.format,
        text_field=task.text_field,
        id_field=task.id_field or None,
        separator=task.separator,
        issues=issues,
        start=task.start,
        stop=task.stop,
        index=task.offset_index,
    )
    stage_in: Counter[str] = Counter()
    removed_by: dict[str, Counter[str]] = {name: Counter() for name, _ in stages}
    changed_by: Counter[str] = Counter()
    removed: list[dict[str, Any]] = []
    kept: list[Document] = []
    chars, scores, quality_scores = [], [], []
    n_records = n_documents = 0
    for ordinal, doc in enumerate(records, task.start):
        n_records += 1
        if doc is None:
            continue
        n_documents += 1
        doc.source = f.source
        doc.id = doc.id or f"{f.source}:{f.relpath}:{ordinal}"
        doc.meta.setdefault("file", f.path)
        doc.meta["ordinal"] = ordinal
        chars.append(math.log10(max(len(doc.text), 1)))
        reason_stage = None
        history: list[dict[str, Any]] = []
        for name, stage in stages:
            stage_in[name] += 1
            before = doc.text
            reason = stage.apply(doc)
            if name == "language" and "lang_score" in doc.meta:
                scores.append(float(doc.meta["lang_score"]))
            if name == "classifier":
                quality_scores.append(float(doc.meta["scores"]["classifier"]))
            if reason is not None:
                reason_stage = (name, reason)
                break
            if doc.text != before:
                history.append(_change(doc, name, before))
                changed_by[name] += 1
        if reason_stage is not None:
            name, reason = reason_stage
            removed_by[name][reason] += 1
            sample = removed_by[name][reason] <= cfg.removed_samples
            removed.append(_removal(doc, name, reason, sample))
            continue
        doc.meta["history"] = history
        kept.append(doc)

    # Decontamination runs after dedup in the funnel, but its verdict needs only the document,
    # so it is computed here and applied by the global pass to the dedup survivors. It runs
    # before the fingerprints are taken, so dedup compares the text that is written: a copy
    # that a cut turned into a prefix of another document is still found as a near duplicate.
    codes = np.zeros(len(kept), dtype=np.int8)
    cut = np.zeros(len(kept), dtype=bool)
    if decontam is not None:
        originals = [d.text for d in kept]
        for i, reason in enumerate(decontam.apply_batch(kept)):
            if reason is not None:
                codes[i] = DECONTAM_CODES.index(reason)
                kept[i].meta["decontam_excerpt"] = originals[i][:EXCERPT_CHARS]
            elif kept[i].text != originals[i]:
                cut[i] = True
                kept[i].meta["history"].append(_change(kept[i], "decontaminate", originals[i]))
    is_val = np.array(
        [unit_interval(cfg.seed, "val", d.id) < cfg.split.val_fraction for d in kept], dtype=bool
    )
    exact = keys_array([exact_key(d.text) for d in kept])
    task.dir.mkdir(parents=True, exist_ok=True)
    verify = cfg.dedup.near.enabled and cfg.dedup.near.jaccard_threshold > 0.0
    shingles: list[np.ndarray] | None = [] if verify else None
    if cfg.dedup.near.enabled and kept:
        hasher = _minhasher(cfg)
        bands = hasher.band_keys(hasher.signatures([d.text for d in kept], shingles))
    else:
        bands = np.zeros((len(kept), 0), dtype=np.uint64)
    if shingles is not None:
        _write_shingles(task.dir, shingles)

    # The global pass reads these hash-sliced, a partition at a time (see `partitioned`).
    nodes = nodes_of(task.index, is_val)
    write_exact_rows(task.dir / f"{EXACT_ROWS}.npy", exact, nodes)
    write_near_rows(task.dir / f"{NEAR_ROWS}.npy", bands, nodes)
    if cfg.dedup.lines.enabled:
        _write_line_rows(task.dir, kept, nodes, cfg)
    write_records(
        task.dir / "docs.jsonl.zst",
        ({"id": d.id, "source": d.source, "text": d.text, "meta": d.meta} for d in kept),
    )
    write_records(task.dir / "removed.jsonl.zst", removed)
    save_arrays(
        task.dir / "keys.npz",
        is_val=is_val,
        decontam=codes,
        cut=cut,
        ordinal=np.array([d.meta["ordinal"] for d in kept], dtype=np.int64),
        ids=np.array([d.id for d in kept], dtype=str),
    )
    stats = {
        "task": task.index,
        "source": f.source,
        "file": f.path,
        "records": n_records,
        "documents": n_documents,
        "kept": len(kept),
        "stage_in": dict(stage_in),
        "removed": {k: dict(v) for k, v in removed_by.items() if v},
        "changed": dict(changed_by),
        "issues": issues.to_json(),
        "hist": {
            "log10_chars": _histogram(chars, CHAR_BINS),
            "lang_score": _histogram(scores, SCORE_BINS),
            "classifier_score": _histogram(quality_scores, SCORE_BINS),
        },
    }
    write_json_atomic(task.dir / STATS, stats)  # the completion marker: written last
    return stats


def _write_shingles(folder: Path, batches: list[np.ndarray]) -> None:
    """Each kept document's distinct shingles, for the Jaccard check of near-dup candidates."""
    from kiln.data.pipeline.dedup.verify import distinct_shingles, write_shingles

    values, offsets = [], [np.zeros(1, dtype=np.int64)]
    for shingles, batch_offsets in zip(batches[0::2], batches[1::2], strict=True):
        v, o = distinct_shingles(shingles, batch_offsets)
        values.append(v)
        offsets.append(o[1:] + offsets[-1][-1])
    write_shingles(
        folder,
        np.concatenate(values) if values else np.zeros(0, dtype=np.uint64),
        np.concatenate(offsets),
    )


def _write_line_rows(folder: Path, kept: list[Document], nodes: np.ndarray, cfg: Any) -> None:
    """(unit key, node) for each distinct line or paragraph of each kept document."""
    from kiln.data.pipeline.dedup.lines import document_keys
    from kiln.data.pipeline.dedup.partitioned import SLICES, slice_of, write_bucketed

    per_doc = [document_keys(d.text, cfg.dedup.lines) for d in kept]
    keys = np.concatenate(per_doc) if per_doc else np.zeros(0, dtype=np.int64)
    owners = np.repeat(nodes, [len(k) for k in per_doc]) if per_doc else keys
    rows = np.stack([keys, owners.astype(np.int64)], axis=1)
    write_bucketed(folder / f"{LINE_ROWS}.npy", rows, slice_of(keys), SLICES)


@functools.lru_cache(maxsize=2)
def _tokenizer(path: str, eot_token: str) -> tuple[Any, int]:
    from kiln.data.tokenize_shards import load_tokenizer_entry

    tok, entry = load_tokenizer_entry(path, eot_token)
    return tok, entry.eot_id


def run_tokenize_task(task: TokenizeTask) -> dict[str, Any]:
    """Encode the documents of one filter task that the global stages kept; return stats."""
    from kiln.data.pipeline.global_stages import frequent_units, read_clusters
    from kiln.data.pipeline.mix.survivors import write_doc_records
    from kiln.data.shard_format import dtype_for_vocab
    from kiln.data.tokenize_shards import encode_documents

    filter_dir = Path(task.workdir) / "filter" / f"{task.index:06d}"
    global_dir = Path(task.workdir) / "global"
    decision = load_arrays(global_dir / f"{task.index:06d}.npz")
    keep, reached = decision["keep"], decision["reached_decontam"]
    clusters = read_clusters(global_dir, task.index)
    frequent = frequent_units(global_dir, task.index) if task.lines is not None else set()
    line_stats = {"in": 0, "changed": 0, "units_removed": 0}
    emptied: list[dict[str, Any]] = []
    val_kept = decision["val_kept"]
    is_val: list[bool] = []
    texts, docs = [], []
    samples: dict[str, list[dict[str, Any]]] = {}
    decontam: dict[str, dict[str, int]] = {}
    for i, record in enumerate(read_records(filter_dir / "docs.jsonl.zst")):
        if reached[i]:
            for name, spans in (record["meta"].get("decontam") or {}).items():
                entry = decontam.setdefault(name, {"documents": 0, "spans": 0, "dropped": 0})
                entry["documents"] += 1
                entry["spans"] += int(spans)
                entry["dropped"] += int(not keep[i])
        if keep[i]:
            history = record["meta"].get("history", [])
            if task.lines is not None:
                line_stats["in"] += 1
                if not _remove_lines(record, frequent, task, history, line_stats, emptied):
                    continue
            is_val.append(bool(val_kept[len(is_val) + len(emptied)]))
            texts.append(record["text"])
            doc = {
                "id": record["id"],
                "source": record["source"],
                "file": record["meta"].get("file", ""),
                "ordinal": record["meta"].get("ordinal", -1),
                "history": history,
                "duplicates": clusters.get(i, []),
            }
            if "provenance" in record["meta"]:
                doc["provenance"] = record["meta"]["provenance"]
            docs.append(doc)
            _add_samples(samples, doc, record["text"], task.samples)
    tok, eot_id = _tokenizer(task.tokenizer, task.eot_token)
    dtype = dtype_for_vocab(tok.n_vocab)
    flat, lengths = encode_documents(tok, texts, eot_id, dtype)
    task.dir.mkdir(parents=True, exist_ok=True)
    save_array(task.dir / "tokens.npy", flat)
    save_array(task.dir / "lengths.npy", lengths)
    write_doc_records(task.dir, docs, np.array(is_val, dtype=bool))
    write_records(task.dir / "removed.line_dedup.jsonl.zst", emptied)
    stats = {"task": task.index, "documents": len(docs), "tokens": int(flat.shape[0])}
    if task.lines is not None:
        stats["line_dedup"] = {**line_stats, "emptied": len(emptied)}
    stats["decontam"] = decontam
    stats["samples"] = samples
    write_json_atomic(task.dir / STATS, stats)
    return stats


def _remove_lines(
    record: dict[str, Any],
    frequent: set[int],
    task: TokenizeTask,
    history: list[dict[str, Any]],
    counts: dict[str, int],
    emptied: list[dict[str, Any]],
) -> bool:
    """Remove the record's frequent units (in place); False when nothing of it is left, after
    adding its removal record to `emptied`."""
    from kiln.data.pipeline.dedup.lines import remove_units

    before = record["text"]
    after, removed = remove_units(before, frequent, task.lines)
    if not removed:
        return True
    counts["units_removed"] += removed
    if not after:
        emptied.append(
            {
                "id": record["id"],
                "source": record["source"],
                "file": record["meta"].get("file", ""),
                "ordinal": record["meta"].get("ordinal", -1),
                "stage": "line_dedup",
                "reason": "line_dedup.empty",
                "units_removed": removed,
                "excerpt": before[:EXCERPT_CHARS],
            }
        )
        return False
    counts["changed"] += 1
    record["text"] = after
    history.append(
        {
            "stage": "line_dedup",
            "change": f"removed {task.lines.unit}s repeated in other documents",
            "chars_before": len(before),
            "chars_after": len(after),
            "units_removed": removed,
        }
    )
    return True


def _add_samples(
    samples: dict[str, list[dict[str, Any]]], doc: dict[str, Any], text: str, limit: int
) -> None:
    """Keep the first few output documents as examples: any, and per stage that changed them
    (`changed/<stage>`) or merged duplicates into them (`merged/<stage>`)."""
    keys = ["kept"]
    keys += [f"changed/{h['stage']}" for h in doc["history"]]
    keys += sorted({f"merged/{d['stage']}" for d in doc["duplicates"]})
    for key in keys:
        bucket = samples.setdefault(key, [])
        if len(bucket) < limit:
            bucket.append({**doc, "excerpt": text[:EXCERPT_CHARS]})
