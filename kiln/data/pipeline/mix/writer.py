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
from kiln.data.pipeline.mix.survivors import DocRecords, Survivors, output_order
from kiln.data.pipeline.records import write_records
from kiln.data.shard_format import dtype_for_vocab, dtype_name, shard_stem
from kiln.data.shard_writer import ShardWriter
from kiln.data.tokenize_shards import load_tokenizer_entry, with_byte_tokenizer
from kiln.io import write_json_atomic

TOKEN_BINS = [2.0**k for k in range(0, 21)]  # document length in tokens, powers of two
DOC_MAP_SUFFIX = ".docs.jsonl.zst"


def write_dataset(
    cfg: PipelineConfig,
    out: Path,
    work: Path,
    docs: Survivors,
    copies: np.ndarray,
    stats: dict[str, Any],
    progress: bool = True,
    final: Path | None = None,
) -> Manifest:
    """Write shards, document maps, stats and manifest of the run into `out` (moved to `final`).

    Memory: the survivors' arrays and the output order (~20 bytes per copy), one shard's
    document map at a time; records and tokens are read from the tokenize tasks' files.
    """
    tok, entry = load_tokenizer_entry(cfg.tokenize.tokenizer, cfg.tokenize.eot_token)
    entry = with_byte_tokenizer(tok, entry, out, final or out)
    dtype = dtype_for_vocab(entry.vocab_size)
    names = [s.name for s in cfg.sources]
    tokens = {
        t: np.load(work / "tokens" / f"{t:06d}" / "tokens.npy", mmap_mode="r")
        for t in np.unique(docs.task).tolist()
    }
    records = DocRecords(work)
    per_source = {s.name: {"documents": {}, "tokens": {}} for s in cfg.sources}
    lengths_hist = {s.name: [0] * (len(TOKEN_BINS) - 1) for s in cfg.sources}
    splits = {}
    for split in ("train", "val"):
        order, copy_of = output_order(cfg, work, docs, copies, split)
        writer = ShardWriter(out, split, dtype, cfg.tokenize.shard_tokens)
        doc_map: list[dict[str, Any]] = []  # the open shard's
        bar = tqdm(range(len(order)), desc=f"write {split}", unit="doc", disable=not progress,
                   file=sys.stderr)  # fmt: skip
        try:
            for k in bar:
                i, copy = int(order[k]), int(copy_of[k])
                task, start, length = int(docs.task[i]), int(docs.start[i]), int(docs.length[i])
                finished = writer.finished_shards
                writer.add(tokens[task][start : start + length], int(docs.source[i]))
                if writer.finished_shards > finished:  # this document opened a new shard
                    _write_doc_map(out, split, finished, doc_map)
                    doc_map = []
                d = records.get(task, int(docs.local[i]))
                doc_map.append(
                    {
                        "id": d["id"],
                        "source": d["source"],
                        "file": d["file"],
                        "ordinal": d["ordinal"],
                        "copy": copy,
                        "history": d["history"],
                        "duplicates": d["duplicates"],
                        **({"provenance": d["provenance"]} if "provenance" in d else {}),
                    }
                )
                name = names[int(docs.source[i])]
                counts = per_source[name]
                counts["documents"][split] = counts["documents"].get(split, 0) + 1
                counts["tokens"][split] = counts["tokens"].get(split, 0) + length
                if split == "train":
                    b = min(max(int(np.log2(max(length, 1))), 0), len(TOKEN_BINS) - 2)
                    lengths_hist[name][b] += 1
        except BaseException:
            writer.abort()
            records.close()
            raise
        splits[split] = writer.close()
        if doc_map:
            _write_doc_map(out, split, writer.finished_shards - 1, doc_map)
    records.close()
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


def _write_doc_map(out: Path, split: str, shard: int, doc_map: list[dict[str, Any]]) -> None:
    write_records(out / f"{shard_stem(split, shard)}{DOC_MAP_SUFFIX}", doc_map)


def _write_report(out: Path, stats: dict[str, Any]) -> None:
    try:
        from kiln.data.pipeline.report import write_report
    except ImportError:  # the HTML report is optional; stats.json holds every number
        return
    write_report(out / "pipeline" / "report.html", stats)
