"""Which shard files already passed their sha256 check: a stamp in the user's cache, per manifest.

Hashing every shard at every start (each resume, DDP rank and sweep run) costs a full read of the
dataset. A file that passed is recorded with its (size, mtime_ns, inode) under
`<cache>/verified/<sha256 of manifest.json>.json`; a later open skips hashing a file whose stat
still matches. The stamp lives in the cache, never in the dataset (datasets are immutable), and
is only a shortcut: an unreadable or corrupt stamp means "verify again", an unwritable cache
means "verify every time".
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from kiln.io import write_json_atomic

CACHE_ENV = "KILN_CACHE_DIR"
STAMP_FORMAT = "kiln-verified"
# A file modified within a timestamp tick of its check could keep its mtime: only files older
# than this at check time are recorded (git's "racy clean" rule; 2 s covers coarse filesystems).
RACY_NS = 2_000_000_000


def cache_dir() -> Path:
    """kiln's cache: $KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln, else ~/.cache/kiln."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kiln"


def _fingerprint(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}


class VerifiedStamp:
    """The files of one manifest's dataset that passed verification, as recorded in the cache."""

    def __init__(self, path: Path, files: dict[str, object]) -> None:
        self.path = path
        self._files = files
        self._changed = False

    @classmethod
    def load(cls, manifest_path: Path) -> VerifiedStamp:
        """The stamp of `manifest_path` (by its bytes' sha256); empty when missing or unreadable."""
        digest = hashlib.sha256(manifest_path.read_bytes()).hexdigest()
        path = cache_dir() / "verified" / f"{digest}.json"
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            doc = None
        files = doc.get("files") if isinstance(doc, dict) else None
        if not isinstance(doc, dict) or doc.get("format") != STAMP_FORMAT:
            files = None
        return cls(path, files if isinstance(files, dict) else {})

    def is_verified(self, path: Path) -> bool:
        """Whether `path` passed before and its stat is unchanged since."""
        try:
            st = path.stat()
        except OSError:
            return False
        return self._files.get(str(path.resolve())) == _fingerprint(st)

    def record(self, path: Path, st: os.stat_result, checked_at_ns: int) -> None:
        """Note that `path`, whose stat before hashing was `st`, passed at `checked_at_ns`."""
        if st.st_mtime_ns < checked_at_ns - RACY_NS:
            self._files[str(path.resolve())] = _fingerprint(st)
            self._changed = True

    def save(self) -> None:
        """Write the stamp atomically if it gained files; a cache that can't be written is fine."""
        if not self._changed:
            return
        with contextlib.suppress(OSError):  # no cache: the next open verifies again
            write_json_atomic(
                self.path, {"format": STAMP_FORMAT, "version": 1, "files": self._files}
            )
        self._changed = False
