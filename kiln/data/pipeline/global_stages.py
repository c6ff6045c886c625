"""The stages that need every document at once: exact dedup, near dedup, decontamination.

They run in one process on the fingerprints the filter tasks computed (hash keys, MinHash band
keys, the decontamination verdict), never on the text, so memory grows with documents only.
Validation documents sort first and are protected, so a training document that duplicates or
nearly duplicates a validation document is the one removed.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data.pipeline.config import PipelineConfig
from kiln.data.pipeline.records import load_arrays, read_records, save_arrays, write_records
from kiln.data.pipeline.tasks import DECONTAM_CODES, EXCERPT_CHARS
from kiln.io import write_json_atomic

GLOBAL_STATS = "stats.json"


def _concat(parts: list[np.ndarray], empty: np.ndarray) -> np.ndarray:
    return np.concatenate(parts) if parts else empty


def run_global_stages(cfg: PipelineConfig, task_dirs: list[Path], out_dir: Path) -> None:
    """Decide which documents survive dedup and decontamination; write per-task keep masks."""
    from kiln.data.pipeline.exact_dedup import first_occurrences
    from kiln.data.pipeline.near_dedup import near_duplicate_clusters

    keys = [load_arrays(d / "keys.npz") for d in task_dirs]
    sizes = [int(k["is_val"].shape[0]) for k in keys]
    n = sum(sizes)
    task_of = np.repeat(np.arange(len(task_dirs)), sizes)
    local = np.concatenate([np.arange(s) for s in sizes]) if n else np.zeros(0, np.int64)
    ids = _concat([k["ids"] for k in keys], np.zeros(0, dtype=str))
    is_val = _concat([k["is_val"] for k in keys], np.zeros(0, bool))
    codes = _concat([k["decontam"] for k in keys], np.zeros(0, np.int8))
    # Rank: validation documents first, then input order (task order, then within the task).
    rank = np.empty(n, dtype=np.int64)
    rank[np.lexsort((np.arange(n), ~is_val))] = np.arange(n)

    removals: list[tuple[int, str, str, int]] = []  # (doc, stage, reason, kept duplicate)
    alive = np.ones(n, dtype=bool)
    merged_into = np.arange(n, dtype=np.int64)  # the document each duplicate was matched to
    if cfg.dedup.exact.enabled and n:
        exact = _concat([k["exact"] for k in keys], np.zeros((0, 16), np.uint8))
        keep, dup_of = first_occurrences(exact, rank, protected=is_val)
        for i in np.flatnonzero(~keep):
            j = int(dup_of[i])
            reason = "exact_dedup.duplicate_of_val" if is_val[j] else "exact_dedup.duplicate"
            removals.append((int(i), "exact_dedup", reason, j))
        merged_into[~keep] = dup_of[~keep]
        alive &= keep
    exact_alive = int(alive.sum())
    if cfg.dedup.near.enabled and alive.any():
        idx = np.flatnonzero(alive)
        bands = _concat([k["bands"] for k in keys], np.zeros((0, 0), np.uint64))[idx]
        roots, keep = near_duplicate_clusters(bands, rank[idx], protected=is_val[idx])
        for pos in np.flatnonzero(~keep):
            i, j = int(idx[pos]), int(idx[roots[pos]])
            reason = "near_dedup.cluster_has_val" if is_val[j] else "near_dedup.duplicate"
            removals.append((i, "near_dedup", reason, j))
        merged_into[idx[~keep]] = idx[roots[~keep]]
        alive[idx[~keep]] = False
    near_alive = int(alive.sum())
    final = _resolve_chains(merged_into)
    reached = alive.copy()
    for i in np.flatnonzero(alive & (codes > 0)):
        removals.append((int(i), "decontaminate", DECONTAM_CODES[codes[i]], -1))
        alive[i] = False

    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    for t, _d in enumerate(task_dirs):
        lo, hi = bounds[t], bounds[t + 1]
        save_arrays(
            out_dir / f"{t:06d}.npz",
            keep=alive[lo:hi],
            reached_decontam=reached[lo:hi],
            val_kept=is_val[lo:hi][alive[lo:hi]],
        )
    records, samples = _removal_records(cfg, removals, final, ids, task_of, local, keys, task_dirs)
    write_records(out_dir / "removed.jsonl.zst", records)
    _write_clusters(out_dir, records, removals, final, task_of, local, len(task_dirs))

    reasons: dict[str, Counter[str]] = {}
    by_source: dict[str, Counter[str]] = {}
    for r in records:
        reasons.setdefault(r["stage"], Counter())[r["reason"]] += 1
        by_source.setdefault(r["stage"], Counter())[r["source"]] += 1

    def row(stage: str, before: int, after: int, changed: int = 0) -> dict[str, Any]:
        return {
            "stage": stage,
            "in": before,
            "kept": after,
            "removed": dict(reasons.get(stage, {})),
            "by_source": dict(by_source.get(stage, {})),
            "changed": changed,
        }

    cut = _concat([k["cut"] for k in keys], np.zeros(0, bool))
    funnel = [
        row("exact_dedup", n, exact_alive),
        row("near_dedup", exact_alive, near_alive),
        row("decontaminate", near_alive, int(alive.sum()), int((alive & cut).sum())),
    ]
    write_json_atomic(
        out_dir / GLOBAL_STATS,
        {"documents": n, "val_documents": int(is_val.sum()), "funnel": funnel, "samples": samples},
    )


def _resolve_chains(merged_into: np.ndarray) -> np.ndarray:
    """Follow "duplicate of" links to their end: the document finally kept for each one.

    An exact duplicate's kept copy may itself be removed by near dedup; the audit log names
    the document that survived both (links only point at earlier survivors, so this ends).
    """
    final = merged_into.copy()
    while True:
        step = final[final]
        if np.array_equal(step, final):
            return final
        final = step


def _write_clusters(
    out_dir: Path,
    records: list[dict[str, Any]],
    removals: list[tuple[int, str, str, int]],
    final: np.ndarray,
    task_of: np.ndarray,
    local: np.ndarray,
    n_tasks: int,
) -> None:
    """Per task, `<task>.clusters.jsonl.zst`: each kept document's merged duplicates."""
    per_task: list[dict[int, list[dict[str, Any]]]] = [{} for _ in range(n_tasks)]
    for record, (i, _stage, _reason, j) in zip(records, removals, strict=True):
        if j < 0:
            continue
        k = int(final[i])
        entry = {key: record[key] for key in ("id", "source", "file", "ordinal", "stage", "reason")}
        if "matched" in record:
            entry["matched"] = record["matched"]
        per_task[int(task_of[k])].setdefault(int(local[k]), []).append(entry)
    for t, clusters in enumerate(per_task):
        write_records(
            out_dir / f"{t:06d}.clusters.jsonl.zst",
            ({"doc": doc, "duplicates": dups} for doc, dups in sorted(clusters.items())),
        )


