"""`manifest.json` of a token-shard dataset: what it holds, written once, read back with checks."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import KilnError, not_found
from kiln.io import write_json_atomic

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "kiln-shards"
MANIFEST_VERSION = 1


def creation_time() -> str:
    """The manifest's `created` stamp: now (UTC), or SOURCE_DATE_EPOCH when that is set, so
    rebuilding the same inputs can give byte-identical manifests too."""
    from datetime import UTC, datetime

    epoch = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    when = datetime.fromtimestamp(int(epoch), UTC) if epoch.isdigit() else datetime.now(UTC)
    return when.isoformat(timespec="seconds")


def is_shard_dataset(directory: Path) -> bool:
    """Whether `directory` holds a `manifest.json` that says it is a kiln token-shard dataset
    (any folder may hold some other program's manifest.json: --force must not delete that)."""
    try:
        doc = json.loads((Path(directory) / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("format") == MANIFEST_FORMAT


@dataclass(frozen=True)
class ShardEntry:
    """One shard of a split: file stem (`train_000000`), counts and checksums of both files."""

    name: str
    tokens: int
    documents: int
    sha256: str
    idx_sha256: str
    max_id: int | None = None  # the largest token id; None (older manifests): scan to find it


@dataclass(frozen=True)
class SplitEntry:
    """One split (`train`, `val`): its shards in reading order."""

    shards: tuple[ShardEntry, ...] = ()

    @property
    def tokens(self) -> int:
        """Tokens over all shards."""
        return sum(s.tokens for s in self.shards)

    @property
    def documents(self) -> int:
        """Documents over all shards."""
        return sum(s.documents for s in self.shards)


@dataclass(frozen=True)
class SourceEntry:
    """One input file: documents and tokens kept per split, and what was dropped and why."""

    path: str
    documents: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    empty_skipped: int = 0
    invalid_utf8_documents: int = 0
    inline_separators: int = 0  # end-of-text text inside a .txt document, kept as ordinary text
    invalid_utf8_first: str = ""  # where the first invalid UTF-8 was ("byte offset N")


@dataclass(frozen=True)
class TokenizerEntry:
    """The tokenizer the shards were encoded with."""

    path: str
    sha256: str
    vocab_size: int
    eot_token: str
    eot_id: int

    def locate(self, root: Path, extra: tuple[Path, ...] = (), hint: str = "") -> Path | None:
        """The tokenizer file the shards in `root` were encoded with (its sha256 checked).

        Looked for at the recorded path, then beside the dataset, then in `extra`; None when no
        candidate exists, a KilnError (plus `hint`) when candidates exist but none has the
        recorded sha256 (samples or scores decoded with another tokenizer would mislead).
        """
        from kiln.io import sha256_file

        recorded = Path(self.path)
        candidates = dict.fromkeys([recorded, Path(root) / recorded.name, *extra])
        found = [p for p in candidates if p.is_file()]
        for path in found:
            if sha256_file(path) == self.sha256:
                return path
        if not found:
            return None
        actual = sha256_file(found[0])
        raise KilnError(
            f"{found[0]}: sha256 {actual[:12]}… differs from the tokenizer {root} was encoded "
            f"with ({self.sha256[:12]}…, {self.path}){hint}"
        )


@dataclass(frozen=True)
class Manifest:
    """Everything `manifest.json` holds."""

    tokenizer: TokenizerEntry
    dtype: str
    splits: dict[str, SplitEntry]
    sources: tuple[SourceEntry, ...]
    config: dict[str, Any]
    created: str = ""
    kiln_version: str = ""
    # Written by `kiln data run`: the funnel, the mixture before/after, decontamination.
    pipeline: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to disk (split totals included for readers of the file)."""
        splits = {
            name: {
                "tokens": s.tokens,
                "documents": s.documents,
                "shards": [asdict(x) for x in s.shards],
            }
            for name, s in self.splits.items()
        }
        return {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "tokenizer": asdict(self.tokenizer),
            "dtype": self.dtype,
            "splits": splits,
            "sources": [asdict(s) for s in self.sources],
            "config": self.config,
            "created": self.created,
            "kiln_version": self.kiln_version,
            **({"pipeline": self.pipeline} if self.pipeline else {}),
        }

    def write(self, directory: Path) -> None:
        """Write `manifest.json` into `directory`."""
        write_json_atomic(directory / MANIFEST_NAME, self.to_json())

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        """Read and check `directory/manifest.json`; problems name the file and the field."""
        path = directory / MANIFEST_NAME
        if not directory.is_dir():
            raise not_found(directory, "dataset directory")
        if not path.is_file():
            raise KilnError(f"{path}: missing; {directory} is not a kiln token-shard dataset")
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise KilnError(f"{path}: not valid JSON ({exc})") from None
        try:
            return cls._from_json(doc, path)
        except (KeyError, TypeError, ValueError) as exc:
            raise KilnError(f"{path}: malformed manifest ({type(exc).__name__}: {exc})") from None

    @classmethod
    def _from_json(cls, doc: Any, path: Path) -> Manifest:
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise KilnError(f"{path}: format is {found!r}, expected {MANIFEST_FORMAT!r}")
        if doc.get("version") != MANIFEST_VERSION:
            raise KilnError(
                f"{path}: version {doc.get('version')!r}, this kiln reads {MANIFEST_VERSION}"
            )
        splits = {}
        for name, split in doc["splits"].items():
            shards = tuple(ShardEntry(**s) for s in split["shards"])
            splits[str(name)] = SplitEntry(shards)
            for key in ("tokens", "documents"):
                if key in split and split[key] != getattr(splits[name], key):
                    raise KilnError(
                        f"{path}: split {name!r} says {key}={split[key]} but its shards add up to "
                        f"{getattr(splits[name], key)}"
                    )
        return cls(
            tokenizer=TokenizerEntry(**doc["tokenizer"]),
            dtype=str(doc["dtype"]),
            splits=splits,
            sources=tuple(SourceEntry(**s) for s in doc["sources"]),
            config=dict(doc.get("config", {})),
            created=str(doc.get("created", "")),
            kiln_version=str(doc.get("kiln_version", "")),
            pipeline=dict(doc.get("pipeline", {})),
        )
