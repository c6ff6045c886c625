"""Every Gopher, C4 and FineWeb rule fires, in kiln and in datatrove, on a document made for it.

On real documents only a few rules ever fire (word count, stop words, C4's sentence count,
FineWeb's line punctuation), so agreement there says nothing of the rest. Each document here
trips one rule (the first the filter checks that it fails) and both implementations must name it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.data.pipeline.conftest import CLEAN_PROSE, filler_words

CLEAN = CLEAN_PROSE
LINES = CLEAN.splitlines()
# Gopher's duplicate n-gram character limits (n = 4 stands for "no lower rule fired").
DUP_LIMITS = {4: 0.17, 5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}


words = filler_words


def _top_ngram(n: int) -> str:
    """One n-gram (short words, then a 12-letter one) 5 times in 60 filler words."""
    gram = " ".join([*["xa", "xe", "xi"][: n - 1], "q" * 12])
    filler = words(60, 500)
    return " ".join(" ".join([gram, *filler[12 * i : 12 * (i + 1)]]) for i in range(5))


def _duplicate_ngrams(n: int) -> str:
    """A 2n-word phrase twice in filler, its second copy between the n and n-1 rule's limits.

    2n words: datatrove's greedy count (n words at a time) and the paper's (every covered word)
    then agree; the fraction is 4·2n letters over the text's length, words of 4 letters + space.
    """
    m, target = 2 * n, (DUP_LIMITS[n] + DUP_LIMITS[n - 1]) / 2
    n_filler = round((4 * m / target + 1) / 5) - 2 * m
    phrase, filler = words(m, 2000), words(n_filler, 4000)
    half = n_filler // 2
    return " ".join(filler[:half] + phrase + filler[half:] + phrase)


def _two_lines_twice() -> str:
    return "\n".join(LINES[:2])


GOPHER_QUALITY = [
    ("word_count", "gopher_short_doc", "The cat sat on the mat and that was the end of the story."),
    ("word_count", "gopher_long_doc", "the " * 100_001),
    ("mean_word_length", "gopher_above_avg_threshold", " ".join(["the", "of"] + ["incomprehensibilities"] * 60) + "."),
    ("mean_word_length", "gopher_below_avg_threshold", " ".join(["the", "of"] + ["ab", "cd", "ef"] * 20) + "."),
    ("hash_ratio", "gopher_too_many_hashes", CLEAN.replace(" the ", " # # ", 20)),
    ("ellipsis_ratio", "gopher_too_many_ellipsis", CLEAN.replace(" the ", " ... ", 20)),
    ("bullet_lines", "gopher_too_many_bullets", "\n".join("- " + line for line in LINES)),
    ("ellipsis_lines", "gopher_too_many_end_ellipsis", "\n".join(line[:-1] + "..." if i < 3 else line for i, line in enumerate(LINES))),
    ("alpha_words", "gopher_below_alpha_threshold", CLEAN + "\n" + " ".join(str(1000 + i) for i in range(40)) + "."),
    ("stop_words", "gopher_enough_stop_words", CLEAN.replace(" the ", " this ").replace("The ", "This ").replace(" of ", " in ").replace(" and ", " or ").replace(" that ", " which ").replace(" have ", " hold ").replace(" with ", " by ").replace(" to ", " at ")),
]  # fmt: skip
GOPHER_REPETITION = [
    ("duplicate_paragraphs", "dup_para_frac", "\n\n".join([_two_lines_twice(), LINES[2], _two_lines_twice(), _two_lines_twice()])),
    ("duplicate_paragraph_chars", "dup_para_char_frac", "\n\n".join([CLEAN[:400], *LINES[4:], CLEAN[:400]])),
    ("duplicate_lines", "dup_line_frac", "\n".join([LINES[0], LINES[1], LINES[0], LINES[0]])),
    ("duplicate_line_chars", "dup_line_char_frac", "\n".join([CLEAN[:400].replace("\n", " "), *(" ".join(words(8, 100 * i)) for i in range(8)), CLEAN[:400].replace("\n", " ")])),
    ("top_2gram", "top_2_gram", " ".join(w + " big dog" for w in words(40))),
    ("top_3gram", "top_3_gram", _top_ngram(3)),
    ("top_4gram", "top_4_gram", _top_ngram(4)),
    *((f"duplicate_{n}gram", f"duplicated_{n}_n_grams", _duplicate_ngrams(n)) for n in range(5, 11)),
]  # fmt: skip
C4_PAGE = [
    ("too_few_sentences", "too_few_sentences", "The cat sat on the mat all day long."),
    ("lorem_ipsum", "lorem_ipsum", CLEAN + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit."),
    ("curly_bracket", "curly_bracket", CLEAN + "\nThe function body is { return x; } and that is all."),
]  # fmt: skip
C4_LINES = [  # (rule, the line it drops from CLEAN + line)
    ("too_long_word", "This line holds a word " + "a" * 1001 + " in the middle."),
    ("no_end_mark", "This line has no end mark at all here"),
    ("too_few_words", "Too few words."),
    ("javascript", "Please enable JavaScript to view this page properly."),
    ("policy", "Read our privacy policy and terms of use for more details."),
]
FINEWEB = [
    ("line_punct_ratio", "line_punct_ratio", "\n".join(line[:-1] for line in LINES)),
    ("short_line_ratio", "short_line_ratio", CLEAN + "\n" + "\n".join(f"Item {w}." for w in words(20))),
    ("duplicate_line_chars", "char_dup_ratio", "\n".join([*LINES, LINES[0], LINES[1]])),
    ("newline_ratio", "list_ratio", "\n".join(f"{a * 4} {b * 4}." for a, b in zip(*[iter(words(60))] * 2, strict=True))),
]  # fmt: skip


@pytest.fixture(scope="module")
def sides(filter_bench: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The benchmark's kiln and datatrove filters, configured alike (bench/data_filters.py)."""
    peer = filter_bench.datatrove_filters(filter_bench.peer_tokenizer("nltk"))
    return filter_bench, filter_bench.kiln_filters(), peer


