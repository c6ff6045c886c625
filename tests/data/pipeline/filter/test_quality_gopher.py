"""Gopher quality and repetition rules: one hand-made failing document per rule, the tokenizer's
fast paths against the plain regexes, and agreement with datatrove on real documents."""

from __future__ import annotations

import dataclasses
import itertools
import pickle
import re
import string
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.data.pipeline.document import Document
from kiln.data.pipeline.filter.quality_gopher import (
    TOKEN_RE,
    WORD_RE,
    GopherQuality,
    GopherQualityConfig,
    GopherRepetition,
    GopherRepetitionConfig,
    count_tokens,
    count_words,
    duplicate_ngram_chars,
    split_tokens,
    top_ngram,
)
from kiln.errors import KilnError
from tests.data.pipeline.conftest import CLEAN_PROSE, filler_words

CLEAN = CLEAN_PROSE


words = filler_words


def quality(text: str, **overrides) -> str | None:
    return GopherQuality(GopherQualityConfig(**overrides)).apply(Document("d", text, "t"))


def repetition(text: str, **overrides) -> str | None:
    return GopherRepetition(GopherRepetitionConfig(**overrides)).apply(Document("d", text, "t"))


def test_clean_document_passes_both():
    assert quality(CLEAN) is None
    assert repetition(CLEAN) is None


# --------------------------------------------------------------------------- quality rules
def test_too_few_words():
    text = "The cat sat on the mat and that was the end of the story."
    assert quality(text) == "gopher_quality.word_count"
    assert quality(text, min_words=10) is None


def test_too_many_words():
    assert quality(CLEAN, max_words=100) == "gopher_quality.word_count"


def test_mean_word_length_too_long():
    text = " ".join(["the", "of"] + ["incomprehensibilities"] * 60) + "."
    assert quality(text) == "gopher_quality.mean_word_length"
    assert quality(text, max_mean_word_length=30.0) is None


def test_mean_word_length_too_short():
    text = " ".join(["the", "of"] + ["ab", "cd", "ef"] * 20) + "."
    assert quality(text) == "gopher_quality.mean_word_length"
    assert quality(text, min_mean_word_length=2.0) is None


def _plain_prose(n_words: int) -> str:
    """Lines of 10 words without punctuation but a final period; the/of/and included."""
    pool = ["the", "of", "and", *words(n_words)]
    lines = [" ".join(pool[i : i + 10]) + "." for i in range(0, n_words, 10)]
    return "\n".join(lines)


def test_hash_ratio():
    # 100 words, 10 periods, 14 '#': 14/124 > 0.1 while words with letters stay at 0.81.
    text = _plain_prose(100).replace(" of ", " #1 #2 #3 #4 #5 #6 #7 #8 #9 #10 #11 #12 #13 #14 of ")
    text = re.sub(r"#\d+", "#", text)
    assert quality(text) == "gopher_quality.hash_ratio"
    assert quality(text, max_hash_ratio=0.2) is None


def test_ellipsis_ratio():
    text = _plain_prose(100).replace(" of ", " of ... ", 1).replace(" and ", " ... and ", 1)
    text = text.replace(" ", " ... ", 12)  # mid-line ellipses only
    assert quality(text) == "gopher_quality.ellipsis_ratio"
    assert quality(text, max_ellipsis_ratio=0.5) is None


def test_bullet_lines():
    text = "\n".join("- " + line for line in CLEAN.splitlines())
    assert quality(text) == "gopher_quality.bullet_lines"
    assert quality(text, bullets=("*",)) is None
    assert quality(text, bullets=()) is None
    # 7 of 8 lines as bullets is 87.5%, under the 90% limit.
    assert quality("\n".join([*text.splitlines()[:7], CLEAN.splitlines()[7]])) is None


def test_ellipsis_lines():
    lines = CLEAN.splitlines()
    text = "\n".join(line[:-1] + "..." if i < 3 else line for i, line in enumerate(lines))
    assert quality(text) == "gopher_quality.ellipsis_lines"
    assert quality(text, max_ellipsis_lines_ratio=0.5) is None


def test_alpha_words():
    numbers = " ".join(str(1000 + i) for i in range(40))
    text = CLEAN + "\n" + numbers + "."
    assert quality(text) == "gopher_quality.alpha_words"
    assert quality(text, min_alpha_words_ratio=0.6) is None


