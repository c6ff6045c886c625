"""C4's bad-words rule: a listed word removes the page only as a whole word, by the page's
language, with the match count as its score; lists and config errors are reported clearly."""

from __future__ import annotations

import pytest

from kiln.data.pipeline.config import load_pipeline_config
from kiln.data.pipeline.document import Document
from kiln.data.pipeline.filter.bad_words import (
    LIST_DIR,
    BadWordsConfig,
    BadWordsFilter,
    shipped_languages,
)
from kiln.errors import KilnError
from tests.data.pipeline.conftest import CLEAN_PROSE


def run(text: str, lang: str | None = None, **overrides) -> tuple[str | None, Document]:
    meta = {} if lang is None else {"lang": lang}
    doc = Document("d", text, "t", meta)
    return BadWordsFilter(BadWordsConfig(enabled=True, **overrides)).apply(doc), doc


def test_shipped_english_list_is_c4s():
    words = (LIST_DIR / "en.txt").read_text(encoding="utf-8").splitlines()
    assert len(words) == 377  # LDNOOBW en at commit 25e679f (403 lines at the latest)
    assert "ass" in words and "2g1c" in words
    assert {"en", "de", "fr", "ja", "zh"} <= set(shipped_languages())


def test_clean_page_is_kept():
    reason, doc = run(CLEAN_PROSE)
    assert reason is None
    assert doc.text == CLEAN_PROSE and "scores" not in doc.meta


def test_a_listed_word_removes_the_page_with_count_and_word():
    text = CLEAN_PROSE + "\nWhat a load of BULLSHIT, he said, bullshit again."
    reason, doc = run(text)
    assert reason == "bad_words.en"
    assert doc.meta["scores"]["bad_words"] == 2
    assert doc.meta["bad_word"] == "bullshit"


def test_a_listed_word_inside_a_longer_word_does_not_count():
    # "ass" is on the list; "assassin", "class" and "grass" are not bad words.
    reason, _ = run(CLEAN_PROSE + "\nThe assassin crossed the grass behind the class.")
    assert reason is None
    reason, _ = run(CLEAN_PROSE + "\nHe fell on his ass.")
    assert reason == "bad_words.en"


def test_the_pages_language_picks_the_list():
    german = "Du bist ein Arschloch, sagte er."
    assert run(german, lang="de")[0] == "bad_words.de"
    assert run(german, lang="en")[0] is None  # not an English word
    assert run(german, lang="xx")[0] is None  # no list for the language: kept
    assert run(german, default_language="de")[0] == "bad_words.de"  # no language stage


def test_unspaced_languages_match_inside_text():
    word = (LIST_DIR / "ja.txt").read_text(encoding="utf-8").splitlines()[0]
    assert run(f"今日は{word}です", lang="ja")[0] == "bad_words.ja"


def test_allow_and_custom_list(tmp_path):
    assert run("He fell on his ass.", allow=("ass",))[0] is None
    words = tmp_path / "w.txt"
    words.write_text("Frobnicate\n\n", encoding="utf-8")
    assert run("Do not frobnicate.", words_file=str(words))[0] == "bad_words.en"
    assert run("He fell on his ass.", words_file=str(words))[0] is None


def test_bad_lists_are_one_clear_error(tmp_path):
    with pytest.raises(KilnError, match=r"words_file = .*missing\.txt.*cannot read"):
        BadWordsFilter(BadWordsConfig(enabled=True, words_file=str(tmp_path / "missing.txt")))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(KilnError, match="no words in it"):
        BadWordsFilter(BadWordsConfig(enabled=True, words_file=str(empty)))
    config = tmp_path / "p.toml"
    config.write_text(
        '[[sources]]\nname = "a"\npaths = ["x"]\n[bad_words]\nenabled = true\n'
        'languages = ["en", "qq"]\n[tokenize]\ntokenizer = "t.json"\n',
        encoding="utf-8",
    )
    with pytest.raises(KilnError, match=r"p\.toml: \[bad_words\] languages: no LDNOOBW list"):
        load_pipeline_config(config)
