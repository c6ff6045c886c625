"""GPT-2's `vocab.json` (token string -> id) and `merges.txt` (one `a b` pair per line)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kiln.errors import KilnError
from kiln.tokenizer.byte_unicode import token_string_to_bytes
from kiln.tokenizer.formats.common import (
    PathLike,
    TokenizerParts,
    check_merges,
    check_vocab,
    checked_parts,
    expect,
    expect_id,
    load_json,
    read_text,
)
from kiln.tokenizer.special import EOT


def token_strings_to_vocab(
    path: PathLike, field: str, table: Any, special_names: Iterable[str]
) -> tuple[dict[int, bytes], dict[str, int]]:
    """Split a GPT-2-style {token string: id} table into regular tokens and special tokens."""
    special_names = set(special_names)
    vocab: dict[int, bytes] = {}
    specials: dict[str, int] = {}
    owner: dict[int, str] = {}
    for text, i in expect(path, field, table, dict).items():
        i = expect_id(path, f"{field}[{text!r}]", i)
        if i in owner:
            raise KilnError(f"{os.fspath(path)}: {field}: {owner[i]!r} and {text!r} share id {i}")
        owner[i] = text
        if text in special_names:
            specials[text] = i
            continue
        try:
            vocab[i] = token_string_to_bytes(text)
        except KilnError as exc:
            raise KilnError(f"{os.fspath(path)}: {field}: id {i}: {exc}") from None
    return vocab, specials


def add_missing_specials(
    vocab: Mapping[int, bytes], specials: dict[str, int], names: Iterable[str]
) -> dict[str, int]:
    """Specials not found in the file get fresh ids after the largest one, in the given order."""
    next_id = max([*vocab, *specials.values()], default=-1) + 1
    for name in names:
        if name not in specials:
            specials[name] = next_id
            next_id += 1
    return specials


def _read_gpt2_merges(path: PathLike) -> list[tuple[str, bytes, bytes]]:
    """(location, left, right) for each line of a GPT-2 `merges.txt`."""
    out = []
    for line_no, line in enumerate(read_text(path).splitlines(), start=1):
        if (line_no == 1 and line.startswith("#version")) or not line.strip():
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise KilnError(
                f"{os.fspath(path)}:{line_no}: expected two tokens separated by one space, "
                f"got {line!r:.60}"
            )
        try:
            a, b = (token_string_to_bytes(p) for p in parts)
        except KilnError as exc:
            raise KilnError(f"{os.fspath(path)}:{line_no}: {exc}") from None
        out.append((f"line {line_no}", a, b))
    return out


def parse_gpt2(
    vocab_json: PathLike, merges_txt: PathLike, special_tokens: Sequence[str] = (EOT,)
) -> TokenizerParts:
    """Read and check GPT-2's `vocab.json` (encoder.json) and `merges.txt` (vocab.bpe)."""
    vocab, specials = token_strings_to_vocab(
        vocab_json, "vocab", load_json(vocab_json), special_tokens
    )
    check_vocab(vocab_json, vocab)
    specials = add_missing_specials(vocab, specials, special_tokens)
    located = _read_gpt2_merges(merges_txt)
    check_merges(merges_txt, located, vocab.values())
    merges = [(a, b) for _, a, b in located]
    return checked_parts(vocab_json, vocab, merges, specials, "gpt2")
