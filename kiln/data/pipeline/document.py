"""The unit every pipeline stage works on, and the contract a per-document stage follows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Document:
    """One document: a stable id, its text, the source it came from, and what stages learned.

    `meta` always holds `file` (the input path) and `ordinal` (the record's position in that
    file, 0-based, counting malformed records too); readers add `line` (1-based) where the
    format has lines. Stages add their own keys (`lang`, `lang_score`, ...).
    """

    id: str
    text: str
    source: str
    meta: dict[str, Any] = field(default_factory=dict)


class DocumentStage(Protocol):
    """A per-document step: keep the document (possibly rewriting text/meta) or name why not.

    `apply` returns None to keep `doc` (it may have changed `doc.text` and `doc.meta` in place)
    or a removal reason: a short rule name such as `"gopher_quality.mean_word_length"`. Stages
    are built from their config dataclass in each worker and must not keep state between
    documents, so the result never depends on how documents are split across workers.
    """

    name: str

    def apply(self, doc: Document) -> str | None:
        """Keep `doc` (None) or return the reason it is removed."""
        ...