def test_stop_words():
    text = CLEAN
    for word in ("the", "be", "to", "of", "and", "that", "have", "with"):
        text = re.sub(rf"\b{word}\b", "this", text)
    text = text.replace("this", "and", 1)  # one stop word left: not enough
    assert quality(text) == "gopher_quality.stop_words"
    assert quality(text, min_stop_words=1) is None


def test_stop_words_are_case_sensitive_like_datatrove():
    text = re.sub(r"\b(the|of|and|that|have|with|to)\b", "this", CLEAN)
    assert quality(text) == "gopher_quality.stop_words"
    assert quality(text.replace("this", "The").replace("This", "Of")) == "gopher_quality.stop_words"


def test_quality_config_errors_name_the_field():
    with pytest.raises(KilnError, match=r"quality.gopher_quality\] min_words"):
        GopherQualityConfig(min_words=10, max_words=5)
    with pytest.raises(KilnError, match="min_alpha_words_ratio"):
        GopherQualityConfig(min_alpha_words_ratio=1.5)
    with pytest.raises(KilnError, match="min_stop_words"):
        GopherQualityConfig(min_stop_words=9)


# ------------------------------------------------------------------------ repetition rules
def test_duplicate_paragraphs_count_not_chars():
    paragraphs = [" ".join(words(30, 30 * i)) + "." for i in range(6)]
    short = "Read on."
    text = "\n\n".join(itertools.chain.from_iterable((p, short) for p in paragraphs[:5]))
    text += "\n\n" + paragraphs[5]
    # 11 paragraphs, 4 repeat "Read on.": 0.36 of paragraphs, 1.3% of the characters.
    assert repetition(text) == "gopher_repetition.duplicate_paragraphs"
    assert repetition(text, max_duplicate_paragraph_fraction=0.4) == (
        "gopher_repetition.duplicate_lines"
    )


def test_duplicate_paragraph_chars():
    long = " ".join(words(60)) + "."
    others = [" ".join(words(10, 100 + 10 * i)) + "." for i in range(8)]
    text = "\n\n".join([long, *others, long])
    assert repetition(text) == "gopher_repetition.duplicate_paragraph_chars"


def test_duplicate_lines():
    lines = [" ".join(words(12, 12 * i)) + "." for i in range(8)]
    text = "\n".join(itertools.chain.from_iterable((line, "Yes.") for line in lines[:5]))
    text += "\n" + "\n".join(lines[5:])
    # 13 lines, 4 repeat "Yes.": over 0.3 of the lines, a tiny share of the characters.
    assert repetition(text) == "gopher_repetition.duplicate_lines"
    assert repetition(text, max_duplicate_line_fraction=0.5) is None


def test_duplicate_line_chars():
    long = " ".join(words(50)) + "."
    others = [" ".join(words(10, 100 + 10 * i)) + "." for i in range(10)]
    text = "\n".join([long, *others, long])
    assert repetition(text) == "gopher_repetition.duplicate_line_chars"
    assert repetition(text, max_duplicate_line_char_fraction=0.5, duplicate_ngram_sizes=(),
                      duplicate_ngram_max_fractions=()) is None  # fmt: skip


def _interleave(phrase: str, times: int, filler_per_gap: int) -> str:
    filler = iter(words(times * filler_per_gap + filler_per_gap))
    parts = []
    for _ in range(times):
        parts.extend(itertools.islice(filler, filler_per_gap))
        parts.append(phrase)
    parts.extend(itertools.islice(filler, filler_per_gap))
    return " ".join(parts)


