"""Tokenizer files: GPT-2 parity with tiktoken, HF and tiktoken exports checked by those libraries,
save/load identity, and a clear KilnError naming the file for every kind of corrupt file."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tiktoken
import tiktoken.load
import tokenizers

from kiln.errors import KilnError
from kiln.tokenizer import Tokenizer
from kiln.tokenizer.byte_unicode import (
    byte_to_unicode,
    bytes_to_token_string,
    token_string_to_bytes,
)
from kiln.tokenizer.formats import (
    TokenizerParts,
    convert,
    detect_format,
    hf_document,
    kiln_document,
    read_any,
    read_gpt2,
    read_hf,
    read_kiln,
    read_tiktoken,
    write_hf,
    write_kiln,
    write_tiktoken,
)
from kiln.tokenizer.native import NATIVE
from kiln.tokenizer.patterns import GPT2_PATTERN, NAMED_PATTERNS

EOT = "<|endoftext|>"
BACKENDS = ["reference"] + (["native"] if NATIVE is not None else [])

ADVERSARIAL = [
    "",
    " ",
    "   ",
    "\n",
    "\n\n\n",
    "  \n  \n",
    "a\r\nb\r\n",
    "\t\tindented\ttabs \t",
    "Hello, world!",
    "hello world   ",
    "trailing newline\n",
    "ends with spaces and newline  \n ",
    "I'm, you're, they've, it'll, she'd, HE'S, 'tis",
    "numbers 1 12 123 1234 12345 3.14159 -42 1e10",
    "emoji 👍🏽 and ZWJ 👨‍👩‍👧‍👦 family 🏳️‍🌈",
    "combining: e\u0301 a\u0308 n\u0303 Z\u0351\u0352",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "مرحبا بالعالم שלום עולם",
    "Ελληνικά Кириллица ქართული",
    "NUL \x00 byte and \x01\x02 controls \x7f",
    "lone surrogate \ud800 escaped",
    "a" * 300,
    "supercalifragilisticexpialidocious" * 5,
    "<|endoftext|> look-alikes: <|endoftext| <|endoftext <endoftext|> <||>",
    "code: def f(x):\n    return x**2  # comment\n",
    "URL https://example.com/path?q=1&r=2#frag",
    "!!!???...,,,;;;:::---___===",
    "mixed\u00a0nbsp\u2003em-space\u3000ideographic",
]


def _suite(shared_data: Path, lines_per_file: int = 60) -> list[str]:
    """The adversarial strings plus real lines and paragraphs from the shared texts."""
    texts = list(ADVERSARIAL)
    for name in ("corpus.en", "german.txt", "address.txt", "tinystories_sample.txt"):
        content = (shared_data / "text" / name).read_text(encoding="utf-8")
        texts += content.splitlines(keepends=True)[:lines_per_file]
        texts.append(content[:1500])
    return texts


def _gpt2_ranks(shared_data: Path) -> dict[bytes, int]:
    table = json.loads((shared_data / "gpt2" / "vocab.json").read_text(encoding="utf-8"))
    return {token_string_to_bytes(s): i for s, i in table.items() if s != EOT}


@pytest.fixture(scope="module")
def gpt2(shared_data: Path) -> Tokenizer:
    return read_gpt2(shared_data / "gpt2" / "vocab.json", shared_data / "gpt2" / "merges.txt")


@pytest.fixture(scope="module")
def tiktoken_gpt2(shared_data: Path) -> tiktoken.Encoding:
    return tiktoken.Encoding(
        name="gpt2-offline",
        pat_str=NAMED_PATTERNS["gpt2"],
        mergeable_ranks=_gpt2_ranks(shared_data),
        special_tokens={EOT: 50256},
    )


def small_tokenizer(gpt2: Tokenizer, n_merges: int, pattern: str = "gpt2", **kw: Any) -> Tokenizer:
    """GPT-2 cut to its first merges (ids stay 256 + rank), with another pattern if asked."""
    merges = gpt2.merges[:n_merges]
    keep = {a + b for a, b in merges} | {bytes([v]) for v in range(256)}
    vocab = {i: b for i, b in gpt2.vocab.items() if b in keep and i != 50256}
    return Tokenizer(vocab, merges, kw.pop("specials", {EOT: 50256}), pattern, **kw)


# ------------------------------------------------------------------------------ byte <-> unicode
def test_byte_unicode_table_is_gpt2s() -> None:
    table = byte_to_unicode()
    assert len(table) == 256 and len(set(table.values())) == 256
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("A")] == "A"
    assert all(not ch.isspace() and ch.isprintable() for ch in table.values())
    data = bytes(range(256))
    assert token_string_to_bytes(bytes_to_token_string(data)) == data
    with pytest.raises(KilnError, match="not in GPT-2's byte-to-unicode table"):
        token_string_to_bytes("a\u4e00")


# ------------------------------------------------------------------------------------ GPT-2 parity
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpt2_ids_equal_tiktoken(gpt2, tiktoken_gpt2, shared_data, backend) -> None:
    tok = Tokenizer(gpt2.vocab, gpt2.merges, gpt2.special_tokens, gpt2.pattern, backend=backend)
    for text in _suite(shared_data):
        expected = tiktoken_gpt2.encode(text, disallowed_special=())
        assert tok.encode_ordinary(text) == expected, repr(text)
    text = f"one{EOT}two {EOT}"
    assert tok.encode(text, allowed_special="all") == tiktoken_gpt2.encode(
        text, allowed_special="all"
    )


def test_gpt2_vocab_and_specials(gpt2, shared_data) -> None:
    assert gpt2.n_vocab == 50257 and len(gpt2.merges) == 50000
    assert gpt2.special_tokens == {EOT: 50256}
    assert gpt2.vocab[50256] == EOT.encode()
    assert gpt2.merges[0] == (b" ", b"t")
    assert gpt2.pattern.name == "gpt2" and gpt2.pattern.text == GPT2_PATTERN
    assert gpt2.decode(gpt2.encode("Hello world")) == "Hello world"


def test_gpt2_version_line_skipped_and_new_special_appended(gpt2, shared_data, tmp_path) -> None:
    merges = tmp_path / "merges.txt"
    lines = (shared_data / "gpt2" / "merges.txt").read_text(encoding="utf-8").splitlines()[:50]
    merges.write_text("#version: 0.2\n" + "\n".join(lines) + "\n", encoding="utf-8")
    tok = read_gpt2(shared_data / "gpt2" / "vocab.json", merges, [EOT, "<|pad|>"])
    assert len(tok.merges) == 50 and tok.merges == gpt2.merges[:50]
    assert tok.special_tokens == {EOT: 50256, "<|pad|>": 50257}


# ---------------------------------------------------------------------------- kiln round trips
def _same(a: Tokenizer, b: Tokenizer) -> None:
    assert a.vocab == b.vocab
    assert a.merges == b.merges
    assert a.special_tokens == b.special_tokens
    assert a.pattern == b.pattern
    assert a.metadata == b.metadata


def test_kiln_round_trip_gpt2(gpt2, tmp_path) -> None:
    path = tmp_path / "tokenizer.json"
    gpt2.save(path)
    loaded = Tokenizer.load(path)
    _same(gpt2, loaded)
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert (doc["format"], doc["version"], doc["normalization"]) == ("kiln-tokenizer", 1, None)
    assert doc["vocab"]["220"] == "20" and doc["merges"][0] == [220, 83]
    assert doc == kiln_document(gpt2)


def test_kiln_round_trip_custom_pattern_sparse_ids_metadata(gpt2, tmp_path) -> None:
    base = small_tokenizer(gpt2, 40)
    # Shift every merged token to a sparse id range, keep the bytes where they are.
    vocab = {(i if i < 256 else 1000 + 3 * i): b for i, b in base.vocab.items() if i != 50256}
    metadata = {"training": {"corpus_sha256": "ab" * 32, "sizes": [1, 2], "date": "2026-01-01"}}
    tok = Tokenizer(
        vocab, base.merges, {EOT: 500, "<|pad|>": 9000}, r"\p{L}+|\p{N}|\s+|[^\s\p{L}\p{N}]+",
        metadata=metadata,
    )  # fmt: skip
    path = tmp_path / "tok.json"
    write_kiln(tok, path)
    loaded = read_kiln(path)
    _same(tok, loaded)
    assert loaded.pattern.name == "custom"
    text = "Hello there, 42 worlds<|pad|>"
    assert loaded.encode(text, allowed_special="all") == tok.encode(text, allowed_special="all")


def test_tokenizer_from_parts_names_the_file_when_the_parts_disagree() -> None:
    # The format readers' own checks catch this first; the Tokenizer's checks are the last
    # line, and their message still has to say which file was wrong.
    vocab = {i: bytes([i]) for i in range(256)}
    parts = TokenizerParts("models/tok.json", vocab, [(b"a", b"b")], {}, "gpt2", {})
    with pytest.raises(KilnError, match=r"^models/tok\.json: merge 0 .*must all be in the vocab"):
        Tokenizer.from_parts(parts)
    good = TokenizerParts("models/tok.json", vocab, [], {EOT: 256}, "gpt2", {"k": 1})
    tok = Tokenizer.from_parts(good)
    assert (tok.special_tokens, tok.metadata, tok.encode_ordinary("ab")) == (
        {EOT: 256},
        {"k": 1},
        [97, 98],
    )


def test_write_kiln_refuses_to_replace_without_force(gpt2, tmp_path) -> None:
    path = tmp_path / "tok.json"
    path.write_text("keep me", encoding="utf-8")
    tok = small_tokenizer(gpt2, 5)
    with pytest.raises(KilnError, match=r"tok\.json.*--force"):
        write_kiln(tok, path, force=False)
    assert path.read_text(encoding="utf-8") == "keep me"
    tok.metadata["bad"] = object()
    with pytest.raises(KilnError, match="not JSON-serialisable"):
        write_kiln(tok, path, force=True)
    assert path.read_text(encoding="utf-8") == "keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["tok.json"]  # no temp file left behind


# ------------------------------------------------------------------------------ corrupt kiln files
def _set(field: str, value: Any) -> Callable[[dict], None]:
    return lambda doc: doc.__setitem__(field, value)


def _vocab_id_of(doc: dict, byte_value: int) -> str:
    return next(k for k, h in doc["vocab"].items() if h == f"{byte_value:02x}")


CORRUPTIONS: list[tuple[str, Callable[[dict], None], str]] = [
    ("format", _set("format", "other-tokenizer"), r"format: expected 'kiln-tokenizer'"),
    ("version", _set("version", 2), r"version: expected 1"),
    ("normalization", _set("normalization", "NFC"), "normalization"),
    ("pattern", _set("pattern", {"name": "x", "regex": "(unclosed"}), r"pattern\.regex"),
    ("vocab type", _set("vocab", [1, 2]), r"vocab: expected dict"),
    ("bad hex", lambda d: d["vocab"].__setitem__("300", "zz"), r"vocab\[300\].*not a hex"),
    ("id key", lambda d: d["vocab"].__setitem__("x1", "41"), r"vocab: key 'x1' is not a token id"),
    ("dup bytes", lambda d: d["vocab"].__setitem__("99999", "2074"), r"both hold b' t'"),
    (
        "missing byte",
        lambda d: d["vocab"].pop(_vocab_id_of(d, 0)),
        r"lacks single-byte tokens .*0x00",
    ),
    ("merge pair", lambda d: d["merges"].append([1, 2, 3]), r"merges\[\d+\]: expected \[id, id\]"),
    ("merge id", lambda d: d["merges"].append([220, 123456]), r"id 123456 is not a regular vocab"),
    ("merge result", lambda d: d["merges"].append([0, 1]), r"merges\[\d+\]: result b'!\"'"),
    (
        "special collides",
        lambda d: d["special_tokens"].__setitem__("<|x|>", 220),
        r"special token '<\|x\|>' has id 220.*regular",
    ),
    (
        "specials share id",
        lambda d: d["special_tokens"].__setitem__("<|x|>", 50256),
        r"share the id 50256",
    ),
    ("not object", lambda d: None, r"expected a JSON object"),
]


@pytest.mark.parametrize(
    ("name", "corrupt", "message"), CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS]
)
def test_corrupt_kiln_file_names_file_and_field(gpt2, tmp_path, name, corrupt, message) -> None:
    doc = kiln_document(small_tokenizer(gpt2, 30))
    corrupt(doc)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps([doc] if name == "not object" else doc), encoding="utf-8")
    with pytest.raises(KilnError, match=message) as err:
        read_kiln(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"format": "kiln-tokenizer", ', "not valid JSON"),
        ('{"vocab": {"1": "41", "1": "42"}}', "key '1' appears twice"),
        ("", "not valid JSON"),
    ],
)
def test_unparseable_kiln_file(tmp_path, text, message) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(KilnError, match=message) as err:
        read_kiln(path)
    assert str(path) in str(err.value)


def test_missing_file_and_hf_hint(gpt2, tmp_path) -> None:
    with pytest.raises(KilnError, match=r"nope\.json: no such file"):
        read_kiln(tmp_path / "nope.json")
    write_hf(small_tokenizer(gpt2, 5), tmp_path / "hf.json")
    with pytest.raises(KilnError, match=r"looks like an HF tokenizer\.json"):
        read_kiln(tmp_path / "hf.json")


def test_corrupt_gpt2_files(shared_data, tmp_path) -> None:
    vocab = shared_data / "gpt2" / "vocab.json"
    merges = tmp_path / "merges.txt"
    merges.write_text("Ġ t\nĠ t h\n", encoding="utf-8")
    with pytest.raises(KilnError, match=r"merges\.txt:2: expected two tokens"):
        read_gpt2(vocab, merges)
    merges.write_text("Ġ t\nx \u4e00\n", encoding="utf-8")
    with pytest.raises(KilnError, match=r"merges\.txt:2: .*not a byte-level token"):
        read_gpt2(vocab, merges)
    merges.write_text("Ġt he\n", encoding="utf-8")
    with pytest.raises(KilnError, match=r"merges\.txt: line 1: result b' the'"):
        read_gpt2(_tiny_vocab_json(tmp_path), merges)


def _tiny_vocab_json(tmp_path: Path) -> Path:
    table = {bytes_to_token_string(bytes([v])): v for v in range(256)}
    table.update({"Ġt": 256, "he": 257})
    path = tmp_path / "v.json"
    path.write_text(json.dumps(table), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------- HF tokenizers
def _hf_ids(path: Path, texts: list[str]) -> list[list[int]]:
    hf = tokenizers.Tokenizer.from_file(str(path))
    return [hf.encode(t, add_special_tokens=False).ids for t in texts]


def test_hf_export_of_gpt2_matches_kiln_and_reimports(gpt2, shared_data, tmp_path) -> None:
    path = tmp_path / "hf.json"
    write_hf(gpt2, path)
    texts = [t for t in _suite(shared_data, 30) if "\ud800" not in t]
    # HF always matches added tokens in text: kiln's allowed_special="all".
    assert _hf_ids(path, texts) == [gpt2.encode(t, allowed_special="all") for t in texts]
    hf = tokenizers.Tokenizer.from_file(str(path))
    assert hf.encode(f"a{EOT}b").ids == gpt2.encode(f"a{EOT}b", allowed_special="all")
    assert hf.decode(gpt2.encode("déjà vu 日本")) == "déjà vu 日本"
    _same(read_hf(path), gpt2)


@pytest.mark.parametrize("pattern", ["cl100k", "o200k", r"\p{L}+|\p{N}+|\s+|[^\s\p{L}\p{N}]+"])
def test_hf_export_other_patterns(gpt2, shared_data, tmp_path, pattern) -> None:
    tok = small_tokenizer(gpt2, 2000, pattern, specials={EOT: 3000, "<|pad|>": 3001})
    path = tmp_path / "hf.json"
    write_hf(tok, path)
    texts = [t for t in _suite(shared_data, 20) if "\ud800" not in t]
    assert _hf_ids(path, texts) == [tok.encode(t, allowed_special="all") for t in texts]
    loaded = read_hf(path)
    _same(loaded, tok)


def test_hf_import_gpt2_style_file(gpt2, tmp_path) -> None:
    """HF's own GPT-2 layout: plain ByteLevel pre-tokenizer, special in the vocab, pair merges."""
    tok = small_tokenizer(gpt2, 300)
    doc = hf_document(tok)
    doc["pre_tokenizer"] = {
        "type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True
    }  # fmt: skip
    doc["model"]["vocab"][EOT] = 50256
    doc["model"]["merges"] = [m.split(" ") for m in doc["model"]["merges"]]
    path = tmp_path / "gpt2-hf.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    loaded = read_hf(path)
    _same(loaded, tok)
    assert loaded.pattern.name == "gpt2"
    text = "The quick brown fox's 123 jumps\n\n"
    assert _hf_ids(path, [text]) == [loaded.encode(text)]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["model"].__setitem__("type", "WordPiece"), r"model\.type: expected 'BPE'"),
        (lambda d: d.__setitem__("model", {"type": "Unigram", "vocab": []}), r"model\.type"),
        (lambda d: d["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True), "prefix"),
        (lambda d: d.__setitem__("pre_tokenizer", {"type": "Whitespace"}), "pre_tokenizer"),
        (lambda d: d["pre_tokenizer"]["pretokenizers"][0].update(pattern="x"), "pre_tokenizer"),
        (lambda d: d["pre_tokenizer"]["pretokenizers"][0].update(invert=True), "invert"),
        (lambda d: d.__setitem__("normalizer", {"type": "NFC"}), "normalizer"),
        (lambda d: d["model"].__setitem__("continuing_subword_prefix", "##"), "continuing_sub"),
        (lambda d: d["added_tokens"][0].__setitem__("special", False), r"added_tokens\[0\]"),
        (lambda d: d["model"]["merges"].append("z q"), r"model\.merges\[\d+\]: result"),
    ],
)
def test_hf_import_refuses_other_models(gpt2, tmp_path, change, message) -> None:
    doc = hf_document(small_tokenizer(gpt2, 20))
    change(doc)
    path = tmp_path / "other.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(KilnError, match=message) as err:
        read_hf(path)
    assert str(path) in str(err.value)


