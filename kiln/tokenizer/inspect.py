"""`kiln tokenizer inspect`: how a text splits into tokens, its compression and the longest tokens.

Everything here returns strings or data, so the views are testable; the CLI prints or writes them.
"""

from __future__ import annotations

import html
import os
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

from kiln.io import atomic_write
from kiln.tokenizer.tokenizer import Tokenizer

# Pastel 256-colour backgrounds under black text: neighbours differ, every one stays readable.
_BACKGROUNDS = (153, 223, 194, 218, 230, 189)
_HTML_BACKGROUNDS = ("#c6e2ff", "#ffe0b3", "#c8f0c8", "#ffc9de", "#fff4b3", "#ddd0ff")
_SPECIAL_STYLE = "\x1b[1;97;45m"
_RESET = "\x1b[0m"
_VISIBLE_WHITESPACE = {" ": "·", "\t": "→", "\n": "↵", "\r": "␍"}
_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\", "'": "\\'"}


@dataclass(frozen=True)
class TokenPiece:
    """One token of an encoded text: its id, its bytes and whether it is a special token."""

    id: int
    data: bytes
    special: bool


@dataclass(frozen=True)
class Inspection:
    """One input's tokens and size: the numbers the summary and both views show."""

    name: str
    pieces: list[TokenPiece]
    n_bytes: int

    @property
    def n_tokens(self) -> int:
        """How many tokens the input became."""
        return len(self.pieces)

    @property
    def bytes_per_token(self) -> float:
        """Compression ratio: UTF-8 bytes per token (0 for an empty input)."""
        return self.n_bytes / self.n_tokens if self.n_tokens else 0.0


def inspect_text(tok: Tokenizer, name: str, text: str) -> Inspection:
    """Encode `text` (special-token text counts as the special token) and keep each token."""
    special_ids = set(tok.special_tokens.values())
    ids = tok.encode(text, allowed_special="all")
    pieces = [TokenPiece(i, tok.vocab[i], i in special_ids) for i in ids]
    return Inspection(name, pieces, len(tok.decode_bytes(ids)))


def _chars(data: bytes) -> list[tuple[str, bool]]:
    """(text, is_raw_byte) runs: valid UTF-8 as characters, a stray byte as `\\xNN`."""
    out = []
    for ch in data.decode("utf-8", errors="surrogateescape"):
        if "\udc80" <= ch <= "\udcff":
            out.append((f"\\x{ord(ch) - 0xDC00:02x}", True))
        else:
            out.append((ch, False))
    return out


def _control_escape(ch: str) -> str:
    """Control and format characters (NUL, ZWJ, ...) would be invisible; show their code point."""
    if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
        return f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"
    return ch


def escape_bytes(data: bytes) -> str:
    """A token's bytes as a quoted, escaped string: `' the'`, `'\\n\\n'`, `'\\xe4\\xb8'`."""
    parts = []
    for text, raw in _chars(data):
        parts.append(text if raw else _ESCAPES.get(text) or _control_escape(text))
    return "'" + "".join(parts) + "'"


def visible_text(data: bytes) -> str:
    """A token's text for display: whitespace as visible marks (· → ↵ ␍), stray bytes escaped."""
    parts = []
    for text, raw in _chars(data):
        if raw:
            parts.append(text)
        elif text in _VISIBLE_WHITESPACE:
            # Keep the line break itself after its mark so the layout still follows the text.
            parts.append(_VISIBLE_WHITESPACE[text] + ("\n" if text == "\n" else ""))
        else:
            parts.append(_control_escape(text))
    return "".join(parts)


def render_terminal(pieces: Sequence[TokenPiece], color: bool = True) -> str:
    """Tokens with alternating ANSI backgrounds (or `│` between them when `color` is off)."""
    if not color:
        return "│".join(visible_text(p.data) for p in pieces)
    out = []
    for k, piece in enumerate(pieces):
        style = _SPECIAL_STYLE if piece.special else f"\x1b[30;48;5;{_BACKGROUNDS[k % 6]}m"
        # A colour left open across a line break paints the rest of the terminal line.
        lines = visible_text(piece.data).split("\n")
        out.append(f"{_RESET}\n".join(f"{style}{line}" for line in lines) + _RESET)
    return "".join(out)


