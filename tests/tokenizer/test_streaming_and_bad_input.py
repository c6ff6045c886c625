"""Streaming cuts (overlapping specials, text without ASCII line starts) and odd inputs."""

from __future__ import annotations

import gzip
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.errors import KilnError
from kiln.tokenizer import Tokenizer, train_bpe
from kiln.tokenizer.corpus import iter_segments
from kiln.tokenizer.cuts import CutFinder
from kiln.tokenizer.native import NATIVE

from .naive_bpe import naive_train

EOT = "<|endoftext|>"
BACKENDS = ["reference"] + (["native"] if NATIVE is not None else [])


@pytest.fixture(scope="module")
def gpt2(shared_data) -> Tokenizer:
    return Tokenizer.from_gpt2(
        shared_data / "gpt2" / "vocab.json", shared_data / "gpt2" / "merges.txt"
    )


def test_overlapping_special_tokens_are_never_cut_apart(gpt2) -> None:
    import kiln.tokenizer.tokenizer as tokmod

    tok = Tokenizer(gpt2.vocab, gpt2.merges, [EOT, "endoftext|>!"], "gpt2")
    text = "hello world " * 600 + "<|endoftext|>!" + " more\nText" * 300
    expected = tok.encode(text, allowed_special={EOT})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tokmod, "_ITERABLE_BUFFER_CHARS", 500)
        pieces = [text[i : i + 97] for i in range(0, len(text), 97)]
        assert list(tok.encode_iterable(pieces, allowed_special={EOT})) == expected
        assert list(tok.encode_iterable(pieces, allowed_special="all")) == tok.encode(
            text, allowed_special="all"
        )


def test_training_segments_respect_overlapping_specials(tmp_path) -> None:
    specials = [EOT, "endoftext|>!"]
    text = ("hello world " * 400 + "<|endoftext|>!") * 5
    path = tmp_path / "c.txt"
    path.write_text(text, encoding="utf-8")
    segments = list(iter_segments([path], specials, True, block_bytes=4096))
    assert b"".join(segments) == text.encode()
    for seg in segments:
        assert not seg.endswith(b"<|") and not seg.startswith(b"endoftext")


@pytest.mark.parametrize(
    "line",
    ["中文文本。第二行。\n", '  "count": 12\n', "Привет, мир!\n", "    return x  # code\n"],
)
def test_text_without_ascii_line_starts_is_still_cut(gpt2, tmp_path, line) -> None:
    """Lines starting with non-ASCII or punctuation still give cut points (bounded memory)."""
    text = line * 3000
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    segments = list(iter_segments([path], [], True, block_bytes=4096))
    assert len(segments) > 5
    assert b"".join(segments) == text.encode()
    finder: CutFinder[str] = CutFinder([], True, binary=False)
    assert finder.last_cut(text[:5000]) > 0
    lines = [line] * 3000
    assert list(gpt2.encode_iterable(lines)) == gpt2.encode(text)


@pytest.mark.parametrize("pattern", ["gpt2", "cl100k", "o200k"])
def test_cut_rule_never_changes_pretokens(pattern, tmp_path) -> None:
    """Whitespace before/after newlines, `/` after them, CJK: tiny blocks, exact merges."""
    unit = (
        "a \n\n b\n/x.\n/y\t\nz。\n中\u3000\nq\u00a0\n r\r\nS\n\n  k1\n  ;\n\n  e\u0301\n\t\u0301\n"
    )
    text = unit * 60
    path = tmp_path / "c.txt"
    path.write_text(text, encoding="utf-8")
    from kiln.tokenizer import corpus
    from kiln.tokenizer.patterns import NAMED_PATTERNS

    segments = [s.decode() for s in corpus.iter_segments([path], [], True, block_bytes=13)]
    assert len(segments) > 10
    import regex

    whole = regex.findall(NAMED_PATTERNS[pattern], text)
    pieces = [p for s in segments for p in regex.findall(NAMED_PATTERNS[pattern], s)]
    assert pieces == whole


def test_empty_special_token_is_refused(gpt2, tmp_path) -> None:
    path = tmp_path / "c.txt"
    path.write_text("some text")
    with pytest.raises(KilnError, match="non-empty"):
        train_bpe([path], 300, [""])
    with pytest.raises(KilnError, match="non-empty"):
        Tokenizer(gpt2.vocab, gpt2.merges, {EOT: 50256, "": 50257})


