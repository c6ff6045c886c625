"""From a training token (or a document id) back to its document's full history.

The history is what the shard's document map holds: the source record it was read from, every
stage that rewrote it and why, and the documents deduplicated into it. Removals of *other*
documents near it in the input file are listed after it, labelled as such: they sit nearby,
they were not merged into it.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data.pipeline.mix.writer import DOC_MAP_SUFFIX
from kiln.data.pipeline.records import read_records
from kiln.data.shard_reader import Dataset
from kiln.errors import KilnError


def document_at_token(ds: Dataset, split: str, position: int) -> tuple[int, int, int]:
    """(shard number, document index within the shard, document index within the split)."""
    sp = ds.split(split)
    if not 0 <= position < sp.n_tokens:
        raise KilnError(f"--token {position}: split {split!r} has {sp.n_tokens:,} tokens")
    starts = np.cumsum([0] + [s.tokens.shape[0] for s in sp.shards])
    shard = int(np.searchsorted(starts, position, side="right")) - 1
    local_pos = position - int(starts[shard])
    local_doc = int(np.searchsorted(sp.shards[shard].offsets, local_pos, side="right")) - 1
    before = sum(s.n_documents for s in sp.shards[:shard])
    return shard, local_doc, before + local_doc


def document_record(root: Path, split: str, shard: int, local_doc: int) -> dict[str, Any]:
    """The document map entry (id, source, file, ordinal, copy) of one shard document."""
    path = root / f"{split}_{shard:06d}{DOC_MAP_SUFFIX}"
    if not path.is_file():
        raise KilnError(f"{path}: missing; only datasets made by `kiln data run` map documents")
    record = next(itertools.islice(read_records(path), local_doc, None), None)
    if record is None:
        raise KilnError(f"{path}: has no entry {local_doc}; the dataset is damaged")
    return record


def removed_near(root: Path, file: str, ordinal: int, window: int) -> list[dict[str, Any]]:
    """Removal records of the same input file within `window` records of `ordinal`."""
    path = root / "pipeline" / "removed.jsonl.zst"
    if not path.is_file():
        raise KilnError(f"{path}: missing; the dataset has no removal log")
    near = [
        r
        for r in read_records(path)
        if r["file"] == file and abs(int(r["ordinal"]) - ordinal) <= window
    ]
    return sorted(near, key=lambda r: r["ordinal"])


def find_document(root: Path, doc_id: str) -> tuple[str, int, int, int]:
    """(split, shard, index within the shard, index within the split) of a document by id."""
    for split in _splits(root):
        before = 0
        for path in sorted(root.glob(f"{split}_[0-9]*{DOC_MAP_SUFFIX}")):
            shard = int(path.name.removesuffix(DOC_MAP_SUFFIX).rsplit("_", 1)[1])
            count = 0
            for k, record in enumerate(read_records(path)):
                if record["id"] == doc_id:
                    return split, shard, k, before + k
                count += 1
            before += count
    raise KilnError(f"--doc {doc_id!r}: no document with this id in {root}'s document maps")


def _splits(root: Path) -> list[str]:
    names = {
        p.name.removesuffix(DOC_MAP_SUFFIX).rsplit("_", 1)[0]
        for p in root.glob(f"*_*{DOC_MAP_SUFFIX}")
    }
    return sorted(names, key=lambda name: (name != "train", name))


def format_history(record: dict[str, Any]) -> list[str]:
    """Lines for a document map entry: its source record, its changes, its merged duplicates."""
    lines = [
        f"  id {record['id']}  source {record['source']}  copy {record.get('copy', 0)}",
        f"  source record: input {record['file']} record {record['ordinal']}",
    ]
    if "provenance" in record:
        lines.extend(provenance_lines(record["provenance"]))
    history = record.get("history", [])
    if not history:
        lines.append("  changes: none (written as read)")
    else:
        lines.append("  changes:")
        for entry in history:
            lines.extend(f"    {line}" for line in _change_lines(entry))
    duplicates = record.get("duplicates", [])
    if not duplicates:
        lines.append("  duplicates merged into it: none")
    else:
        lines.append(f"  duplicates merged into it ({len(duplicates)}):")
        for d in duplicates:
            via = f", matched {d['matched']}" if d.get("matched") else ""
            lines.append(
                f"    {d['id']} (input {d['file']} record {d['ordinal']}): {d['reason']}{via}"
            )
    return lines


def provenance_lines(p: dict[str, Any]) -> list[str]:
    """Where a synthetic document came from: method, model and its sha256, seed, sampling."""
    sampling = ", ".join(f"{k} {v}" for k, v in sorted(p.get("sampling", {}).items()))
    lines = [
        f"  synthetic: {p.get('method', '?')} ({p.get('recipe', '?')}) by {p.get('model', '?')} "
        f"(weights sha256 {str(p.get('model_sha256', '?'))[:16]}…), seed {p.get('seed', '?')}",
    ]
    if sampling:
        lines.append(f"    sampling: {sampling}")
    if "input" in p:
        lines.append(f"    rewritten from {p['input'].get('id')} ({p.get('style', '?')} style)")
    if "prompt" in p:
        lines.append(f"    prompt: {p['prompt'][:200]!r}")
    return lines


def _change_lines(entry: dict[str, Any]) -> list[str]:
    """One change: the stage, what it did, and the details that say why."""
    head = (
        f"{entry['stage']}: {entry['change']} "
        f"({entry['chars_before']:,} -> {entry['chars_after']:,} characters)"
    )
    lines = [head]
    if "pii" in entry:
        pii = entry["pii"]
        phones = f", {pii['phone']} phone" if "phone" in pii else ""
        lines.append(f"  {pii.get('email', 0)} e-mail, {pii.get('ip', 0)} IP{phones}")
    if entry.get("c4_lines_removed"):
        rules = ", ".join(f"{rule}: {n}" for rule, n in entry["c4_lines_removed"].items())
        lines.append(f"  lines removed by rule: {rules}")
    for cut in entry.get("decontam_cuts", []):
        why = (
            "matched "
            + "; ".join(
                f"{task} item{'s' if len(items) > 1 else ''} {', '.join(map(str, items))}"
                for task, items in cut["matched"].items()
            )
            if cut["kind"] == "match"
            else "left as a piece too short to keep"
        )
        lines.append(
            f"  cut characters {cut['start']:,}-{cut['start'] + cut['chars']:,} "
            f"({cut['chars']:,} characters, {cut['words']:,} words): {why}"
        )
    return lines


def _nearby_lines(root: Path, record: dict[str, Any], window: int) -> list[str]:
    near = [
        r
        for r in removed_near(root, record["file"], int(record["ordinal"]), window)
        if r["id"] != record["id"]
    ]
    label = f"  nearby removals in the input (other documents within {window} records"
    if not near:
        return [f"{label}): none"]
    lines = [f"{label}; not merged into this one unless listed above):"]
    for r in near:
        dup = f" (duplicate of {r['duplicate_of']})" if r.get("duplicate_of") else ""
        lines.append(f"    record {r['ordinal']}: {r['stage']}: {r['reason']}{dup}")
    return lines


def _explain(root: Path, title: str, split: str, shard: int, local_doc: int, window: int) -> str:
    """The title, the document's history, then the removals next to it in the input."""
    record = document_record(root, split, shard, local_doc)
    lines = [f"{title} (shard {shard}, #{local_doc})", *format_history(record)]
    return "\n".join(lines + _nearby_lines(root, record, window))


