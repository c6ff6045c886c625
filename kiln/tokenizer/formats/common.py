"""What every tokenizer-file reader shares: the parts it returns, and checks naming file and field.

Readers return `TokenizerParts` and writers take a Tokenizer, so nothing here or in the format
modules builds a Tokenizer: `Tokenizer.from_parts` (and the `read_*` functions in this package's
`__init__`) do, so these modules depend on nothing above them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.errors import KilnError, json_error_reason, not_found
from kiln.tokenizer.patterns import SplitPattern

if TYPE_CHECKING:
    from kiln.tokenizer.tokenizer import Tokenizer

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class TokenizerParts:
    """A tokenizer file's content, checked against the file's rules: what a Tokenizer is built from."""

    source: str  # the file it came from, named in any error the Tokenizer's own checks raise
    vocab: dict[int, bytes]
    merges: list[tuple[bytes, bytes]]
    special_tokens: dict[str, int]
    pattern: str | SplitPattern
    metadata: dict[str, Any]


class _DuplicateKey(Exception):
    """Raised from inside json.loads: JSON objects silently keep the last of two equal keys."""


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def read_text(path: PathLike) -> str:
    """A UTF-8 file's text; a missing or non-UTF-8 file is a KilnError naming it."""
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise not_found(name, "file")
    try:
        return Path(name).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise KilnError(f"{name}: not UTF-8 text (byte offset {exc.start})") from None


def load_json(path: PathLike) -> Any:
    """Parse a JSON file; malformed JSON or a repeated key is a KilnError naming the file."""
    text = read_text(path)
    try:
        return json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise KilnError(f"{os.fspath(path)}: not valid JSON ({json_error_reason(exc)})") from None
    except _DuplicateKey as exc:
        raise KilnError(
            f"{os.fspath(path)}: key {exc.args[0]!r} appears twice in one JSON object "
            "(ids and token names must be unique)"
        ) from None


def expect(path: PathLike, field: str, value: Any, kind: type) -> Any:
    """`value` if it is a `kind` (dict, list, str), else a KilnError naming file and field."""
    if not isinstance(value, kind):
        raise KilnError(f"{os.fspath(path)}: {field}: expected {kind.__name__}, got {value!r:.60}")
    return value


def expect_id(path: PathLike, field: str, value: Any) -> int:
    """`value` if it is a token id (an int >= 0; JSON true/false are not), else a KilnError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KilnError(f"{os.fspath(path)}: {field}: expected a token id >= 0, got {value!r:.60}")
    return value


def check_vocab(path: PathLike, vocab: Mapping[int, bytes]) -> None:
    """Token bytes are unique and non-empty, and every byte value has a single-byte token."""
    seen: dict[bytes, int] = {}
    for i, b in vocab.items():
        if not b:
            raise KilnError(f"{os.fspath(path)}: vocab id {i}: empty token (needs >= 1 byte)")
        if b in seen:
            raise KilnError(f"{os.fspath(path)}: vocab ids {seen[b]} and {i} both hold {b!r}")
        seen[b] = i
    missing = [v for v in range(256) if bytes([v]) not in seen]
    if missing:
        shown = ", ".join(f"0x{v:02x}" for v in missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise KilnError(
            f"{os.fspath(path)}: vocab lacks single-byte tokens for {len(missing)} byte value(s) "
            f"({shown}); a byte-level vocab needs all 256"
        )


def check_merges(
    path: PathLike, merges: Iterable[tuple[str, bytes, bytes]], known: Iterable[bytes]
) -> None:
    """Each merge (location, left, right): both parts and their concatenation are in the vocab."""
    known = set(known)
    for where, a, b in merges:
        for label, token in (("left part", a), ("right part", b), ("result", a + b)):
            if token not in known:
                raise KilnError(
                    f"{os.fspath(path)}: {where}: {label} {token!r} is not in the vocab "
                    "(a merge's parts and result must all be tokens)"
                )


def check_specials(path: PathLike, specials: Mapping[str, int], vocab: Mapping[int, bytes]) -> None:
    """Special tokens have non-empty names and ids of their own, outside the regular vocab."""
    owner: dict[int, str] = {}
    for name, i in specials.items():
        if not name:
            raise KilnError(f"{os.fspath(path)}: special_tokens: a special token name is empty")
        if i in vocab:
            raise KilnError(
                f"{os.fspath(path)}: special token {name!r} has id {i}, which is also the "
                f"regular token {vocab[i]!r}; special ids must not collide with regular ids"
            )
        if i in owner:
            raise KilnError(
                f"{os.fspath(path)}: special tokens {owner[i]!r} and {name!r} share the id {i}"
            )
        owner[i] = name


# Special ids may leave a gap above the regular ones (reserved ranges, ids padded past 65,535 to
# test wide shards), but not an unbounded one: every id up to the largest costs a table entry.
MAX_ID_GAP = 1 << 17


def check_id_range(path: PathLike, vocab: Mapping[int, bytes], specials: Mapping[str, int]) -> None:
    """Every id is >= 0 and below the vocabulary's size plus MAX_ID_GAP."""
    limit = len(vocab) + len(specials) + MAX_ID_GAP
    for name, i in specials.items():
        if not 0 <= i < limit:
            raise KilnError(
                f"{os.fspath(path)}: special token {name!r} has id {i:,}, far outside a vocabulary "
                f"of {len(vocab):,} regular and {len(specials)} special tokens (ids must be in "
                f"[0, {limit:,}))"
            )
    top = max(vocab, default=-1)
    if top >= limit or min(vocab, default=0) < 0:
        bad = top if top >= limit else min(vocab)
        raise KilnError(
            f"{os.fspath(path)}: regular token id {bad:,} is outside [0, {limit:,}) for a "
            f"vocabulary of {len(vocab):,} tokens"
        )


def checked_parts(
    path: PathLike,
    vocab: dict[int, bytes],
    merges: list[tuple[bytes, bytes]],
    specials: dict[str, int],
    pattern: str | SplitPattern,
    metadata: Mapping[str, Any] | None = None,
) -> TokenizerParts:
    """The parts read from `path`, once their ids are known to lie in a sane range."""
    check_id_range(path, vocab, specials)
    return TokenizerParts(os.fspath(path), vocab, merges, specials, pattern, dict(metadata or {}))


def regular_ids(tok: Tokenizer) -> dict[bytes, int]:
    """Bytes -> id of the non-special tokens."""
    special_ids = set(tok.special_tokens.values())
    return {b: i for i, b in tok.vocab.items() if i not in special_ids}


def regular_vocab(tok: Tokenizer) -> dict[int, bytes]:
    """Id -> bytes of the non-special tokens, in id order."""
    special_ids = set(tok.special_tokens.values())
    return {i: tok.vocab[i] for i in sorted(tok.vocab) if i not in special_ids}
