"""`kiln tokenizer inspect` views: token pieces, terminal colours, HTML, ratios, longest tokens."""

from __future__ import annotations

import itertools
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kiln.tokenizer import Tokenizer
from kiln.tokenizer.formats import read_gpt2
from kiln.tokenizer.inspect import (
    escape_bytes,
    format_longest,
    format_summary,
    inspect_text,
    longest_tokens,
    render_html,
    render_terminal,
    visible_text,
    write_html,
)

EOT = "<|endoftext|>"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def gpt2(shared_data: Path) -> Tokenizer:
    return read_gpt2(shared_data / "gpt2" / "vocab.json", shared_data / "gpt2" / "merges.txt")


def test_pieces_cover_the_text(gpt2) -> None:
    text = f"Hello  world\n\tdéjà 日本 👍{EOT}end"
    result = inspect_text(gpt2, "sample", text)
    assert [p.id for p in result.pieces] == gpt2.encode(text, allowed_special="all")
    assert b"".join(p.data for p in result.pieces) == text.encode("utf-8")
    assert [p.special for p in result.pieces].count(True) == 1
    assert result.n_bytes == len(text.encode("utf-8"))
    assert result.bytes_per_token == result.n_bytes / result.n_tokens


def test_empty_text_has_zero_ratio(gpt2) -> None:
    result = inspect_text(gpt2, "empty", "")
    assert (result.n_tokens, result.n_bytes, result.bytes_per_token) == (0, 0, 0.0)


def test_visible_and_escaped_text() -> None:
    assert visible_text(b" a\tb\r\n") == "·a→b␍↵\n"
    assert visible_text(b"\xe6\x97") == "\\xe6\\x97"
    assert visible_text("x\u200dy\x00".encode()) == "x\\u200dy\\x00"
    assert escape_bytes(b" the") == "' the'"
    assert escape_bytes(b"\n\n") == "'\\n\\n'"
    assert escape_bytes(b"it's \\") == "'it\\'s \\\\'"
    assert escape_bytes("日\xe6".encode() + b"\xe6") == "'日æ\\xe6'"


def test_terminal_view_alternates_colours_and_keeps_lines(gpt2) -> None:
    text = "one two three\nfour  five"
    pieces = inspect_text(gpt2, "t", text).pieces
    coloured = render_terminal(pieces, color=True)
    # A token holding a newline closes its colour before the break and reopens it after.
    one_open_per_token = re.sub(r"\x1b\[0m\n\x1b\[[0-9;]*m", "\n", coloured)
    styles = re.findall(r"\x1b\[30;48;5;(\d+)m", one_open_per_token)
    assert len(styles) == len(pieces) and len(set(styles)) > 2
    assert all(a != b for a, b in itertools.pairwise(styles))
    plain = ANSI.sub("", coloured)
    assert plain == "one·two·three↵\nfour··five"
    # No colour is left open across a line break.
    assert all(line.endswith("\x1b[0m") for line in coloured.split("\n"))
    assert render_terminal(pieces, color=False) == "one│·two│·three│↵\n│four│·│·five"


def test_terminal_view_marks_specials(gpt2) -> None:
    pieces = inspect_text(gpt2, "t", f"a{EOT}").pieces
    assert "\x1b[1;97;45m<|endoftext|>\x1b[0m" in render_terminal(pieces)


def test_summary_and_longest(gpt2) -> None:
    results = [inspect_text(gpt2, "short", "hello"), inspect_text(gpt2, "x.txt", "a b c d")]
    table = format_summary(results).splitlines()
    assert table[0].split() == ["input", "bytes", "tokens", "bytes/token"]
    assert table[1].split() == ["short", "5", "1", "5.000"]
    assert table[2].split() == ["x.txt", "7", "4", "1.750"]
    longest = longest_tokens(gpt2, 3)
    assert [len(b) for _, b in longest] == [128, 66, 65]
    assert all(i != gpt2.special_tokens[EOT] for i, _ in longest_tokens(gpt2, 50000))
    lines = format_longest(longest).splitlines()
    assert len(lines) == 4 and lines[2].split()[:2] == ["38093", "66"]
    assert lines[2].endswith("' ================================================================='")


class _SpanCollector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.spans: list[dict[str, str | None]] = []
        self.external = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "span":
            self.spans.append(dict(attrs))
        if tag in ("script", "link", "img") or any(v and "://" in v for _, v in attrs):
            self.external = True


def test_html_view_is_self_contained(gpt2, tmp_path) -> None:
    text = f"<b>bold</b> & 'quotes' {EOT}\nnext"
    result = inspect_text(gpt2, "input <1>", text)
    page = render_html([result], longest_tokens(gpt2, 5))
    parser = _SpanCollector()
    parser.feed(page)
    assert not parser.external
    assert len(parser.spans) == result.n_tokens
    assert parser.spans[0]["title"] == f"id {result.pieces[0].id}\nbytes '<'"
    assert sum(1 for s in parser.spans if s.get("class") == "special") == 1
    assert "<b>" not in page and "&lt;" in page
    assert "input &lt;1&gt;" in page and "Longest tokens" in page
    truncated = render_html([result], [], max_tokens=3)
    assert "(first 3 shown)" in truncated
    path = tmp_path / "view.html"
    write_html(path, page)
    assert path.read_text(encoding="utf-8") == page
