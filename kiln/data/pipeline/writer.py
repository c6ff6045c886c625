"""Write the pipeline's dataset: token shards in a seeded order, per-shard document maps, manifest.

Beside each `<split>_<NNNNNN>.bin/.idx` pair, `<split>_<NNNNNN>.docs.jsonl.zst` names every
document of the shard in order with its full history: id, source, input file, record ordinal,
copy number, `history` (each stage that rewrote it: extracted, normalised, redacted, cut — with
the cut spans and the benchmark items they matched) and `duplicates` (the documents exact or
near dedup merged into it). So any token leads back to its document, its place in the input
and every decision about it; `pipeline/removed.jsonl.zst` holds every removal with its stage
and reason (a duplicate names the document finally kept).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from kiln import __version__
from kiln import config as cfgio
from kiln.data.manifest import Manifest, SourceEntry, creation_time
from kiln.data.pipeline.config import PipelineConfig
from kiln.data.pipeline.records import hash64, write_records
from kiln.data.shard_format import dtype_for_vocab, dtype_name
from kiln.data.shard_writer import ShardWriter
from kiln.data.tokenize_shards import load_tokenizer_entry
from kiln.io import write_json_atomic

TOKEN_BINS = [2.0**k for k in range(0, 21)]  # document length in tokens, powers of two
DOC_MAP_SUFFIX = ".docs.jsonl.zst"


def _order(
    cfg: PipelineConfig, docs: list[dict[str, Any]], copies: np.ndarray
) -> dict[str, list[tuple[int, int, int]]]:
    """Per split, (sort key, document index, copy) for every copy written, in output order."""
    entries: dict[str, list[tuple[int, int, int]]] = {"train": [], "val": []}
    for i, d in enumerate(docs):
        for copy in range(int(copies[i])):
            entries[d["split"]].append((hash64(cfg.seed, "order", d["id"], copy), i, copy))
    for rows in entries.values():
        rows.sort()
    return entries


def write_dataset(
    cfg: PipelineConfig,
    out: Path,
    work: Path,
    docs: list[dict[str, Any]],
    copies: np.ndarray,
    stats: dict[str, Any],
    progress: bool = True,
) -> Manifest:
    """Write shards, document maps, stats and manifest of the run into `out`."""
    _, entry = load_tokenizer_entry(cfg.tokenize.tokenizer, cfg.tokenize.eot_token)
    dtype = dtype_for_vocab(entry.vocab_size)
    source_index = {s.name: i for i, s in enumerate(cfg.sources)}
    tokens = {
        t: np.load(work / "tokens" / f"{t:06d}" / "tokens.npy", mmap_mode="r")
        for t in sorted({d["task"] for d in docs})
    }
    per_source = {s.name: {"documents": {}, "tokens": {}} for s in cfg.sources}
    lengths_hist = {s.name: [0] * (len(TOKEN_BINS) - 1) for s in cfg.sources}
    splits = {}
    for split, rows in _order(cfg, docs, copies).items():
        writer = ShardWriter(out, split, dtype, cfg.tokenize.shard_tokens)
        doc_map: list[dict[str, Any]] = []
        bar = tqdm(rows, desc=f"write {split}", unit="doc", disable=not progress, file=sys.stderr)
        try:
            for _, i, copy in bar:
                d = docs[i]
                writer.add(
                    tokens[d["task"]][d["start"] : d["start"] + d["length"]],
                    source_index[d["source"]],
                )
                doc_map.append(
                    {
                        "id": d["id"],
                        "source": d["source"],
                        "file": d["file"],
                        "ordinal": d["ordinal"],
                        "copy": copy,
                        "history": d["history"],
                        "duplicates": d["duplicates"],
                    }
                )
                counts = per_source[d["source"]]
                counts["documents"][split] = counts["documents"].get(split, 0) + 1
                counts["tokens"][split] = counts["tokens"].get(split, 0) + d["length"]
                if split == "train":
                    b = min(max(int(np.log2(max(d["length"], 1))), 0), len(TOKEN_BINS) - 2)
                    lengths_hist[d["source"]][b] += 1
        except BaseException:
            writer.abort()
            raise
        splits[split] = writer.close()
        start = 0
        for shard in splits[split].shards:
            write_records(
                out / f"{shard.name}{DOC_MAP_SUFFIX}", doc_map[start : start + shard.documents]
            )
            start += shard.documents
    stats["histograms"]["bins"]["tokens"] = TOKEN_BINS
    for name, hist in lengths_hist.items():
        stats["histograms"].setdefault(name, {})["tokens"] = hist
    stats["splits"] = {s: {"documents": e.documents, "tokens": e.tokens} for s, e in splits.items()}
    write_json_atomic(out / "pipeline" / "stats.json", stats)
    _write_report(out, stats)
    manifest = Manifest(
        tokenizer=entry,
        dtype=dtype_name(dtype),
        splits=splits,
        sources=tuple(
            SourceEntry(path=name, documents=c["documents"], tokens=c["tokens"])
            for name, c in per_source.items()
        ),
        config=cfgio.to_dict(cfg),
        created=creation_time(),
        kiln_version=__version__,
        pipeline={
            "digest": stats["digest"],
            "funnel": [
                {k: row[k] for k in ("stage", "in", "kept", "removed")} for row in stats["funnel"]
            ],
            "mix": stats["mix"],
            "decontamination": stats["decontamination"],
            "stats": "pipeline/stats.json",
            "removed": "pipeline/removed.jsonl.zst",
            "report": "pipeline/report.html",
        },
    )
    manifest.write(out)
    return manifest


def _write_report(out: Path, stats: dict[str, Any]) -> None:
    try:
        from kiln.data.pipeline.report import write_report
    except ImportError:  # the HTML report is optional; stats.json holds every number
        return
    write_report(out / "pipeline" / "report.html", stats)
