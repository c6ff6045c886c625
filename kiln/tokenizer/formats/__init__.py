"""Tokenizer files: kiln's own `tokenizer.json`, GPT-2 vocab/merges, HF `tokenizer.json`, tiktoken.

Every reader validates what it loads and raises KilnError naming the file, the field or entry and
what was expected, so a corrupt or foreign file never gets as far as a wrong encoding.
`convert` and `read_any` guess a file's format from its content and name.

The format modules read files into `TokenizerParts` and write any Tokenizer, without importing
the Tokenizer class; the `read_*` functions here build one from those parts (so does
`Tokenizer.load`), which keeps the dependency one way: this package builds on the tokenizer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.io import check_can_write
from kiln.tokenizer.formats.common import PathLike, TokenizerParts, load_json, read_text
from kiln.tokenizer.formats.gpt2 import parse_gpt2
from kiln.tokenizer.formats.hf import hf_document, hf_parts_from_doc, parse_hf, write_hf
from kiln.tokenizer.formats.kiln_json import (
    KILN_FORMAT,
    KILN_VERSION,
    kiln_document,
    kiln_parts_from_doc,
    parse_kiln,
    write_kiln,
)
from kiln.tokenizer.formats.tiktoken_ranks import (
    TIKTOKEN_LINE,
    merges_from_ranks,
    parse_tiktoken,
    write_tiktoken,
)
from kiln.tokenizer.special import EOT
from kiln.tokenizer.tokenizer import Tokenizer

FORMATS = ("kiln", "hf", "gpt2", "tiktoken")

__all__ = [
    "FORMATS",
    "KILN_FORMAT",
    "KILN_VERSION",
    "TokenizerParts",
    "convert",
    "detect_format",
    "hf_document",
    "kiln_document",
    "merges_from_ranks",
    "read_any",
    "read_gpt2",
    "read_hf",
    "read_kiln",
    "read_tiktoken",
    "write_any",
    "write_hf",
    "write_kiln",
    "write_tiktoken",
]


def read_kiln(path: PathLike) -> Tokenizer:
    """Load and validate kiln's `tokenizer.json`."""
    return Tokenizer.from_parts(parse_kiln(path))


def read_gpt2(
    vocab_json: PathLike, merges_txt: PathLike, special_tokens: Sequence[str] = (EOT,)
) -> Tokenizer:
    """Load GPT-2's `vocab.json` (encoder.json) and `merges.txt` (vocab.bpe)."""
    return Tokenizer.from_parts(parse_gpt2(vocab_json, merges_txt, special_tokens))


def read_hf(path: PathLike) -> Tokenizer:
    """Import an HF `tokenizers` tokenizer.json holding a byte-level BPE model."""
    return Tokenizer.from_parts(parse_hf(path))


def read_tiktoken(
    path: PathLike, pattern: str = "gpt2", special_tokens: Mapping[str, int] | None = None
) -> Tokenizer:
    """Import a tiktoken rank file; the pattern and special tokens are not in it, so pass them."""
    return Tokenizer.from_parts(parse_tiktoken(path, pattern, special_tokens))


def _sniff(path: PathLike) -> tuple[str, Any]:
    """The format of a tokenizer file and, for JSON formats, its parsed content."""
    name = os.fspath(path)
    text = read_text(name)
    if name.endswith(".tiktoken") or TIKTOKEN_LINE.match(text.lstrip()[:200].split("\n")[0]):
        return "tiktoken", None
    if not text.lstrip().startswith("{"):
        raise KilnError(f"{name}: not a tokenizer file kiln recognises (kiln, HF, GPT-2, tiktoken)")
    doc = load_json(name)
    if not isinstance(doc, dict):
        raise KilnError(f"{name}: expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") == KILN_FORMAT:
        return "kiln", doc
    if isinstance(doc.get("model"), dict):
        return "hf", doc
    if doc and all(isinstance(v, int) for v in doc.values()):
        return "gpt2", doc
    raise KilnError(
        f"{name}: JSON, but neither a kiln, an HF nor a GPT-2 vocab.json tokenizer file"
    )


def detect_format(path: PathLike) -> str:
    """Guess a tokenizer file's format (`kiln`, `hf`, `gpt2` vocab.json or `tiktoken`) from it."""
    return _sniff(path)[0]


def read_any(
    path: PathLike,
    fmt: str | None = None,
    *,
    merges: PathLike | None = None,
    pattern: str = "gpt2",
    special_tokens: Mapping[str, int] | None = None,
) -> Tokenizer:
    """Read a tokenizer file of format `fmt` (guessed from the file when None)."""
    if fmt is None:
        fmt, doc = _sniff(path)
        # Reuse the parsed JSON: tokenizer files run to megabytes.
        if fmt == "kiln":
            return Tokenizer.from_parts(kiln_parts_from_doc(path, doc))
        if fmt == "hf":
            return Tokenizer.from_parts(hf_parts_from_doc(path, doc))
    if fmt == "kiln":
        return read_kiln(path)
    if fmt == "hf":
        return read_hf(path)
    if fmt == "gpt2":
        merges = merges or Path(path).with_name("merges.txt")
        if not os.path.isfile(merges):
            raise KilnError(
                f"{os.fspath(path)}: a GPT-2 vocab.json needs its merges.txt (--merges)"
            )
        names = list(special_tokens) if special_tokens is not None else [EOT]
        return read_gpt2(path, merges, names)
    if fmt == "tiktoken":
        return read_tiktoken(path, pattern, special_tokens)
    raise KilnError(f"unknown tokenizer format {fmt!r}; expected one of {', '.join(FORMATS)}")


def write_any(tok: Tokenizer, path: PathLike, fmt: str, force: bool = False) -> None:
    """Write `tok` to `path` in format `fmt` (`kiln`, `hf` or `tiktoken`)."""
    writers = {"kiln": write_kiln, "hf": write_hf, "tiktoken": write_tiktoken}
    if fmt not in writers:
        raise KilnError(f"cannot write format {fmt!r}; kiln writes {', '.join(writers)}")
    writers[fmt](tok, path, force=force)


def guess_output_format(dst: PathLike, src_format: str) -> str:
    """`.tiktoken` -> tiktoken; a `.json` is kiln's format when importing, HF when exporting kiln."""
    name = os.fspath(dst)
    if name.endswith(".tiktoken"):
        return "tiktoken"
    if name.endswith(".json"):
        return "hf" if src_format == "kiln" else "kiln"
    raise KilnError(f"{name}: cannot guess the output format from the name; pass --to")


def convert(
    src: PathLike,
    dst: PathLike,
    *,
    src_format: str | None = None,
    dst_format: str | None = None,
    force: bool = False,
    merges: PathLike | None = None,
    pattern: str = "gpt2",
    special_tokens: Mapping[str, int] | None = None,
) -> tuple[Tokenizer, str, str]:
    """Convert a tokenizer file; returns the tokenizer and the formats read and written."""
    check_can_write(dst, force)
    src_format = src_format or detect_format(src)
    dst_format = dst_format or guess_output_format(dst, src_format)
    tok = read_any(src, src_format, merges=merges, pattern=pattern, special_tokens=special_tokens)
    write_any(tok, dst, dst_format, force=force)
    return tok, src_format, dst_format
