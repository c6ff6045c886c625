"""The byte-offset index of compressed inputs: a task that starts at its checkpoint reads
exactly the records, ordinals, lines and issues of reading the file from its start."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kiln.data.pipeline.read import offsets
from kiln.data.pipeline.read.readers import ReadIssues, count_records, iter_records
from kiln.tokenizer.special import EOT
from tests.data.pipeline.conftest import write_stories_pipeline


def _txt(root: Path) -> Path:
    docs = [f"document {i}\nwith two lines" for i in range(20)]
    docs[4] = "   "  # empty: keeps its ordinal, reported
    docs[7] = f"an inline {EOT} is text"
    path = root / "docs.txt.gz"
    body = "".join(f"{d}\n{EOT}\n" for d in docs).encode() + b"tail \xff bytes\n"
    path.write_bytes(gzip.compress(body))
    return path


def _jsonl(root: Path) -> Path:
    lines = [json.dumps({"text": f"record {i}"}) for i in range(20)]
    lines[5] = '{"text": "broken'
    lines[9] = json.dumps({"body": "no text"})
    path = root / "docs.jsonl.gz"
    path.write_bytes(gzip.compress(("\n".join(lines)).encode()))  # no final newline
    return path


def _read(path: Path, fmt: str, start: int, stop: int, index: str) -> tuple[list, dict]:
    issues = ReadIssues()
    docs = [
        None if d is None else (d.text, d.meta)
        for d in iter_records(str(path), fmt, issues=issues, start=start, stop=stop, index=index)
    ]
    return docs, issues.to_json()


@pytest.mark.parametrize("fmt", ["txt", "jsonl"])
def test_ranges_read_from_the_index_equal_reading_from_the_start(tmp_path: Path, fmt: str) -> None:
    path = _txt(tmp_path) if fmt == "txt" else _jsonl(tmp_path)
    out = str(tmp_path / "index")
    n = offsets.build_index(str(path), fmt, EOT.encode(), 3, out)
    assert n == count_records(str(path), fmt)
    index = offsets.load_index(out)
    assert [f["ordinal"] for f in index["frames"]] == list(range(0, n, 3))
    for start in range(0, n, 3):
        assert _read(path, fmt, start, start + 3, out) == _read(path, fmt, start, start + 3, "")
    # The copy holds the file's bytes unchanged.
    with offsets.open_at(out, 0) as (stream, first, line):
        assert (first, line) == (0, 1)
        assert stream.read() == gzip.decompress(path.read_bytes())


def test_an_empty_file_indexes_to_nothing(tmp_path: Path) -> None:
    path = tmp_path / "empty.txt.gz"
    path.write_bytes(gzip.compress(b""))
    out = str(tmp_path / "index")
    assert offsets.build_index(str(path), "txt", EOT.encode(), 3, out) == 0
    assert _read(path, "txt", 0, 0, out) == _read(path, "txt", 0, 0, "")


def test_pipeline_output_is_the_same_with_and_without_the_index(
    shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kiln.data.pipeline.config import load_pipeline_config
    from kiln.data.pipeline.runner import RunOptions, run_pipeline

    config = write_stories_pipeline(shared_data, tmp_path)
    plain = tmp_path / "stories.txt"
    (tmp_path / "stories.txt.gz").write_bytes(gzip.compress(plain.read_bytes()))
    plain.unlink()
    text = config.read_text().replace('"stories.txt"', '"stories.txt.gz"')
    config.write_text(text.replace("docs_per_task = 2", "docs_per_task = 25"))
    cfg = load_pipeline_config(config)
    seen: list[str] = []
    real = offsets.open_at

    def counting(out: str, start: int):
        seen.append(out)
        return real(out, start)

    monkeypatch.setattr(offsets, "open_at", counting)
    run_pipeline(cfg, RunOptions(out=str(tmp_path / "indexed"), progress=False))
    assert len(seen) > 5  # every task started at its checkpoint
    monkeypatch.setattr(offsets, "wants_index", lambda path, fmt: False)
    run_pipeline(cfg, RunOptions(out=str(tmp_path / "plain"), progress=False))
    for path in sorted((tmp_path / "plain").rglob("*")):
        if path.is_file() and path.name != "manifest.json":
            other = tmp_path / "indexed" / path.relative_to(tmp_path / "plain")
            assert other.read_bytes() == path.read_bytes(), path.name
