"""Readers: every format round-trips, ordinals/lines are right, and bad input is reported."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.data.pipeline.read.readers import (
    ReadIssues,
    count_records,
    detect_format,
    iter_records,
)
from kiln.errors import KilnError


def read(path: Path, fmt: str, **kwargs) -> tuple[list, ReadIssues]:
    issues = ReadIssues()
    items = list(iter_records(str(path), fmt, issues=issues, **kwargs))
    return items, issues


def texts(items: list) -> list[str | None]:
    return [None if d is None else d.text for d in items]


def warc_record(warc_type: str, block: bytes, **headers: str) -> bytes:
    lines = [b"WARC/1.0", f"WARC-Type: {warc_type}".encode()]
    lines += [f"{k.replace('_', '-')}: {v}".encode() for k, v in headers.items()]
    lines.append(f"Content-Length: {len(block)}".encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + block + b"\r\n\r\n"


def http_response(body: bytes, content_type: str = "text/html; charset=utf-8") -> bytes:
    head = f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nServer: test\r\n\r\n"
    return head.encode() + body


PAGE_A = b"<html><body><p>First page, caf\xc3\xa9.</p></body></html>"
PAGE_B = b"<html><body><p>Second page.</p></body></html>"


def write_warc(path: Path, records: list[bytes]) -> Path:
    # Like Common Crawl: one gzip member per record, concatenated.
    path.write_bytes(b"".join(gzip.compress(r) for r in records))
    return path


def standard_warc(tmp_path: Path) -> Path:
    return write_warc(
        tmp_path / "crawl.warc.gz",
        [
            warc_record("warcinfo", b"software: test\r\n", WARC_Record_ID="<urn:uuid:0>"),
            warc_record(
                "request",
                b"GET / HTTP/1.1\r\nHost: a.example\r\n\r\n",
                WARC_Target_URI="http://a.example/",
            ),
            warc_record(
                "response",
                http_response(PAGE_A),
                WARC_Target_URI="http://a.example/",
                WARC_Record_ID="<urn:uuid:1>",
            ),
            warc_record(
                "response",
                http_response(PAGE_B),
                WARC_Target_URI="http://b.example/x",
                WARC_Record_ID="<urn:uuid:2>",
            ),
        ],
    )


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("a.txt", "txt"),
        ("a.txt.gz", "txt"),
        ("dir/a.jsonl.zst", "jsonl"),
        ("a.JSONL.bz2", "jsonl"),
        ("a.parquet", "parquet"),
        ("page.htm", "html"),
        ("page.html.gz", "html"),
        ("CC-MAIN-0001.warc.gz", "warc"),
    ],
)
def test_detect_format(name: str, fmt: str) -> None:
    assert detect_format(name) == fmt


def test_detect_format_unknown_extension_is_clear_error() -> None:
    with pytest.raises(KilnError, match=r"data\.csv.*'\.csv'"):
        detect_format("data.csv")


def test_txt_custom_separator_ordinals_and_lines(tmp_path: Path) -> None:
    path = tmp_path / "docs.txt"
    path.write_text("doc one\n@@@\n\n  doc two\nline two\n@@@\n \n@@@\nlast\n", encoding="utf-8")
    items, issues = read(path, "txt", separator="@@@")
    assert texts(items) == ["doc one", "doc two\nline two", None, "last"]
    assert [d.meta["line"] for d in items if d] == [1, 4, 9]
    assert [d.meta["ordinal"] for d in items if d] == [0, 1, 3]
    assert all(d.id == "" and d.source == "" and d.meta["file"] == str(path) for d in items if d)
    assert issues.counts == {"empty document": 1}
    assert issues.examples[0]["line"] == 7 and issues.examples[0]["record"] == 2
    assert count_records(str(path), "txt", separator="@@@") == 4


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_jsonl_compressed_round_trip_with_ids(tmp_path: Path, suffix: str) -> None:
    rows = [{"id": "a", "text": "Hello\nworld"}, {"id": 7, "text": "Ünïcödé ✓"}]
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    path = tmp_path / f"docs.jsonl{suffix}"
    compress = gzip.compress if suffix == ".gz" else zstandard.ZstdCompressor().compress
    path.write_bytes(compress(data))
    items, issues = read(path, "jsonl", id_field="id")
    assert texts(items) == ["Hello\nworld", "Ünïcödé ✓"]
    assert [d.id for d in items] == ["a", "7"]
    assert [d.meta["line"] for d in items] == [1, 2]
    assert issues.total == 0
    assert count_records(str(path), "jsonl") == 2


def test_jsonl_malformed_lines_reported_and_skipped(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        b'{"text": "good one"}\n'
        b'{"text": "broken\n'
        b'{"body": "no text field"}\n'
        b'{"text": 42}\n'
        b"[1, 2]\n"
        b"\n"
        b'{"text": "bad \xff byte"}\n'
        b'{"text": "   "}\n'
        b'{"text": "last, no newline"}'
    )
    items, issues = read(path, "jsonl")
    assert texts(items) == [
        "good one",
        None,
        None,
        None,
        None,
        None,
        "bad \ufffd byte",
        None,
        "last, no newline",
    ]
    assert issues.counts == {
        "invalid JSON": 1,
        "missing text field": 1,
        "text field not a string": 1,
        "not a JSON object": 1,
        "blank line": 1,
        "invalid UTF-8": 1,
        "empty document": 1,
    }
    lines = {e["kind"]: e["line"] for e in issues.examples}
    assert lines["invalid JSON"] == 2
    assert lines["missing text field"] == 3
    assert lines["text field not a string"] == 4
    assert lines["invalid UTF-8"] == 7
    assert all(e["file"] == str(path) for e in issues.examples)
    assert count_records(str(path), "jsonl") == len(items) == 9


def test_txt_invalid_utf8_reported_with_line_and_replaced(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt.gz"
    path.write_bytes(
        gzip.compress(b"ok doc\n<|endoftext|>\nline a\nline \xc3\x28 b\n<|endoftext|>\n")
    )
    items, issues = read(path, "txt")
    assert texts(items) == ["ok doc", "line a\nline \ufffd( b"]
    assert issues.counts == {"invalid UTF-8": 1}
    assert issues.examples[0]["line"] == 4 and issues.examples[0]["record"] == 1


@pytest.mark.parametrize(
    ("name", "fmt"),
    [("e.txt", "txt"), ("e.jsonl.gz", "jsonl"), ("e.html", "html"), ("e.warc.gz", "warc")],
)
def test_empty_files_are_reported_not_fatal(tmp_path: Path, name: str, fmt: str) -> None:
    path = tmp_path / name
    path.write_bytes(gzip.compress(b"") if name.endswith(".gz") else b"")
    items, issues = read(path, fmt)
    assert items == []
    assert issues.counts == {"empty file": 1}
    assert count_records(str(path), fmt) == 0


def test_missing_file_is_clear_error(tmp_path: Path) -> None:
    with pytest.raises(KilnError, match="no such file"):
        read(tmp_path / "nope.jsonl", "jsonl")


def test_parquet_round_trip_in_batches_and_ranges(tmp_path: Path) -> None:
    docs = [f"document number {i}" for i in range(10)]
    table = pa.table({"id": [f"p{i}" for i in range(10)], "content": docs})
    path = tmp_path / "docs.parquet"
    pq.write_table(table, path, row_group_size=3)
    items, issues = read(path, "parquet", text_field="content", id_field="id")
    assert texts(items) == docs
    assert [d.id for d in items] == [f"p{i}" for i in range(10)]
    assert [d.meta["ordinal"] for d in items] == list(range(10))
    assert issues.total == 0
    assert count_records(str(path), "parquet") == 10
    middle, _ = read(path, "parquet", text_field="content", start=4, stop=8)
    assert [d.meta["ordinal"] for d in middle] == [4, 5, 6, 7]


def test_parquet_missing_column_and_nulls(tmp_path: Path) -> None:
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["a doc", None, "another"]}), path)
    items, issues = read(path, "parquet")
    assert texts(items) == ["a doc", None, "another"]
    assert issues.counts == {"missing text field": 1}
    items, issues = read(path, "parquet", text_field="body")
    assert items == [None, None, None]
    assert issues.counts == {"missing text field": 3}
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty)
    assert read(empty, "parquet")[1].counts == {"empty file": 1}
    assert count_records(str(empty), "parquet") == 0


def test_html_file_is_one_document_and_declared_charset_is_used(tmp_path: Path) -> None:
    page = '<html><head><meta charset="windows-1252"></head><body>Caf\xe9 “x”</body></html>'
    path = tmp_path / "page.html"
    path.write_bytes(page.encode("cp1252"))
    items, issues = read(path, "html")
    assert len(items) == 1
    assert items[0].text == page
    assert items[0].meta == {"file": str(path), "ordinal": 0, "line": 1, "content_type": "html"}
    assert issues.total == 0
    assert count_records(str(path), "html") == 1


def test_warc_responses_become_html_documents(tmp_path: Path) -> None:
    path = standard_warc(tmp_path)
    items, issues = read(path, "warc")
    assert texts(items) == [PAGE_A.decode(), PAGE_B.decode()]  # HTTP headers stripped
    assert [d.meta["url"] for d in items] == ["http://a.example/", "http://b.example/x"]
    assert [d.meta["warc_record_id"] for d in items] == ["<urn:uuid:1>", "<urn:uuid:2>"]
    assert all(d.meta["content_type"] == "html" for d in items)
    assert issues.total == 0
    assert count_records(str(path), "warc") == 2


def test_warc_non_html_truncated_and_garbage_are_reported(tmp_path: Path) -> None:
    good = warc_record("response", http_response(PAGE_A), WARC_Target_URI="http://a/")
    image = warc_record("response", http_response(b"\x89PNG", "image/png"))
    truncated = warc_record("response", http_response(PAGE_B))[:-60]
    path = tmp_path / "damaged.warc"
    path.write_bytes(image + b"garbage line\r\nmore\r\n" + good + truncated)
    items, issues = read(path, "warc")
    assert texts(items) == [None, PAGE_A.decode(), None]
    assert issues.counts == {
        "non-HTML response": 1,
        "malformed WARC record": 1,
        "truncated WARC record": 1,
    }
    assert count_records(str(path), "warc") == 3


def make_all_formats(tmp_path: Path) -> list[tuple[Path, str, dict]]:
    txt = tmp_path / "r.txt"
    txt.write_bytes(
        b"a\n<|endoftext|>\n\n<|endoftext|>\nb \xff\n<|endoftext|>\nc\nd\n<|endoftext|>\n"
    )
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_bytes(b'{"text": "x"}\nnot json\n{"text": 1}\n\n{"text": "y"}\n')
    parquet = tmp_path / "r.parquet"
    pq.write_table(pa.table({"text": ["p", None, "q", "r", None]}), parquet, row_group_size=2)
    image = warc_record("response", http_response(b"x", "image/png"))
    warc = write_warc(
        tmp_path / "r.warc.gz",
        [warc_record("response", http_response(PAGE_A)), image, warc_record("response", b"?")],
    )
    warc.write_bytes(warc.read_bytes() + gzip.compress(b"trailing junk\r\n"))
    return [(txt, "txt", {}), (jsonl, "jsonl", {}), (parquet, "parquet", {}), (warc, "warc", {})]


def test_ordinal_ranges_partition_records_and_issues(tmp_path: Path) -> None:
    for path, fmt, kwargs in make_all_formats(tmp_path):
        full, full_issues = read(path, fmt, **kwargs)
        n = count_records(str(path), fmt)
        assert n == len(full), fmt
        assert full_issues.total > 0, fmt
        for cuts in ([0, n], [0, 1, n], [0, 2, 3, n], [0, n - 1, n]):
            merged = ReadIssues()
            pieces: list = []
            for start, stop in itertools.pairwise(cuts):
                part, part_issues = read(path, fmt, start=start, stop=stop, **kwargs)
                pieces += part
                merged.merge(part_issues)
            assert texts(pieces) == texts(full), (fmt, cuts)
            assert merged.counts == full_issues.counts, (fmt, cuts)


def test_read_issues_merge_and_json_round_trip() -> None:
    a, b = ReadIssues(max_examples=3), ReadIssues()
    for i in range(2):
        a.add("f.txt", i + 1, "invalid UTF-8")
    for i in range(5):
        b.add("g.jsonl", i + 1, "invalid JSON", "Expecting value at column 1", record=i)
    a.merge(b)
    assert a.counts == {"invalid UTF-8": 2, "invalid JSON": 5}
    assert len(a.examples) == 3
    data = a.to_json()
    assert data["total"] == 7
    assert json.loads(json.dumps(data)) == data
    again = ReadIssues.from_json(data)
    assert again.counts == a.counts and again.examples == a.examples
    line = ReadIssues.format_example(data["examples"][2])
    assert line == "g.jsonl:1: invalid JSON (Expecting value at column 1)"


doc_text = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40
)


@settings(max_examples=40, deadline=None)
@given(docs=st.lists(doc_text, max_size=8))
def test_txt_count_matches_records_and_texts_round_trip(tmp_path_factory, docs) -> None:
    path = tmp_path_factory.mktemp("hyp") / "d.txt"
    sep = "<|endoftext|>"
    docs = [d.replace(sep, "") for d in docs]
    path.write_text("".join(f"{d}\n{sep}\n" for d in docs), encoding="utf-8")
    items, _ = read(path, "txt")
    assert count_records(str(path), "txt") == len(items)
    # Trailing empty documents after the last separator are not records; the rest keep theirs.
    expected = [d.strip() or None for d in docs]
    assert texts(items) == expected[: len(items)]
    assert all(e is None for e in expected[len(items) :])


@settings(max_examples=40, deadline=None)
@given(docs=st.lists(st.one_of(doc_text, st.integers()), max_size=8))
def test_jsonl_count_matches_records(tmp_path_factory, docs) -> None:
    path = tmp_path_factory.mktemp("hyp") / "d.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    items, issues = read(path, "jsonl")
    assert count_records(str(path), "jsonl") == len(items) == len(docs)
    expected = [d if isinstance(d, str) and d.strip() else None for d in docs]
    assert texts(items) == expected
    assert issues.total == sum(e is None for e in expected) + (not docs)  # + "empty file"


def test_wet_conversion_records_are_plain_text(tmp_path: Path) -> None:
    path = tmp_path / "crawl.warc.wet.gz"
    write_warc(
        path,
        [
            warc_record("warcinfo", b"software: test\r\n"),
            warc_record("conversion", "Plain text, naïve.\n".encode(), WARC_Target_URI="http://c/"),
        ],
    )
    assert detect_format(path) == "warc"
    items, issues = read(path, "warc")
    assert texts(items) == ["Plain text, naïve.\n"]
    assert items[0].meta["content_type"] == "text" and items[0].meta["url"] == "http://c/"
    assert issues.total == 0