def explain_token(ds: Dataset, split: str, position: int, window: int = 5) -> str:
    """The token's document with its full history, then removals next to it in the input."""
    shard, local_doc, index = document_at_token(ds, split, position)
    title = f"token {position:,} of {split}: document {index:,}"
    return _explain(ds.root, title, split, shard, local_doc, window)


def explain_document(root: Path, doc_id: str, window: int = 5) -> str:
    """A document's full history by id, then removals next to it in the input."""
    split, shard, local_doc, index = find_document(root, doc_id)
    title = f"document {doc_id}: {split} document {index:,}"
    return _explain(root, title, split, shard, local_doc, window)


def explain_index(ds: Dataset, split: str, index: int, window: int = 5) -> str | None:
    """The history of document `index` of a split; None if the dataset has no document maps."""
    sp = ds.split(split)
    if not 0 <= index < sp.n_documents:
        raise KilnError(f"--doc {index}: split {split!r} has {sp.n_documents} documents")
    counts = np.cumsum([0] + [s.n_documents for s in sp.shards])
    shard = int(np.searchsorted(counts, index, side="right")) - 1
    if not (ds.root / f"{split}_{shard:06d}{DOC_MAP_SUFFIX}").is_file():
        return None
    title = f"{split} document {index:,}"
    return _explain(ds.root, title, split, shard, index - int(counts[shard]), window)
