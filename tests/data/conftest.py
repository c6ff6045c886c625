"""Fixtures for the data tests: small tokenizers trained here, and a way to build datasets."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kiln.data.tokenize_shards import TokenizeConfig, tokenize_to_shards
from kiln.tokenizer import Tokenizer, train_bpe

EOT = "<|endoftext|>"
SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"

# Small documents with the awkward cases: unicode, inner newlines, leading spaces inside,
# special-token look-alikes, repeated text.
DOCS_A = [
    "Once upon a time there was a little fox.",
    "The fox liked to run.\nIt ran and ran.\n\nThen it slept.",
    "Émile a mangé une crêpe — très bon! 日本語も少し。 🦊",
    "a",
    "Tabs\tand  double  spaces stay as they are.",
]
DOCS_B = [
    "A JSON document that mentions <|endoftext|> as plain text.",
    "Numbers 12345 and symbols #@!$ survive.",
    "Once upon a time there was a little fox.",
]


@pytest.fixture(scope="session")
def tiny_tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 300-token BPE (uint16 shards) trained on the test documents."""
    root = tmp_path_factory.mktemp("tok")
    corpus = root / "corpus.txt"
    corpus.write_text((" ".join(DOCS_A + DOCS_B) + "\n") * 20, encoding="utf-8")
    tok = train_bpe(corpus, 300, special_tokens=[EOT])
    path = root / "tok.json"
    tok.save(path)
    return path


@pytest.fixture(scope="session")
def wide_tokenizer_file(
    tiny_tokenizer_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny tokenizer with end-of-text moved to id 70000, so shards need uint32."""
    tok = Tokenizer.load(tiny_tokenizer_file)
    eot_id = tok.special_tokens[EOT]
    vocab = {i: b for i, b in tok.vocab.items() if i != eot_id}
    wide = Tokenizer(vocab, tok.merges, {EOT: 70_000}, pattern=tok.pattern)
    path = tmp_path_factory.mktemp("wide") / "tok70k.json"
    wide.save(path)
    return path


def write_inputs(root: Path) -> list[Path]:
    """A gzipped .txt (EOT-separated) and a .jsonl input holding DOCS_A and DOCS_B."""
    root.mkdir(parents=True, exist_ok=True)
    txt = root / "a.txt.gz"
    with gzip.open(txt, "wt", encoding="utf-8") as handle:
        handle.write("".join(f"{d}\n{EOT}\n" for d in DOCS_A))
    jsonl = root / "b.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS_B), encoding="utf-8")
    return [txt, jsonl]


BuildDataset = Callable[..., Path]


@pytest.fixture
def build_dataset(tmp_path: Path, tiny_tokenizer_file: Path) -> BuildDataset:
    """Tokenize inputs (default: the two test files) into `tmp_path/<name>`; returns the dir."""

    def build(name: str = "ds", inputs: list[Path] | None = None, **overrides) -> Path:
        inputs = inputs if inputs is not None else write_inputs(tmp_path / "inputs")
        settings = {
            "tokenizer": str(tiny_tokenizer_file),
            "inputs": tuple(str(p) for p in inputs),
            "out": str(tmp_path / name),
            "val_docs": 2,
            "progress": False,
            **overrides,
        }
        tokenize_to_shards(TokenizeConfig(**settings))
        return Path(settings["out"])

    return build