# ------------------------------------------------------------------------------------- tiktoken
def test_tiktoken_export_of_gpt2(gpt2, shared_data, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # read the local file, cache nothing
    path = tmp_path / "gpt2.tiktoken"
    write_tiktoken(gpt2, path)
    ranks = tiktoken.load.load_tiktoken_bpe(str(path))
    assert ranks == _gpt2_ranks(shared_data)
    loaded = read_tiktoken(path, "gpt2", {EOT: 50256})
    # Rebuilding merges from ranks alone recovers GPT-2's merges.txt exactly.
    assert loaded.merges == gpt2.merges
    _same(loaded, gpt2)


@pytest.mark.parametrize("pattern", ["gpt2", "cl100k", "o200k"])
def test_tiktoken_export_matches_tiktoken(gpt2, shared_data, tmp_path, monkeypatch, pattern):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    tok = small_tokenizer(gpt2, 3000, pattern, specials={EOT: 4000})
    path = tmp_path / "tok.tiktoken"
    write_tiktoken(tok, path)
    enc = tiktoken.Encoding(
        name="kiln-export",
        pat_str=tok.pattern.text,
        mergeable_ranks=tiktoken.load.load_tiktoken_bpe(str(path)),
        special_tokens=tok.special_tokens,
    )
    for text in _suite(shared_data, 20):
        assert enc.encode(text, disallowed_special=()) == tok.encode_ordinary(text), repr(text)
    round_trip = read_tiktoken(path, pattern, {EOT: 4000})
    assert round_trip.merges == tok.merges


def test_tiktoken_import_reconstructs_merges(tmp_path) -> None:
    """A hand-made rank file: each multi-byte token's merge is the split BPE over lower ranks gives."""
    tokens = [bytes([v]) for v in range(256)] + [b"ab", b"bc", b"abc", b"abcab"]
    path = tmp_path / "x.tiktoken"
    write_tiktoken(Tokenizer(dict(enumerate(tokens)), [(b"a", b"b"), (b"b", b"c"), (b"ab", b"c"),
                                                     (b"abc", b"ab")]), path)  # fmt: skip
    tok = read_tiktoken(path, "gpt2")
    assert tok.merges == [(b"a", b"b"), (b"b", b"c"), (b"ab", b"c"), (b"abc", b"ab")]
    assert tok.encode("abcabc") == [258, 258]
    with pytest.raises(KilnError, match=r"x\.tiktoken: special token '<\|s\|>' has id 257"):
        read_tiktoken(path, "gpt2", {"<|s|>": 257})


def test_tiktoken_export_refuses_ids_out_of_merge_order(tmp_path) -> None:
    vocab = {v: bytes([v]) for v in range(256)} | {300: b"ab", 299: b"bc"}
    tok = Tokenizer(vocab, [(b"a", b"b"), (b"b", b"c")])
    with pytest.raises(KilnError, match="merge 1 creates id 299"):
        write_tiktoken(tok, tmp_path / "x.tiktoken")
    assert not (tmp_path / "x.tiktoken").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("YQ== 0\nnot base64!! 1\n", r":2: expected 'BASE64 RANK'"),
        ("YQ== 0\nYg== 0\n", r":2: .*appears twice"),
        ("YQ==== 0\n", r":1: .*not base64"),
        ("YQ== 0\n", "lacks single-byte tokens"),
    ],
)
def test_corrupt_tiktoken_files(tmp_path, content, message) -> None:
    path = tmp_path / "bad.tiktoken"
    path.write_text(content, encoding="ascii")
    with pytest.raises(KilnError, match=message) as err:
        read_tiktoken(path)
    assert str(path) in str(err.value)


