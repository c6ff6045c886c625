"""HF `tokenizers` tokenizer.json, byte-level BPE only: export and import."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from kiln.errors import KilnError
from kiln.io import atomic_write, check_can_write
from kiln.tokenizer.byte_unicode import bytes_to_token_string, token_string_to_bytes
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
    regular_vocab,
)
from kiln.tokenizer.formats.gpt2 import token_strings_to_vocab
from kiln.tokenizer.patterns import SplitPattern, resolve_pattern

if TYPE_CHECKING:
    from kiln.tokenizer.tokenizer import Tokenizer

_HF_EXPECTED = (
    "expected a byte-level pre-tokenizer: ByteLevel(use_regex=true), or a Sequence of "
    "Split(Regex, behavior Isolated) then ByteLevel(use_regex=false), with add_prefix_space false"
)


def _hf_vocab(tok: Tokenizer) -> dict[str, int]:
    """Regular tokens as GPT-2 strings, plus the specials: HF renumbers added tokens it lacks."""
    vocab = {bytes_to_token_string(b): i for i, b in regular_vocab(tok).items()}
    for name, i in tok.special_tokens.items():
        if name in vocab:
            raise KilnError(
                f"cannot export as HF: special token {name!r} has the same text as regular "
                f"token {vocab[name]}"
            )
        vocab[name] = i
    return dict(sorted(vocab.items(), key=lambda kv: kv[1]))


def hf_document(tok: Tokenizer) -> dict[str, Any]:
    """The HF `tokenizers` JSON object for `tok` (byte-level BPE, specials as added tokens)."""
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    added = [
        {"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for name, i in sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
    ]  # fmt: skip
    split = {
        "type": "Split",
        "pattern": {"Regex": tok.pattern.text},
        "behavior": "Isolated",
        "invert": False,
    }
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": False,
        "vocab": _hf_vocab(tok),
        "merges": [f"{bytes_to_token_string(a)} {bytes_to_token_string(b)}" for a, b in tok.merges],
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [split, {"type": "ByteLevel", **byte_level}],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": model,
    }


def write_hf(tok: Tokenizer, path: PathLike, force: bool = False) -> None:
    """Export `tok` as an HF `tokenizers` tokenizer.json (loadable by `Tokenizer.from_file`)."""
    check_can_write(path, force)
    text = json.dumps(hf_document(tok), ensure_ascii=False, indent=1)
    with atomic_write(path, "w") as handle:
        handle.write(text + "\n")


def _hf_byte_level_regex(path: PathLike, step: Any) -> bool:
    """Check a ByteLevel pre-tokenizer step; True when it splits with GPT-2's regex itself."""
    if step.get("add_prefix_space"):
        raise KilnError(
            f"{os.fspath(path)}: pre_tokenizer: ByteLevel add_prefix_space is true; kiln never "
            "adds a prefix space (expected false)"
        )
    return bool(step.get("use_regex", True))


def _hf_pattern(path: PathLike, pre: Any) -> SplitPattern:
    """The split pattern an HF byte-level pre-tokenizer stands for."""
    steps = (
        pre.get("pretokenizers")
        if isinstance(pre, dict) and pre.get("type") == "Sequence"
        else [pre]
    )
    steps = steps if isinstance(steps, list) else [None]
    types = [s.get("type") if isinstance(s, dict) else None for s in steps]
    if types == ["ByteLevel"] and _hf_byte_level_regex(path, steps[0]):
        return resolve_pattern("gpt2")
    if types == ["Split", "ByteLevel"] and not _hf_byte_level_regex(path, steps[1]):
        split = steps[0]
        pattern = split.get("pattern")
        regex_text = pattern.get("Regex") if isinstance(pattern, dict) else None
        if isinstance(regex_text, str) and split.get("behavior") == "Isolated":
            if split.get("invert"):
                raise KilnError(f"{os.fspath(path)}: pre_tokenizer: Split invert must be false")
            try:
                return resolve_pattern(regex_text)
            except KilnError as exc:
                raise KilnError(f"{os.fspath(path)}: pre_tokenizer: {exc}") from None
    raise KilnError(f"{os.fspath(path)}: pre_tokenizer: {_HF_EXPECTED}; got {types}")


def _hf_model(path: PathLike, doc: Any) -> dict[str, Any]:
    name = os.fspath(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), dict):
        raise KilnError(f"{name}: expected an HF tokenizer.json with a 'model' object")
    model = doc["model"]
    if model.get("type", "BPE") != "BPE":
        raise KilnError(
            f"{name}: model.type: expected 'BPE' (kiln reads byte-level BPE only), "
            f"got {model.get('type')!r}"
        )
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "byte_fallback", "dropout"):
        if model.get(key):
            raise KilnError(f"{name}: model.{key}: kiln supports only plain byte-level BPE")
    if doc.get("normalizer") is not None:
        raise KilnError(f"{name}: normalizer: expected null (kiln does not normalise text)")
    return model


def _hf_specials(path: PathLike, added: Any) -> dict[str, int]:
    specials = {}
    for k, entry in enumerate(expect(path, "added_tokens", added or [], list)):
        entry = expect(path, f"added_tokens[{k}]", entry, dict)
        content = expect(path, f"added_tokens[{k}].content", entry.get("content"), str)
        if not entry.get("special"):
            raise KilnError(
                f"{os.fspath(path)}: added_tokens[{k}] ({content!r}) is not special; kiln "
                "supports added tokens only as special tokens"
            )
        specials[content] = expect_id(path, f"added_tokens[{k}].id", entry.get("id"))
    return specials


def _hf_merges(path: PathLike, merges: Any) -> list[tuple[str, bytes, bytes]]:
    out = []
    for k, item in enumerate(expect(path, "model.merges", merges, list)):
        parts = item.split(" ") if isinstance(item, str) else item
        if (
            not isinstance(parts, list)
            or len(parts) != 2
            or not all(isinstance(p, str) for p in parts)
        ):
            raise KilnError(
                f"{os.fspath(path)}: model.merges[{k}]: expected a pair, got {item!r:.60}"
            )
        try:
            a, b = (token_string_to_bytes(p) for p in parts)
        except KilnError as exc:
            raise KilnError(f"{os.fspath(path)}: model.merges[{k}]: {exc}") from None
        out.append((f"model.merges[{k}]", a, b))
    return out


def hf_parts_from_doc(path: PathLike, doc: Any) -> TokenizerParts:
    """Validate an already parsed HF tokenizer.json (read from `path`) and return its parts."""
    model = _hf_model(path, doc)
    pattern = _hf_pattern(path, doc.get("pre_tokenizer"))
    specials = _hf_specials(path, doc.get("added_tokens"))
    vocab, _ = token_strings_to_vocab(path, "model.vocab", model.get("vocab"), specials)
    check_vocab(path, vocab)
    check_specials(path, specials, vocab)
    located = _hf_merges(path, model.get("merges"))
    check_merges(path, located, vocab.values())
    return checked_parts(path, vocab, [(a, b) for _, a, b in located], specials, pattern)


def parse_hf(path: PathLike) -> TokenizerParts:
    """Read and check an HF `tokenizers` tokenizer.json holding a byte-level BPE model."""
    return hf_parts_from_doc(path, load_json(path))