def test_allowed_special_as_a_string_is_a_clear_error(gpt2) -> None:
    with pytest.raises(ValueError, match="did you mean"):
        gpt2.encode("x", allowed_special=EOT)


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_on_each_backend(shared_data, tmp_path, backend) -> None:
    path = shared_data / "text" / "corpus.en"
    full = train_bpe([path], 700, [EOT], backend=backend)

    def interrupt(phase: str, done: int, total: int) -> None:
        if phase == "merge" and done > 400:
            raise KeyboardInterrupt

    state = tmp_path / "state"
    with pytest.raises(KeyboardInterrupt):
        train_bpe([path], 700, [EOT], backend=backend, checkpoint_dir=state, callback=interrupt)
    resumed = train_bpe([path], 700, [EOT], backend=backend, checkpoint_dir=state, resume=True)
    assert resumed.merges == full.merges


def test_corrupt_compressed_input_names_the_file(tmp_path) -> None:
    good = gzip.compress(b"hello world\n" * 1000)
    truncated = tmp_path / "cut.txt.gz"
    truncated.write_bytes(good[: len(good) // 2])
    with pytest.raises(KilnError, match=r"cut\.txt\.gz: corrupt or truncated compressed file"):
        train_bpe([truncated], 300)
    fake = tmp_path / "fake.txt.gz"
    fake.write_bytes(b"this is not gzip at all")
    with pytest.raises(KilnError, match=r"fake\.txt\.gz: corrupt or truncated"):
        train_bpe([fake], 300)


def test_jsonl_invalid_utf8_follows_the_policy(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": f"doc {i} hello"}).encode() for i in range(20)]
    lines[3] = b'{"text": "caf\xe9 ok"}'
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.warns(
        UnicodeWarning, match=r"d\.jsonl: 1 invalid UTF-8 sequence\(s\), first at line 4"
    ):
        train_bpe([path], 270)
    with pytest.raises(KilnError, match=r"d\.jsonl:4: invalid UTF-8"):
        train_bpe([path], 270, invalid_utf8="error")


def test_custom_pattern_keeps_unmatched_text(gpt2) -> None:
    tok = Tokenizer(gpt2.vocab, gpt2.merges, [EOT], pattern=r"\p{L}+")
    text = "hi there, 42!"
    assert tok.decode(tok.encode(text)) == text
    ref = Tokenizer(gpt2.vocab, gpt2.merges, [EOT], pattern=r"\p{L}+", backend="reference")
    assert ref.encode(text) == tok.encode(text)


@pytest.mark.parametrize("backend", BACKENDS)
def test_several_specials_some_absent(tmp_path, backend) -> None:
    specials = [EOT, "<|pad|>", "<|never|>"]
    text = "".join(f"story {i} about cats<|pad|>and dogs{EOT}" for i in range(300))
    path = tmp_path / "c.txt"
    path.write_text(text, encoding="utf-8")
    from kiln.tokenizer.patterns import GPT2_PATTERN

    tok = train_bpe([path], 330, specials, backend=backend)
    assert tok.merges == naive_train(text, 330, specials, GPT2_PATTERN)


def test_encode_batch_with_allowed_specials(gpt2) -> None:
    texts = [f"doc {i}<|endoftext|>next {i}<|endoftext|>" for i in range(50)] + ["", EOT]
    assert gpt2.encode_batch(texts, allowed_special="all", workers=2) == [
        gpt2.encode(t, allowed_special="all") for t in texts
    ]


CUT_ALPHABET = list("ab1. ,/\n\n\n\r\t'\u3000\u00a0\u0301é中。-\"")


@pytest.mark.parametrize("pattern", ["gpt2", "cl100k", "o200k"])
@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(CUT_ALPHABET), max_size=120),
    block=st.integers(min_value=1, max_value=17),
)
def test_streamed_pretokens_equal_whole_text_pretokens(pattern, text, block) -> None:
    import regex

    from kiln.tokenizer.patterns import NAMED_PATTERNS

    finder: CutFinder[bytes] = CutFinder([EOT], True, binary=True)
    data = text.encode()
    buf, segments = bytearray(), []
    for i in range(0, len(data), block):
        buf += data[i : i + block]
        cut = finder.last_cut(buf)
        if cut > 0:
            segments.append(bytes(buf[:cut]).decode())
            del buf[:cut]
            finder.reset()
    segments.append(bytes(buf).decode())
    compiled = regex.compile(NAMED_PATTERNS[pattern])
    assert [p for s in segments for p in compiled.findall(s)] == compiled.findall(text)
