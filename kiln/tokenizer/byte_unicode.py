"""GPT-2's reversible byte <-> printable-unicode table, used by `vocab.json`, `merges.txt` and HF.

GPT-2 stores byte-level tokens as strings: every byte value gets one visible character, so token
files stay printable and whitespace-free (a space becomes "Ġ", a newline "Ċ"). Bytes that are
already printable Latin-1 characters map to themselves; the other 68 (control characters, space,
and a few Latin-1 gaps) map in byte order to the code points from 256 upwards.
"""

from __future__ import annotations

from functools import cache

from kiln.errors import KilnError


def _printable_bytes() -> list[int]:
    """Byte values whose Latin-1 character is visible and not whitespace."""
    ranges = [(ord("!"), ord("~")), (ord("¡"), ord("¬")), (ord("®"), ord("ÿ"))]
    return [b for lo, hi in ranges for b in range(lo, hi + 1)]


@cache
def byte_to_unicode() -> dict[int, str]:
    """The table from each byte value 0..255 to its one-character GPT-2 representation."""
    table = {b: chr(b) for b in _printable_bytes()}
    next_code_point = 256
    for b in range(256):
        if b not in table:
            table[b] = chr(next_code_point)
            next_code_point += 1
    return table


@cache
def unicode_to_byte() -> dict[str, int]:
    """The inverse table: a GPT-2 character back to its byte value."""
    return {ch: b for b, ch in byte_to_unicode().items()}


def bytes_to_token_string(data: bytes) -> str:
    """A token's bytes as GPT-2's printable string (`b" the"` -> `"Ġthe"`)."""
    table = byte_to_unicode()
    return "".join(table[b] for b in data)


@cache
def _decode_table() -> dict[int, int]:
    """str.translate table to Latin-1: table characters to their byte, other Latin-1 to U+FFFF."""
    table = {ord(ch): b for b, ch in byte_to_unicode().items()}
    # Characters below 256 that are not in the table must not pass through as themselves.
    table.update({c: 0xFFFF for c in range(256) if c not in table})
    return table


def token_string_to_bytes(text: str) -> bytes:
    """A GPT-2 token string back to bytes; a character outside the table raises KilnError."""
    try:
        return text.translate(_decode_table()).encode("latin-1")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise KilnError(
            f"{text!r} is not a byte-level token string: character {bad!r} "
            "is not in GPT-2's byte-to-unicode table"
        ) from None
