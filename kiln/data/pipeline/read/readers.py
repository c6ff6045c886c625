"""Records of input files as Documents: .txt, .jsonl, .parquet, .html and WARC, compressed or not.

Every reader streams its file and yields one item per record ordinal (0-based, in file order): a
`Document`, or None for a record that cannot become one (broken JSON line, missing text field,
empty document, non-HTML WARC response, ...), after recording why in a `ReadIssues`. Because
malformed records keep their ordinal, `count_records` can number a file's records without
decoding them, and a file can be split into ordinal ranges (`start`/`stop`) that are read
independently: each issue is reported by exactly one range, so merged reports count it once.

Readers leave `Document.id` and `Document.source` empty (the runner names documents) unless an
`id_field` is given. `meta` holds `file`, `ordinal`, and `line` (1-based, where the record's text
starts) for the line-based formats; HTML and WARC records carry `content_type = "html"` so the
Extract stage runs on them, and WARC records add `url` and `warc_record_id` (jsonl records
with a string `url` field add it too; records with an object `provenance` field, as
`kiln data synth` writes them, add it, and the audit trail carries it).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from kiln.data.documents import iter_raw_text_documents, iter_text_documents
from kiln.data.pipeline.document import Document
from kiln.data.pipeline.read import warc
from kiln.errors import KilnError, json_error_reason
from kiln.io import COMPRESSED_SUFFIXES, open_binary, strip_compression
from kiln.tokenizer.special import EOT

FORMATS = ("txt", "jsonl", "parquet", "html", "warc")
_EXTENSIONS = {
    ".txt": "txt",
    ".text": "txt",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".html": "html",
    ".htm": "html",
    ".xhtml": "html",
    ".warc": "warc",
    ".wet": "warc",
}
MAX_EXAMPLES = 20
INLINE_SEPARATOR = "separator inside a document"
_PARQUET_BATCH_ROWS = 1024
_CHUNK = 1 << 20


def detect_format(path: str | os.PathLike[str]) -> str:
    """The reader format named by a file's extension, ignoring a compression suffix."""
    name = strip_compression(os.fspath(path)).lower()
    ext = os.path.splitext(name)[1]
    if ext in _EXTENSIONS:
        return _EXTENSIONS[ext]
    known = ", ".join(sorted(_EXTENSIONS))
    raise KilnError(
        f"{os.fspath(path)}: cannot tell the format from the extension {ext or '(none)'!r}; "
        f"expected one of {known} (optionally + .gz/.zst/.bz2), or set the source's format"
    )