def test_tiktoken_token_that_is_no_merge(tmp_path) -> None:
    lines = [f"{base64.b64encode(bytes([v])).decode()} {v}" for v in range(256)]
    lines.append("YWJj 256")  # "abc" with no "ab" or "bc" below it: three parts, not two
    path = tmp_path / "x.tiktoken"
    path.write_text("\n".join(lines) + "\n", encoding="ascii")
    with pytest.raises(KilnError, match=r"b'abc' \(rank 256\) is not the merge of two"):
        read_tiktoken(path)


# --------------------------------------------------------------------------- detection, convert
def test_convert_gpt2_files(gpt2, shared_data, tmp_path) -> None:
    vocab_json = shared_data / "gpt2" / "vocab.json"
    assert detect_format(vocab_json) == "gpt2"
    out = tmp_path / "gpt2.json"
    tok, src, dst = convert(vocab_json, out, merges=shared_data / "gpt2" / "merges.txt")
    assert (src, dst) == ("gpt2", "kiln")
    _same(tok, gpt2)
    assert detect_format(out) == "kiln"


def test_convert_chain_kiln_hf_tiktoken_kiln(gpt2, tmp_path) -> None:
    tok = small_tokenizer(gpt2, 500, "cl100k", specials={EOT: 900})
    kiln_path, hf_path, tt_path = tmp_path / "k.json", tmp_path / "hf.json", tmp_path / "t.tiktoken"
    write_kiln(tok, kiln_path)
    assert convert(kiln_path, hf_path)[1:] == ("kiln", "hf")
    assert convert(hf_path, tt_path)[1:] == ("hf", "tiktoken")
    back = tmp_path / "back.json"
    _, src, dst = convert(tt_path, back, pattern="cl100k", special_tokens={EOT: 900})
    assert (src, dst) == ("tiktoken", "kiln")
    assert back.read_bytes() == kiln_path.read_bytes()
    assert [detect_format(p) for p in (kiln_path, hf_path, tt_path)] == ["kiln", "hf", "tiktoken"]
    _same(read_any(hf_path), tok)
    with pytest.raises(KilnError, match=r"k\.json already exists; pass --force"):
        convert(hf_path, kiln_path)
    convert(hf_path, kiln_path, dst_format="kiln", force=True)
    with pytest.raises(KilnError, match="cannot guess the output format"):
        convert(hf_path, tmp_path / "out.bin")