def _verdicts(sides: Any, stage: str, text: str) -> tuple[str | None, Any, Any, Any]:
    bench, kiln, peer = sides
    (ours,) = bench.kiln_docs([text])
    (theirs,) = bench.datatrove_docs([text])
    return kiln[stage].apply(ours), copy.deepcopy(peer[stage]).filter(theirs), ours, theirs


def test_clean_passes_every_filter_in_both(sides: Any) -> None:
    for stage in ("gopher_quality", "gopher_repetition", "c4", "fineweb"):
        ours, theirs, a, b = _verdicts(sides, stage, CLEAN)
        assert ours is None and theirs is True, (stage, ours, theirs)
        assert a.text == b.text == CLEAN


@pytest.mark.parametrize(
    ("stage", "cases"),
    [("gopher_quality", GOPHER_QUALITY), ("gopher_repetition", GOPHER_REPETITION),
     ("c4", C4_PAGE), ("fineweb", FINEWEB)],
    ids=["gopher_quality", "gopher_repetition", "c4", "fineweb"],
)  # fmt: skip
def test_every_rule_fires_in_both(
    sides: Any, stage: str, cases: list[tuple[str, str, str]]
) -> None:
    wrong = []
    for rule, peer_reason, text in cases:
        ours, theirs, _, _ = _verdicts(sides, stage, text)
        if (ours, theirs) != (f"{stage}.{rule}", (False, peer_reason)):
            wrong.append((rule, ours, theirs))
    assert not wrong, wrong


@pytest.mark.parametrize(("rule", "line"), C4_LINES, ids=[r for r, _ in C4_LINES])
def test_every_c4_line_rule_drops_the_line_in_both(sides: Any, rule: str, line: str) -> None:
    ours, theirs, a, b = _verdicts(sides, "c4", CLEAN + "\n" + line)
    assert ours is None and theirs is True, (ours, theirs)
    assert a.meta["c4_lines_removed"] == {rule: 1}
    assert a.text == b.text == CLEAN  # datatrove dropped the same line, and only it