@dataclass
class ReadIssues:
    """What went wrong while reading: counts by kind and the first few examples, mergeable."""

    max_examples: int = MAX_EXAMPLES
    counts: Counter[str] = field(default_factory=Counter)
    examples: list[dict[str, Any]] = field(default_factory=list)

    def add(
        self, path: str, line: int | None, kind: str, detail: str = "", *, record: int | None = None
    ) -> None:
        """Count one issue of `kind` at `path` (1-based `line` and/or record ordinal, if known)."""
        self.counts[kind] += 1
        if len(self.examples) < self.max_examples:
            self.examples.append(
                {"file": path, "line": line, "record": record, "kind": kind, "detail": detail}
            )

    @property
    def total(self) -> int:
        """The number of issues of every kind."""
        return sum(self.counts.values())

    def merge(self, other: ReadIssues) -> None:
        """Add `other`'s counts, and its examples while there is room."""
        self.counts.update(other.counts)
        room = self.max_examples - len(self.examples)
        self.examples.extend(other.examples[: max(room, 0)])

    def to_json(self) -> dict[str, Any]:
        """A JSON-able summary: total, counts by kind (sorted), examples in reading order."""
        return {
            "total": self.total,
            "counts": dict(sorted(self.counts.items())),
            "examples": [dict(e) for e in self.examples],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReadIssues:
        """Rebuild issues written by `to_json` (e.g. by another worker)."""
        return cls(counts=Counter(data.get("counts", {})), examples=list(data.get("examples", [])))

    @staticmethod
    def format_example(example: dict[str, Any]) -> str:
        """One example as a line: `file:line: kind (detail)` or `file record N: kind`."""
        where = example["file"]
        if example.get("line") is not None:
            where += f":{example['line']}"
        elif example.get("record") is not None:
            where += f" record {example['record']}"
        detail = f" ({example['detail']})" if example.get("detail") else ""
        return f"{where}: {example['kind']}{detail}"


@dataclass(frozen=True)
class _Range:
    """The ordinals [start, stop) one reader owns, and so the issues it reports."""

    start: int
    stop: int | None

    def wants(self, ordinal: int) -> bool:
        return ordinal >= self.start and (self.stop is None or ordinal < self.stop)

    def done(self, ordinal: int) -> bool:
        return self.stop is not None and ordinal >= self.stop

    def owns_eof(self, next_ordinal: int) -> bool:
        """Whether an issue found at the end of the file (after `next_ordinal - 1`) is ours."""
        # The range ending where the file ends owns it; of empty ranges only [0, 0) (empty file).
        ends_here = next_ordinal == self.stop and (self.start < self.stop or self.start == 0)
        return self.wants(next_ordinal) or ends_here


def iter_records(
    path: str,
    fmt: str,
    *,
    text_field: str = "text",
    id_field: str | None = None,
    separator: str = EOT,
    issues: ReadIssues,
    start: int = 0,
    stop: int | None = None,
    index: str = "",
) -> Iterator[Document | None]:
    """Yield the records of ordinals [start, stop) of one file: a Document or None if malformed.

    Issues (including those of records outside the range that the reader has to look at) are
    added to `issues` only by the range that owns them, so ranges covering a file report each
    issue once. A missing or unreadable file raises KilnError. `index` (txt, jsonl): the file's
    byte-offset index (see `offsets`), read from the checkpoint before `start` instead of the
    file from its beginning; the records and issues are the same.
    """
    span = _Range(start, stop)
    if fmt == "txt":
        if not separator:
            raise KilnError(f"{path}: the txt separator must not be empty")
        return _iter_txt(path, separator.encode("utf-8"), issues, span, index)
    if fmt == "jsonl":
        return _iter_jsonl(path, text_field, id_field, issues, span, index)
    if fmt == "parquet":
        return _iter_parquet(path, text_field, id_field, issues, span)
    if fmt == "html":
        return _iter_html(path, issues, span)
    if fmt == "warc":
        return _iter_warc(path, issues, span)
    raise KilnError(f"{path}: unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")


def count_records(
    path: str,
    fmt: str,
    *,
    separator: str = EOT,
) -> int:
    """The number of items `iter_records` yields for this file, found without decoding records.

    A record whose text field is missing or malformed still occupies its ordinal, so the count
    never depends on the text field.
    """
    if fmt == "txt":
        if not separator:
            raise KilnError(f"{path}: the txt separator must not be empty")
        return sum(1 for _ in iter_raw_text_documents(path, separator.encode("utf-8")))
    if fmt == "jsonl":
        return _count_lines(path)
    if fmt == "parquet":
        return _open_parquet(path).metadata.num_rows
    if fmt == "html":
        with open_binary(path) as handle:
            return 0 if not handle.read().strip() else 1
    if fmt == "warc":
        with open_binary(path) as handle:
            scan = _scan_warc(handle, path, ReadIssues(), _Range(0, None), read_blocks=False)
            return sum(1 for _ in scan)
    raise KilnError(f"{path}: unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")


# --- txt ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _lines_from(path: str, index: str, start: int) -> Iterator[tuple[Any, int, int]]:
    """(lines, first ordinal, first line): the file from its start, or from its index."""
    if not index:
        with open_binary(path) as handle:
            yield handle, 0, 1
        return
    from kiln.data.pipeline.read.offsets import open_at

    with open_at(index, start) as found:
        yield found


def _iter_txt(
    path: str, sep: bytes, issues: ReadIssues, span: _Range, index: str = ""
) -> Iterator[Document | None]:
    with _lines_from(path, index, span.start) as (lines, ordinal, line):
        for part, _, inline in iter_text_documents(path, sep, lines):
            if span.done(ordinal):
                return
            if span.wants(ordinal):
                if inline:
                    # Not a separator line, so not a cut: the text stays, as ordinary bytes.
                    detail = f"{inline} kept as text"
                    issues.add(path, line, INLINE_SEPARATOR, detail, record=ordinal)
                yield _txt_document(path, part, line, ordinal, issues)
            line += part.count(b"\n") + 1  # the document's lines and the separator line
            ordinal += 1
    if ordinal == 0 and span.owns_eof(0):
        issues.add(path, None, "empty file")


def _txt_document(
    path: str, part: bytes, line: int, ordinal: int, issues: ReadIssues
) -> Document | None:
    text = _decode_utf8(part, path, line, ordinal, issues)
    stripped = text.strip()
    if not stripped:
        issues.add(path, line, "empty document", record=ordinal)
        return None
    lead = len(text) - len(text.lstrip())
    start_line = line + text.count("\n", 0, lead)
    return Document("", stripped, "", {"file": path, "ordinal": ordinal, "line": start_line})


def _decode_utf8(raw: bytes, path: str, line: int | None, ordinal: int, issues: ReadIssues) -> str:
    """Decode UTF-8, replacing bad bytes with U+FFFD and reporting the line of the first one."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad_line = None if line is None else line + raw.count(b"\n", 0, exc.start)
        issues.add(path, bad_line, "invalid UTF-8", f"byte {exc.start}", record=ordinal)
        return raw.decode("utf-8", errors="replace")


# --- jsonl ----------------------------------------------------------------------------------


def _count_lines(path: str) -> int:
    lines = 0
    last = b"\n"
    with open_binary(path) as handle:
        while block := handle.read(_CHUNK):
            lines += block.count(b"\n")
            last = block[-1:]
    return lines + (last != b"\n")  # a last line without a newline is still a line


def _iter_jsonl(
    path: str,
    text_field: str,
    id_field: str | None,
    issues: ReadIssues,
    span: _Range,
    index: str = "",
) -> Iterator[Document | None]:
    ordinal = -1
    with _lines_from(path, index, span.start) as (handle, first, _):
        for ordinal, raw in enumerate(handle, first):
            if span.done(ordinal):
                return
            if span.wants(ordinal):
                yield _json_document(path, raw, ordinal, text_field, id_field, issues)
    if ordinal < 0 and span.owns_eof(0):
        issues.add(path, None, "empty file")


def _json_document(
    path: str, raw: bytes, ordinal: int, text_field: str, id_field: str | None, issues: ReadIssues
) -> Document | None:
    line = ordinal + 1
    if not raw.strip():
        issues.add(path, line, "blank line", record=ordinal)
        return None
    try:
        record = json.loads(raw)
    except UnicodeDecodeError:
        record = _loads_repaired(path, raw, line, ordinal, issues)
    except (ValueError, RecursionError) as exc:
        issues.add(path, line, "invalid JSON", _json_error(exc, line), record=ordinal)
        return None
    if record is None:
        return None
    if not isinstance(record, dict):
        issues.add(path, line, "not a JSON object", type(record).__name__, record=ordinal)
        return None
    return _make_document(
        path, record.get(text_field, _MISSING), text_field, record, id_field, issues, ordinal, line
    )


_MISSING = object()


def _loads_repaired(path: str, raw: bytes, line: int, ordinal: int, issues: ReadIssues) -> Any:
    """Parse a line with invalid UTF-8 after replacing the bad bytes (None if still broken)."""
    text = _decode_utf8(raw, path, line, ordinal, issues)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        issues.add(path, line, "invalid JSON", _json_error(exc, line), record=ordinal)
        return None


def _json_error(exc: BaseException, line: int) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return json_error_reason(exc, line)
    return "nested too deeply" if isinstance(exc, RecursionError) else str(exc)


def _make_document(
    path: str,
    text: Any,
    text_field: str,
    record: dict[str, Any] | None,
    id_field: str | None,
    issues: ReadIssues,
    ordinal: int,
    line: int | None,
) -> Document | None:
    """A Document from a record's text (and id) value, or None with the reason recorded."""
    if text is _MISSING or text is None:
        issues.add(path, line, "missing text field", repr(text_field), record=ordinal)
        return None
    if not isinstance(text, str):
        detail = f"{text_field!r} is {type(text).__name__}"
        issues.add(path, line, "text field not a string", detail, record=ordinal)
        return None
    if not text.strip():
        issues.add(path, line, "empty document", record=ordinal)
        return None
    doc_id = ""
    if id_field is not None:
        value = record.get(id_field) if record is not None else None
        if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
            issues.add(path, line, "bad id field", f"{id_field!r} = {value!r:.40}", record=ordinal)
            return None
        doc_id = str(value)
    meta: dict[str, Any] = {"file": path, "ordinal": ordinal}
    if line is not None:
        meta["line"] = line
    url = record.get("url") if record is not None else None
    if isinstance(url, str) and url:
        meta["url"] = url  # as WARC records carry theirs, for the URL blocklist
    provenance = record.get("provenance") if record is not None else None
    if isinstance(provenance, dict):
        meta["provenance"] = provenance  # a synthetic document's origin, for the audit trail
    return Document(doc_id, text, "", meta)


# --- parquet --------------------------------------------------------------------------------


def _open_parquet(path: str) -> Any:
    import pyarrow.parquet as pq

    if path.endswith(COMPRESSED_SUFFIXES):
        raise KilnError(f"{path}: Parquet files are compressed internally; decompress this file")
    open_binary(path).close()  # the clear missing-file / directory errors
    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise KilnError(f"{path}: not a readable Parquet file ({exc})") from None


def _iter_parquet(
    path: str, text_field: str, id_field: str | None, issues: ReadIssues, span: _Range
) -> Iterator[Document | None]:
    import pyarrow as pa

    pf = _open_parquet(path)
    total = pf.metadata.num_rows
    stop = total if span.stop is None else min(span.stop, total)
    if total == 0 and span.owns_eof(0):
        issues.add(path, None, "empty file")
    names = pf.schema_arrow.names
    if text_field not in names:
        for ordinal in range(span.start, stop):
            issues.add(
                path, None, "missing text field", f"no column {text_field!r}", record=ordinal
            )
            yield None
        return
    columns = [text_field] + ([id_field] if id_field is not None and id_field in names else [])
    groups, first = _row_groups_for(pf, span.start, stop)
    ordinal = first
    for batch in pf.iter_batches(_PARQUET_BATCH_ROWS, row_groups=groups, columns=columns):
        column = batch.column(0)
        is_binary = pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)
        texts = column.to_pylist()
        ids = batch.column(1).to_pylist() if len(columns) > 1 else None
        for i, text in enumerate(texts):
            if ordinal >= stop:
                return
            if ordinal >= span.start:
                if is_binary and text is not None:
                    text = _decode_utf8(text, path, None, ordinal, issues)
                record = None if id_field is None else {id_field: ids[i] if ids else None}
                yield _make_document(
                    path, text, text_field, record, id_field, issues, ordinal, None
                )
            ordinal += 1


