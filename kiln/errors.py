"""The one exception type the CLI turns into a single clear line (no traceback without --debug)."""

from __future__ import annotations

import json
import os


class KilnError(Exception):
    """A user-facing error: the message names the file, field or value and what was expected."""


def json_error_reason(exc: json.JSONDecodeError, line: int | None = None) -> str:
    """The whole reason of a JSON parse error with its place, e.g. "Expecting ',' delimiter at
    line 3 column 7" (`line`: the file's line number, for one line of a JSONL file)."""
    # Some of json's messages end with " at" ("Invalid control character at", "Unterminated
    # string starting at"), written to be followed by the place.
    reason = exc.msg.removesuffix(" at")
    return f"{reason} at line {line if line is not None else exc.lineno} column {exc.colno}"


def not_found(path: str | os.PathLike[str], expected: str) -> KilnError:
    """The error for a path that is not the `expected` kind ("dataset directory", "tokenizer
    file"): missing, or there but a file where a directory was expected (or the reverse)."""
    text = os.fspath(path)
    article = "an" if expected[0] in "aeiou" else "a"
    if os.path.isdir(text):
        return KilnError(f"{text}: is a directory, expected {article} {expected}")
    if os.path.exists(text):
        return KilnError(f"{text}: is a file, expected {article} {expected}")
    return KilnError(f"{text}: no such {expected}")