@pytest.mark.parametrize(
    ("phrase", "times", "gap", "reason"),
    [
        # "alphabetical order" is 18 characters: 30 of them in 1,034 characters is 0.52.
        ("alphabetical order", 30, 3, "gopher_repetition.top_2gram"),
        # The most frequent 2-gram ("ab cdefghijk", first of the tied ones) is 0.15 of the
        # 2,004 characters, under 0.20; the 3-gram is 0.27, over 0.18.
        ("ab cdefghijk lmnopqrst", 25, 11, "gopher_repetition.top_3gram"),
        # 2-gram 0.04, 3-gram 0.13 (under 0.18), 4-gram 0.21 (over 0.16).
        ("ab cd efghijklm nopqrstuv", 25, 18, "gopher_repetition.top_4gram"),
    ],
)
def test_top_ngrams(phrase, times, gap, reason):
    text = _interleave(phrase, times, gap)
    assert repetition(text) == reason
    n = len(phrase.split())
    relaxed = dict(top_ngram_sizes=(2, 3, 4), top_ngram_max_fractions=(0.9, 0.9, 0.9))
    assert repetition(text, **relaxed) is None
    # the rule that fired is the n-gram's own size: a smaller one stays under its limit
    tokens = split_tokens(text)
    count, chars = top_ngram(tokens, n)
    assert count == times
    assert count * chars / len(text) > dict(zip((2, 3, 4), (0.2, 0.18, 0.16), strict=True))[n]


def _with_repeated_passage(n_passage: int, low: float, high: float) -> str:
    """A single line where one passage of n_passage words occurs twice; the second copy's
    characters are a fraction in (low, high] of the text."""
    passage = words(n_passage, 5000)
    for n_filler in range(10, 2000):
        filler = words(n_filler)
        half = n_filler // 2
        text = " ".join(filler[:half] + passage + filler[half:] + passage) + "."
        fraction = sum(map(len, passage)) / len(text)
        if low < fraction <= high:
            return text
    raise AssertionError("no filler size lands in the window")


@pytest.mark.parametrize(
    ("n", "low", "high"),
    [(5, 0.15, 0.2), (6, 0.14, 0.15), (7, 0.13, 0.14), (8, 0.12, 0.13), (9, 0.11, 0.12),
     (10, 0.10, 0.11)],
)  # fmt: skip
def test_duplicate_ngrams(n, low, high):
    # A repeated 12-word passage covers the same characters for every n <= 12, so the first
    # size whose threshold is under that fraction is the one that fires.
    text = _with_repeated_passage(12, low, high)
    assert repetition(text) == f"gopher_repetition.duplicate_{n}gram"


def test_repetition_empty_document():
    assert repetition("  \n ") == "gopher_repetition.empty"


def test_repetition_config_errors_name_the_field():
    with pytest.raises(KilnError, match="top_ngram_max_fractions has 2"):
        GopherRepetitionConfig(top_ngram_max_fractions=(0.2, 0.18))
    with pytest.raises(KilnError, match="duplicate_ngram_sizes"):
        GopherRepetitionConfig(duplicate_ngram_sizes=(5, 5, 6, 7, 8, 9))
    with pytest.raises(KilnError, match="max_duplicate_line_fraction"):
        GopherRepetitionConfig(max_duplicate_line_fraction=-0.1)


def test_stages_survive_pickling_for_worker_processes():
    for stage in (GopherQuality(GopherQualityConfig()), GopherRepetition(GopherRepetitionConfig())):
        copy = pickle.loads(pickle.dumps(stage))
        for text in (CLEAN, "too short"):
            assert copy.apply(Document("d", text, "t")) == stage.apply(Document("d", text, "t"))


def test_configs_are_frozen_and_hashable():
    cfg = GopherRepetitionConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.enabled = False  # type: ignore[misc]
    assert hash(cfg) == hash(GopherRepetitionConfig())


# ---------------------------------------------------------------- tokenizer and n-gram maths
def test_tokens_of_a_sentence():
    text = "Don't stop... it's 3.14 -- or 1,000 (roughly)!'Quoted' __init__ naïve"
    assert split_tokens(text) == [
        "Don", "'t", "stop", "...", "it", "'s", "3.14", "--", "or", "1,000", "(", "roughly",
        ")", "!", "'Quoted", "'", "__", "init", "__", "naïve",
    ]  # fmt: skip
    words_, n_symbols, n_numbers = count_words(text)
    assert sorted(words_) == sorted(t for t in split_tokens(text) if t[-1].isalnum())
    assert (n_symbols, n_numbers) == (8, 2)


TEXT = st.text(
    alphabet=st.sampled_from(string.ascii_letters[:6] + string.digits[:3] + " \n\t.,-_'’#!é…"),
    max_size=80,
)


