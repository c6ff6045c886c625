"""Encoding and decoding: GPT-2 parity with tiktoken, native == reference, round trips, specials."""

from __future__ import annotations

import gzip

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.tokenizer import Tokenizer, train_bpe
from kiln.tokenizer.native import NATIVE
from kiln.tokenizer.patterns import GPT2_PATTERN

EOT = "<|endoftext|>"
needs_native = pytest.mark.skipif(NATIVE is None, reason="native extension not built")

ADVERSARIAL = [
    "",
    " ",
    "\n",
    "    leading and trailing    ",
    "tabs\tand\t\tmixed \t \n whitespace\n\n\n\n",
    "windows\r\nline\r\n\r\nendings\r",
    "emoji 😀👍🏽 and ZWJ 👨\u200d👩\u200d👧\u200d👦 family, flags 🇺🇸🇫🇷",
    "combining e\u0301\u0302 marks a\u0308\u0308\u0308 and Zalgo Z\u0351\u0352\u0353",
    "中文字符和日本語のテキスト、한국어",
    "RTL: مرحبا بالعالم and עברית \u202eoverride\u202c",
    "NUL \x00 and controls \x01\x7f\x1b[31m",
    "a" * 3000,
    "x" + "ab" * 700 + " " + "🙂" * 300,
    "contractions: it's we're they've I'm you'll he'd IT'S",
    "numbers 1234567890 3.14159 1e-10 0x1F",
    "special look-alikes: <|endoftext| <|endoftext |endoftext|> <||endoftext|>",
    "\u2028line separator\u2029paragraph\u3000ideographic space\xa0nbsp",
    "ſ long s 'ſ 'S",
]


@pytest.fixture(scope="module")
def gpt2(shared_data) -> Tokenizer:
    return Tokenizer.from_gpt2(
        shared_data / "gpt2" / "vocab.json", shared_data / "gpt2" / "merges.txt"
    )


@pytest.fixture(scope="module")
def gpt2_reference(gpt2) -> Tokenizer:
    return Tokenizer(gpt2.vocab, gpt2.merges, gpt2.special_tokens, "gpt2", backend="reference")


@pytest.fixture(scope="module")
def tiktoken_gpt2(gpt2):
    tiktoken = pytest.importorskip("tiktoken")
    ranks = {b: i for i, b in gpt2.vocab.items() if i not in gpt2.special_tokens.values()}
    return tiktoken.Encoding(
        name="gpt2-offline",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={EOT: 50256},
    )


@pytest.fixture(scope="module")
def trained(shared_data) -> dict[str, Tokenizer]:
    """Small kiln-trained tokenizers, one per built-in pattern, on TinyStories + multilingual text."""
    out = {}
    for pattern in ("gpt2", "cl100k", "o200k"):
        out[pattern] = train_bpe(
            [shared_data / "tinystories" / "valid.txt.gz"], 1000, [EOT, "<|pad|>"], pattern=pattern
        )
    return out


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_gpt2_matches_tiktoken_adversarial(gpt2, gpt2_reference, tiktoken_gpt2, text) -> None:
    expected = tiktoken_gpt2.encode_ordinary(text)
    assert gpt2.encode_ordinary(text) == expected
    assert gpt2_reference.encode_ordinary(text) == expected


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=80))
def test_gpt2_matches_tiktoken_hypothesis(gpt2, tiktoken_gpt2, text) -> None:
    assert gpt2.encode_ordinary(text) == tiktoken_gpt2.encode_ordinary(text)


@pytest.mark.parametrize("corpus", ["en_10m", "multi_10m"])
def test_gpt2_matches_tiktoken_on_real_corpora(shared_data, gpt2, tiktoken_gpt2, corpus) -> None:
    with gzip.open(shared_data / "bench" / f"{corpus}.txt.gz", "rt", encoding="utf-8") as f:
        text = f.read(2_000_000)
    assert gpt2.encode(text, allowed_special="all") == tiktoken_gpt2.encode(
        text, allowed_special="all"
    )


@needs_native
@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=120))
def test_native_equals_reference_on_trained_tokenizers(trained, text) -> None:
    for tok in trained.values():
        ref = Tokenizer(tok.vocab, tok.merges, tok.special_tokens, tok.pattern, backend="reference")
        assert tok.encode_ordinary(text) == ref.encode_ordinary(text)


@needs_native
@pytest.mark.parametrize("text", ["a" * 5000, "ab" * 2000 + "c", "héllo" * 400, "🙂" * 600])
def test_long_pieces_native_equals_reference(trained, text) -> None:
    for tok in trained.values():
        ref = Tokenizer(tok.vocab, tok.merges, tok.special_tokens, tok.pattern, backend="reference")
        assert tok.encode_ordinary(text) == ref.encode_ordinary(text)