def test_detect_rejects_unknown_files(tmp_path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("just some words\n", encoding="utf-8")
    with pytest.raises(KilnError, match=r"notes\.txt: not a tokenizer file"):
        detect_format(path)
    path.write_text('{"a": "b"}', encoding="utf-8")
    with pytest.raises(KilnError, match="neither a kiln"):
        detect_format(path)


def test_trained_tokenizer_exports_match_hf_and_tiktoken(shared_data, tmp_path, monkeypatch):
    """A tokenizer fresh from train_bpe survives every export with identical ids."""
    from kiln.tokenizer import train_bpe

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    corpus = shared_data / "text" / "tinystories_sample.txt"
    tok = train_bpe([corpus], 700, special_tokens=[EOT, "<|pad|>"], pattern="cl100k", workers=1)
    texts = [*_suite(shared_data, 15), f"The end.{EOT}Once<|pad|>"]
    write_hf(tok, tmp_path / "hf.json")
    expected = [tok.encode(t, allowed_special="all") for t in texts]
    assert _hf_ids(tmp_path / "hf.json", [t for t in texts if "\ud800" not in t]) == [
        e for t, e in zip(texts, expected, strict=True) if "\ud800" not in t
    ]
    write_tiktoken(tok, tmp_path / "t.tiktoken")
    enc = tiktoken.Encoding(
        name="trained",
        pat_str=tok.pattern.text,
        mergeable_ranks=tiktoken.load.load_tiktoken_bpe(str(tmp_path / "t.tiktoken")),
        special_tokens=tok.special_tokens,
    )
    assert [enc.encode(t, allowed_special="all") for t in texts] == expected
    write_kiln(tok, tmp_path / "k.json")
    _same(read_kiln(tmp_path / "k.json"), tok)
