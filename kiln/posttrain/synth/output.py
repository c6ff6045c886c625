"""A resumable output folder of generated records: parts written atomically, then one JSONL.

    OUT/synth.json          what is being made (command, config, model sha256, digest)
    OUT/parts/NNNNNN.jsonl  the records of work unit N (each appears only complete)
    OUT/documents.jsonl     every record in unit order, once all units exist (atomic)
    OUT/manifest.json       counts, sha256 of documents.jsonl, the shared provenance

A unit is a fixed range of record numbers and each record depends only on its number (its
prompt, its input document, its seed), so a killed run resumes by making the units without a
part: nothing is generated twice and nothing is lost. documents.jsonl is a source the data
pipeline reads (`format = "jsonl"`, `id_field = "id"`); each record's `provenance` goes into the
pipeline's audit trail.
"""

from __future__ import annotations

import datetime
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kiln import __version__
from kiln.errors import KilnError
from kiln.fault_points import kill_point
from kiln.io import atomic_write, sha256_file, write_json_atomic

FORMAT = "kiln-synth"
VERSION = 1
IDENTITY = "synth.json"
DOCUMENTS = "documents.jsonl"
MANIFEST = "manifest.json"


def open_output(out: Path, identity: dict[str, Any], force: bool) -> bool:
    """Prepare `out` for `identity`; True when it already holds the finished output.

    A folder made for another config (or not by this command) is refused unless --force.
    """
    marker = out / IDENTITY
    if out.exists() and not out.is_dir():
        raise KilnError(f"{out}: exists and is not a folder")
    if marker.is_file():
        old = json.loads(marker.read_text(encoding="utf-8"))
        if old.get("digest") == identity["digest"]:
            return (out / MANIFEST).is_file() and (out / DOCUMENTS).is_file()
        if not force:
            raise KilnError(
                f"{out}: made by another config or model (digest {old.get('digest')}, now "
                f"{identity['digest']}); pass --force to replace it, or choose another --out"
            )
    elif out.exists() and any(out.iterdir()) and not force:
        raise KilnError(f"{out}: not empty and not a synth output; pass --force to replace it")
    if out.exists() and force:
        shutil.rmtree(out)
    (out / "parts").mkdir(parents=True, exist_ok=True)
    write_json_atomic(marker, {"format": FORMAT, "version": VERSION, **identity})
    return False


def part_path(out: Path, unit: int) -> Path:
    """Where work unit `unit`'s records go."""
    return out / "parts" / f"{unit:06d}.jsonl"


def run_units(
    out: Path,
    units: Iterable[tuple[int, list[Any]]],
    make: Callable[[list[Any]], list[dict[str, Any]]],
    total: int,
    progress: bool = True,
) -> tuple[int, int]:
    """Make every unit without a part and write its records; (units made, units found done)."""
    made = skipped = done_items = 0
    start = time.monotonic()
    made_items = 0
    for unit, items in units:
        path = part_path(out, unit)
        done_items += len(items)
        if path.is_file():
            skipped += 1
            continue
        records = make(items)
        with atomic_write(path, "w") as handle:
            for record in records:
                handle.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")
        made += 1
        made_items += len(items)
        kill_point("synth.part")
        if progress:
            rate = made_items / max(time.monotonic() - start, 1e-9)
            eta = (total - done_items) / rate if rate > 0 else float("inf")
            print(
                f"\r  {done_items:,}/{total:,} documents  {rate:.2f} docs/s  ETA {eta:.0f}s",
                end="",
                file=sys.stderr,
                flush=True,
            )
    if progress and made:
        print(file=sys.stderr)
    return made, skipped


def finish(out: Path, units: int, summary: dict[str, Any]) -> dict[str, Any]:
    """Join the parts into documents.jsonl, write the manifest, drop the parts; the manifest."""
    n = 0
    with atomic_write(out / DOCUMENTS, "w") as handle:
        for unit in range(units):
            path = part_path(out, unit)
            if not path.is_file():
                raise KilnError(f"{path}: missing; rerun the command to make it")
            with open(path, encoding="utf-8") as part:
                for line in part:
                    handle.write(line)
                    n += 1
    identity = json.loads((out / IDENTITY).read_text(encoding="utf-8"))
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "command": identity["command"],
        "digest": identity["digest"],
        "documents": n,
        "file": DOCUMENTS,
        "sha256": sha256_file(out / DOCUMENTS),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "kiln_version": __version__,
        **summary,
    }
    write_json_atomic(out / MANIFEST, manifest)
    shutil.rmtree(out / "parts", ignore_errors=True)
    return read_manifest(out)


def read_manifest(out: Path) -> dict[str, Any]:
    """The manifest of a finished output, with `path` (its documents file) added."""
    manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    return {**manifest, "path": str(out / DOCUMENTS)}