def _row_groups_for(pf: Any, start: int, stop: int) -> tuple[list[int], int]:
    """The row groups holding rows [start, stop), and the ordinal of the first one's first row."""
    groups, first, offset = [], None, 0
    for g in range(pf.metadata.num_row_groups):
        rows = pf.metadata.row_group(g).num_rows
        if offset + rows > start and offset < stop:
            groups.append(g)
            first = offset if first is None else first
        offset += rows
    return groups, first if first is not None else start


# --- html -----------------------------------------------------------------------------------


def _iter_html(path: str, issues: ReadIssues, span: _Range) -> Iterator[Document | None]:
    with open_binary(path) as handle:
        data = handle.read()  # one page: reading it whole is fine
    if not data.strip():
        if span.owns_eof(0):
            issues.add(path, None, "empty file")
        return
    if not span.wants(0):
        return
    text = _decode_html(data, None, path, 1, 0, issues)
    yield Document("", text, "", {"file": path, "ordinal": 0, "line": 1, "content_type": "html"})


def _decode_html(
    data: bytes,
    declared: str | None,
    path: str,
    line: int | None,
    ordinal: int,
    issues: ReadIssues,
) -> str:
    """Decode a page as UTF-8, else in the charset its headers or <meta> declare, else lossily."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        pass
    text = warc.decode_declared(data, declared)
    if text is not None:
        return text
    return _decode_utf8(data, path, line, ordinal, issues)


# --- warc -----------------------------------------------------------------------------------


def _iter_warc(path: str, issues: ReadIssues, span: _Range) -> Iterator[Document | None]:
    with open_binary(path) as handle:
        for ordinal, headers, block in _scan_warc(handle, path, issues, span, read_blocks=True):
            if span.done(ordinal):
                return
            if span.wants(ordinal):
                yield _warc_document(path, ordinal, headers, block, issues)


def _scan_warc(
    handle: IO[bytes], path: str, issues: ReadIssues, span: _Range, *, read_blocks: bool
) -> Iterator[tuple[int, dict[str, str], bytes | None]]:
    """Yield (ordinal, WARC headers, block) for each response/conversion record, in file order.

    The block is read only for records in `span` when `read_blocks`; otherwise it is skipped
    (None). A truncated record yields block None too. Damage between records is reported once
    per run of garbage, by the range that owns the next ordinal, and reading resumes at the
    next `WARC/` version line.
    """
    ordinal = 0
    offset = 0  # decompressed byte offset, for messages
    seen_any = False
    pending: list[tuple[int, str]] = []  # damage after our range: ours only if nothing follows

    def stray(detail: str) -> None:
        if span.wants(ordinal):
            issues.add(path, None, "malformed WARC record", detail, record=ordinal)
        else:
            pending.append((ordinal, detail))

    while line := handle.readline(warc.MAX_LINE):
        offset += len(line)
        if not line.strip():
            continue
        if not line.startswith(b"WARC/"):
            stray(f"no WARC version line at byte {offset - len(line)}")
            line, skipped = warc.resync(handle)
            offset += skipped
            if not line:
                break
        seen_any = True
        headers, size = warc.read_headers(handle)
        offset += size
        length = warc.content_length(headers)
        if length is None:
            stray(f"no valid Content-Length in the record before byte {offset}")
            continue
        is_record = headers.get("warc-type", "").lower() in ("response", "conversion")
        if is_record and span.done(ordinal):
            yield ordinal, headers, None  # lets the caller stop without reading further
            return
        want = is_record and read_blocks and span.wants(ordinal)
        block, got = warc.read_block(handle, length, keep=want)
        offset += got
        if is_record:
            yield ordinal, headers, block if got == length else None
            ordinal += 1
        if got < length:
            if not is_record:
                stray(f"truncated {headers.get('warc-type', 'untyped')} record at the end")
            break
    for at, detail in pending:
        if at == ordinal and span.owns_eof(ordinal):
            issues.add(path, None, "malformed WARC record", detail, record=ordinal)
    if not seen_any and span.owns_eof(0):
        issues.add(path, None, "empty file")


def _warc_document(
    path: str, ordinal: int, headers: dict[str, str], block: bytes | None, issues: ReadIssues
) -> Document | None:
    if block is None:
        issues.add(path, None, "truncated WARC record", record=ordinal)
        return None
    meta: dict[str, Any] = {
        "file": path,
        "ordinal": ordinal,
        "url": headers.get("warc-target-uri", ""),
        "warc_record_id": headers.get("warc-record-id", ""),
    }
    if headers.get("warc-type", "").lower() == "conversion":  # WET: already plain text
        text = _decode_utf8(block, path, None, ordinal, issues)
        meta["content_type"] = "text"
    else:
        body, content_type = warc.split_http(block)
        if body is None:
            issues.add(path, None, "malformed HTTP response", record=ordinal)
            return None
        mime = content_type.split(";", 1)[0].strip().lower()
        if mime and mime not in warc.HTML_TYPES:
            issues.add(path, None, "non-HTML response", mime, record=ordinal)
            return None
        charset = warc.header_charset(content_type)
        text = _decode_html(body, charset, path, None, ordinal, issues)
        meta["content_type"] = "html"
    if not text.strip():
        issues.add(path, None, "empty document", record=ordinal)
        return None
    return Document("", text, "", meta)
