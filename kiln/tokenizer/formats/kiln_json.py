"""kiln's own `tokenizer.json`: versioned JSON, vocab as hex bytes, merges as id pairs."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.errors import KilnError
from kiln.io import atomic_write, check_can_write
from kiln.tokenizer.formats.common import (
    PathLike,
    TokenizerParts,
    check_merges,
    check_specials,
    check_vocab,
    checked_parts,
    expect,
    expect_id,
    load_json,
    regular_ids,
    regular_vocab,
)
from kiln.tokenizer.patterns import NAMED_PATTERNS, SplitPattern, resolve_pattern

if TYPE_CHECKING:
    from kiln.tokenizer.tokenizer import Tokenizer

KILN_FORMAT = "kiln-tokenizer"
KILN_VERSION = 1


def kiln_document(tok: Tokenizer) -> dict[str, Any]:
    """The JSON object kiln's `tokenizer.json` holds for `tok`."""
    id_of = regular_ids(tok)
    return {
        "format": KILN_FORMAT,
        "version": KILN_VERSION,
        "pattern": {"name": tok.pattern.name, "regex": tok.pattern.text},
        "normalization": None,
        "special_tokens": dict(sorted(tok.special_tokens.items(), key=lambda kv: kv[1])),
        "metadata": tok.metadata,
        "vocab": {str(i): b.hex() for i, b in regular_vocab(tok).items()},
        "merges": [[id_of[a], id_of[b]] for a, b in tok.merges],
    }


def _dump_kiln(doc: Mapping[str, Any]) -> str:
    """Pretty JSON with one vocab entry and one merge per line (diffable, grep-able)."""
    fields = []
    for key, value in doc.items():
        if key == "vocab":
            body = ",\n".join(f'    "{i}": "{h}"' for i, h in value.items())
            rendered = "{\n" + body + "\n  }" if value else "{}"
        elif key == "merges":
            body = ",\n".join(f"    [{a}, {b}]" for a, b in value)
            rendered = "[\n" + body + "\n  ]" if value else "[]"
        else:
            # Metadata may hold file names with undecodable bytes: keep it ASCII-escaped.
            ascii_only = key == "metadata"
            rendered = json.dumps(value, indent=2, ensure_ascii=ascii_only).replace("\n", "\n  ")
        fields.append(f"  {json.dumps(key)}: {rendered}")
    return "{\n" + ",\n".join(fields) + "\n}\n"


def write_kiln(tok: Tokenizer, path: PathLike, force: bool = True) -> None:
    """Write `tok` as kiln's `tokenizer.json`, atomically; refuse to replace a file unless `force`."""
    check_can_write(path, force)
    try:
        text = _dump_kiln(kiln_document(tok))
    except (TypeError, ValueError) as exc:
        raise KilnError(
            f"{os.fspath(path)}: tokenizer metadata is not JSON-serialisable: {exc}"
        ) from None
    with atomic_write(path, "w") as handle:
        handle.write(text)


def parse_kiln(path: PathLike) -> TokenizerParts:
    """Read and check kiln's `tokenizer.json`."""
    return kiln_parts_from_doc(path, load_json(path))


def _check_header(path: PathLike, doc: Any) -> None:
    name = os.fspath(path)
    if not isinstance(doc, dict):
        raise KilnError(f"{name}: expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") != KILN_FORMAT:
        hint = (
            " (it looks like an HF tokenizer.json: use --from hf)"
            if isinstance(doc.get("model"), dict)
            else ""
        )
        raise KilnError(
            f"{name}: format: expected {KILN_FORMAT!r}, got {doc.get('format')!r}{hint}"
        )
    if doc.get("version") != KILN_VERSION:
        raise KilnError(
            f"{name}: version: expected {KILN_VERSION}, got {doc.get('version')!r} "
            "(written by another kiln version?)"
        )
    if doc.get("normalization") is not None:
        raise KilnError(f"{name}: normalization: expected null (kiln does not normalise text)")


def _kiln_pattern(path: PathLike, field: Any) -> SplitPattern:
    field = expect(path, "pattern", field, dict)
    text = expect(path, "pattern.regex", field.get("regex"), str)
    label = expect(path, "pattern.name", field.get("name", "custom"), str)
    try:
        pattern = resolve_pattern(text)
    except KilnError as exc:
        raise KilnError(f"{os.fspath(path)}: pattern.regex: {exc}") from None
    # A custom pattern keeps its label; a built-in name is only believed if the regex matches it.
    if pattern.name == "custom" and label not in NAMED_PATTERNS:
        return SplitPattern(label, text)
    return pattern


def _kiln_vocab(path: PathLike, field: Any) -> dict[int, bytes]:
    vocab: dict[int, bytes] = {}
    for key, value in expect(path, "vocab", field, dict).items():
        if not key.isdigit() or str(int(key)) != key:
            raise KilnError(f"{os.fspath(path)}: vocab: key {key!r} is not a token id (0, 1, ...)")
        if int(key) in vocab:
            raise KilnError(f"{os.fspath(path)}: vocab: id {int(key)} appears twice")
        hex_text = expect(path, f"vocab[{key}]", value, str)
        try:
            vocab[int(key)] = bytes.fromhex(hex_text)
        except ValueError:
            raise KilnError(
                f"{os.fspath(path)}: vocab[{key}]: {hex_text!r:.40} is not a hex byte string"
            ) from None
    check_vocab(path, vocab)
    return vocab


def _kiln_merges(path: PathLike, field: Any, vocab: dict[int, bytes]) -> list[tuple[bytes, bytes]]:
    merges = []
    for k, pair in enumerate(expect(path, "merges", field, list)):
        if not isinstance(pair, list) or len(pair) != 2:
            raise KilnError(f"{os.fspath(path)}: merges[{k}]: expected [id, id], got {pair!r:.60}")
        a, b = (expect_id(path, f"merges[{k}]", i) for i in pair)
        for i in (a, b):
            if i not in vocab:
                raise KilnError(f"{os.fspath(path)}: merges[{k}]: id {i} is not a regular vocab id")
        merges.append((vocab[a], vocab[b]))
    check_merges(path, ((f"merges[{k}]", a, b) for k, (a, b) in enumerate(merges)), vocab.values())
    return merges


def kiln_parts_from_doc(path: PathLike, doc: Any) -> TokenizerParts:
    """Validate an already parsed kiln tokenizer.json (read from `path`) and return its parts."""
    _check_header(path, doc)
    pattern = _kiln_pattern(path, doc.get("pattern"))
    vocab = _kiln_vocab(path, doc.get("vocab"))
    specials = {
        name: expect_id(path, f"special_tokens[{name!r}]", i)
        for name, i in expect(path, "special_tokens", doc.get("special_tokens", {}), dict).items()
    }
    check_specials(path, specials, vocab)
    merges = _kiln_merges(path, doc.get("merges"), vocab)
    metadata = expect(path, "metadata", doc.get("metadata", {}), dict)
    return checked_parts(path, vocab, merges, specials, pattern, metadata)