def format_summary(inspections: Sequence[Inspection]) -> str:
    """A table of bytes, tokens and bytes per token for each input."""
    width = max([len("input"), *(len(i.name) for i in inspections)])
    lines = [f"{'input':<{width}}  {'bytes':>12}  {'tokens':>12}  {'bytes/token':>11}"]
    for i in inspections:
        lines.append(
            f"{i.name:<{width}}  {i.n_bytes:>12,}  {i.n_tokens:>12,}  {i.bytes_per_token:>11.3f}"
        )
    return "\n".join(lines)


def longest_tokens(tok: Tokenizer, n: int) -> list[tuple[int, bytes]]:
    """The `n` longest regular tokens (by bytes), ties by id."""
    special_ids = set(tok.special_tokens.values())
    regular = [(i, b) for i, b in tok.vocab.items() if i not in special_ids]
    return sorted(regular, key=lambda item: (-len(item[1]), item[0]))[:n]


def format_longest(longest: Sequence[tuple[int, bytes]]) -> str:
    """One line per token: id, length in bytes and the escaped bytes."""
    lines = [f"{'id':>8}  {'bytes':>5}  token"]
    lines += [f"{i:>8}  {len(b):>5}  {escape_bytes(b)}" for i, b in longest]
    return "\n".join(lines)


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
pre.tokens { white-space: pre-wrap; font-family: ui-monospace, monospace; line-height: 1.7; }
pre.tokens span { border-radius: 3px; padding: 1px 0; }
span.special { background: #8e3fa8; color: #fff; font-weight: bold; }
table { border-collapse: collapse; font-family: ui-monospace, monospace; }
td, th { padding: 2px 10px; text-align: right; border-bottom: 1px solid #ddd; }
td.token { text-align: left; }
"""


def _html_tokens(pieces: Sequence[TokenPiece]) -> str:
    spans = []
    for k, piece in enumerate(pieces):
        tooltip = html.escape(f"id {piece.id}\nbytes {escape_bytes(piece.data)}", quote=True)
        style = "" if piece.special else f' style="background:{_HTML_BACKGROUNDS[k % 6]}"'
        css_class = ' class="special"' if piece.special else ""
        text = html.escape(visible_text(piece.data), quote=False)
        spans.append(f'<span{css_class}{style} title="{tooltip}">{text}</span>')
    return "".join(spans)


def _html_table(header: Sequence[str], rows: Sequence[Sequence[str]], token_col: int = -1) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = [
            f"<td{' class=token' if c == token_col else ''}>{html.escape(v)}</td>"
            for c, v in enumerate(row)
        ]
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def render_html(
    inspections: Sequence[Inspection],
    longest: Sequence[tuple[int, bytes]],
    title: str = "kiln tokenizer inspect",
    max_tokens: int | None = None,
) -> str:
    """A self-contained HTML page: each input's tokens as coloured spans (id and bytes on hover)."""
    sections = []
    for i in inspections:
        shown = i.pieces if max_tokens is None else i.pieces[:max_tokens]
        note = f" (first {len(shown):,} shown)" if len(shown) < i.n_tokens else ""
        sections.append(
            f"<h2>{html.escape(i.name)}</h2>"
            f"<p>{i.n_bytes:,} bytes, {i.n_tokens:,} tokens{note}, "
            f"{i.bytes_per_token:.3f} bytes/token</p>"
            f'<pre class="tokens">{_html_tokens(shown)}</pre>'
        )
    summary = _html_table(
        ["input", "bytes", "tokens", "bytes/token"],
        [
            [i.name, f"{i.n_bytes:,}", f"{i.n_tokens:,}", f"{i.bytes_per_token:.3f}"]
            for i in inspections
        ],
    )
    longest_table = _html_table(
        ["id", "bytes", "token"], [[str(i), str(len(b)), escape_bytes(b)] for i, b in longest], 2
    )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body>"
        f"<h1>{html.escape(title)}</h1>{summary}{''.join(sections)}"
        f"<h2>Longest tokens</h2>{longest_table}</body></html>\n"
    )


def write_html(path: str | os.PathLike[str], page: str) -> None:
    """Write the HTML view atomically."""
    with atomic_write(path, "w") as handle:
        handle.write(page)