@given(TEXT)
@settings(max_examples=300, deadline=None)
def test_fast_paths_equal_the_plain_regexes(text):
    assert split_tokens(text) == TOKEN_RE.findall(text)
    assert count_tokens(text) == len(TOKEN_RE.findall(text))
    words_, n_symbols, n_numbers = count_words(text)
    assert sorted(words_) == sorted(WORD_RE.findall(text))
    assert len(words_) + n_symbols == len(TOKEN_RE.findall(text))
    assert n_numbers == sum(not any(c.isalpha() for c in w) for w in words_)


def _duplicate_chars_reference(tokens: list[str], n: int) -> int:
    covered = set()
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    for i, gram in enumerate(grams):
        if gram in grams[:i]:
            covered.update(range(i, i + n))
    return sum(len(tokens[i]) for i in covered)


@given(st.lists(st.sampled_from(["a", "bb", "ccc", "."]), max_size=40), st.integers(1, 6))
@settings(max_examples=300, deadline=None)
def test_duplicate_ngram_chars_matches_its_definition(tokens, n):
    got = duplicate_ngram_chars(tokens, n)
    assert got == _duplicate_chars_reference(tokens, n)
    # a token covered by a repeated (n+1)-gram is covered by a repeated n-gram: the bound the
    # filter relies on to stop early
    assert duplicate_ngram_chars(tokens, n + 1) <= got


@given(st.lists(st.sampled_from(["a", "bb", "ccc", "."]), max_size=40), st.integers(1, 5))
@settings(max_examples=300, deadline=None)
def test_top_ngram_matches_its_definition(tokens, n):
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        assert top_ngram(tokens, n) == (0, 0)
        return
    counts = Counter(grams)
    best = max(counts.values())
    first = next(g for g in grams if counts[g] == best)
    assert top_ngram(tokens, n) == (best, len(" ".join(first)))


# ------------------------------------------------------------------ agreement with datatrove
# Pinned at the measured agreement: the documents on which the verdicts differ, by index in the
# 200-document sample (repetition: 16 and 175 sit at a top-n-gram threshold, where nltk's and
# kiln's word splits differ by a token). A new disagreement fails; a fixed one only shrinks this.
KNOWN_DISAGREEMENTS = {"gopher_quality": set(), "gopher_repetition": {16, 175}}


@pytest.mark.parametrize("name", ["gopher_quality", "gopher_repetition"])
def test_agrees_with_datatrove_on_real_documents(shared_data, name, filter_bench):
    bench = filter_bench
    texts = bench.load_docs(200, shared_data / "bench" / "en_10m.txt.gz")
    assert len(texts) == 200
    kiln = bench.kiln_filters()[name]
    peer = bench.datatrove_filters(bench.peer_tokenizer("nltk"))[name]
    if name == "gopher_quality":
        # The letters rule differs on purpose (see test_alpha_words_counts_words_not_punctuation);
        # every other rule is compared.
        kiln = GopherQuality(GopherQualityConfig(min_alpha_words_ratio=0.0))
        peer.max_non_alpha_words_ratio = None  # datatrove's name for the same threshold
    ours = [kiln.apply(d) is None for d in bench.kiln_docs(texts)]
    theirs = [bench.datatrove_keep(peer.filter(d)) for d in bench.datatrove_docs(texts)]
    disagree = {i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b}
    assert disagree <= KNOWN_DISAGREEMENTS[name], sorted(disagree)
    assert 0 < sum(ours) < len(texts)  # the sample exercises both outcomes


def test_alpha_words_counts_words_not_punctuation(filter_bench):
    """Dialogue-heavy prose keeps its letters ratio: punctuation tokens are not words."""
    bench = filter_bench
    story = (
        'Tom said, "Hi, Sam!" Sam said, "Hi, Tom! Can we play?" Tom said, "Yes, but not now." '
    ) * 6 + "Then they went to the park, and they had a lot of fun with the big red ball."
    (doc,) = bench.kiln_docs([story])
    assert GopherQuality(GopherQualityConfig()).apply(doc) is None
    peer = bench.datatrove_filters(bench.peer_tokenizer("nltk"))["gopher_quality"]
    (theirs,) = bench.datatrove_docs([story])
    assert peer.filter(theirs) == (False, "gopher_below_alpha_threshold")