def _removal_records(
    cfg: PipelineConfig,
    removals: list[tuple[int, str, str, int]],
    final: np.ndarray,
    ids: np.ndarray,
    task_of: np.ndarray,
    local: np.ndarray,
    keys: list[dict[str, np.ndarray]],
    task_dirs: list[Path],
) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """Audit records of the global removals, with text excerpts for the first few by reason."""
    records: list[dict[str, Any]] = []
    per_reason: dict[str, int] = {}
    wanted: dict[int, dict[int, dict[str, Any]]] = {}  # task -> local index -> record
    for i, stage, reason, j in removals:
        t = int(task_of[i])
        record: dict[str, Any] = {
            "id": str(ids[i]),
            "source": "",
            "file": "",
            "ordinal": int(keys[t]["ordinal"][local[i]]),
            "stage": stage,
            "reason": reason,
        }
        if j >= 0:
            record["duplicate_of"] = str(ids[final[j]])
            if final[j] != j:  # matched a document that was itself merged into another
                record["matched"] = str(ids[j])
        per_reason[reason] = per_reason.get(reason, 0) + 1
        records.append(record)
        wanted.setdefault(t, {})[int(local[i])] = record
    sampled: dict[str, int] = {}
    for t in sorted(wanted):
        for k, doc in enumerate(read_records(task_dirs[t] / "docs.jsonl.zst")):
            record = wanted[t].get(k)
            if record is None:
                continue
            record["source"], record["file"] = doc["source"], doc["meta"].get("file", "")
            sampled[record["reason"]] = sampled.get(record["reason"], 0) + 1
            if sampled[record["reason"]] <= cfg.removed_samples:
                text = doc["meta"].get("decontam_excerpt") or doc["text"]
                record["excerpt"] = text[:EXCERPT_CHARS]
    samples: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        if "excerpt" in record:
            samples.setdefault(f"{record['stage']}/{record['reason']}", []).append(record)
    return records, samples