def test_custom_pattern_tokenizer(shared_data) -> None:
    pattern = r"\w+|\s+|[^\w\s]+"
    tok = train_bpe([shared_data / "text" / "corpus.en"], 400, [EOT], pattern=pattern)
    ref = Tokenizer(tok.vocab, tok.merges, tok.special_tokens, pattern, backend="reference")
    assert tok.pattern.name == "custom"
    for text in ADVERSARIAL:
        ids = tok.encode_ordinary(text)
        assert ids == ref.encode_ordinary(text)
        assert tok.decode(ids) == text


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_round_trip_adversarial(gpt2, trained, text) -> None:
    for tok in (gpt2, *trained.values()):
        assert tok.decode(tok.encode_ordinary(text)) == text


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=st.characters(exclude_categories=("Cs",))))
def test_round_trip_hypothesis(gpt2, trained, text) -> None:
    for tok in (gpt2, *trained.values()):
        ids = tok.encode_ordinary(text)
        assert all(0 <= i < tok.n_vocab for i in ids)
        assert not set(ids) & set(tok.special_tokens.values())
        assert tok.decode(ids) == text


def test_lone_surrogates_become_replacement_char(gpt2, tiktoken_gpt2) -> None:
    text = "a\ud800b\udfffc"
    ids = gpt2.encode(text)
    assert ids == tiktoken_gpt2.encode(text)
    assert gpt2.decode(ids) == "a\ufffdb\ufffdc"


def test_special_tokens_are_refused_by_default(gpt2) -> None:
    with pytest.raises(ValueError, match=r"special token '<\|endoftext\|>' at character 6"):
        gpt2.encode("hello <|endoftext|> world")
    assert gpt2.encode("hello <|endoftext|>", allowed_special={EOT})[-1] == 50256
    assert gpt2.encode("hello <|endoftext|>", allowed_special="all")[-1] == 50256
    as_text = gpt2.encode_ordinary("hello <|endoftext|>")
    assert 50256 not in as_text and gpt2.decode(as_text) == "hello <|endoftext|>"
    with pytest.raises(ValueError, match="unknown special tokens"):
        gpt2.encode("x", allowed_special={"<|nope|>"})


def test_longest_special_token_wins(tmp_path) -> None:
    path = tmp_path / "c.txt"
    path.write_text("some text to learn from " * 20)
    tok = train_bpe([path], 270, ["<|a|>", "<|a|><|b|>", "<|b|>"])
    ids = tok.encode("x<|a|><|b|>y<|b|>", allowed_special="all")
    specials = [i for i in ids if i in tok.special_tokens.values()]
    assert specials == [tok.special_tokens["<|a|><|b|>"], tok.special_tokens["<|b|>"]]
    assert tok.decode(ids) == "x<|a|><|b|>y<|b|>"


def test_encode_batch_equals_encode(gpt2) -> None:
    texts = ADVERSARIAL * 3
    assert gpt2.encode_batch(texts, workers=2) == [gpt2.encode(t) for t in texts]
    assert gpt2.encode_batch([]) == []
    with pytest.raises(ValueError, match="special token"):
        gpt2.encode_batch(["ok", "not <|endoftext|> ok"])


def test_encode_iterable_equals_encode(gpt2, trained, tmp_path, shared_data) -> None:
    import kiln.tokenizer.tokenizer as tokmod

    with gzip.open(shared_data / "bench" / "multi_10m.txt.gz", "rt", encoding="utf-8") as f:
        text = f.read(300_000) + "\n\n  \n\nEnd  \n   \nA\n"
    path = tmp_path / "big.txt"
    path.write_text(text, encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tokmod, "_ITERABLE_BUFFER_CHARS", 1000)  # many cuts
        for tok in (gpt2, trained["cl100k"], trained["o200k"]):
            with open(path, encoding="utf-8", newline="") as handle:
                streamed = list(tok.encode_iterable(handle, allowed_special="all"))
            assert streamed == tok.encode(text, allowed_special="all")


def test_decode_errors_and_invalid_utf8(gpt2) -> None:
    ids = gpt2.encode("é")
    assert len(ids) == 1 and gpt2.decode(ids) == "é"
    # A lone continuation byte is invalid UTF-8: decode replaces it instead of raising.
    cont = next(i for i, b in gpt2.vocab.items() if b == b"\xa9")
    assert gpt2.decode([cont]) == "\ufffd"
    assert gpt2.decode_bytes([cont]) == b"\xa9"
    with pytest.raises(ValueError, match="token id 99999"):
        gpt2.decode([1, 99999])
    with pytest.raises(ValueError, match="token id -1"):
        gpt2.decode([-1])
