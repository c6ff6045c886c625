"""Normalise: mojibake repaired, NFC, whitespace tidied, typography left alone."""

from __future__ import annotations

import re
import unicodedata

import ftfy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.data.pipeline.document import Document
from kiln.data.pipeline.filter.normalise import Normalise, NormaliseConfig, normalise_whitespace


@pytest.fixture(scope="module")
def stage() -> Normalise:
    return Normalise(NormaliseConfig())


def run(stage: Normalise, text: str) -> tuple[str | None, str]:
    doc = Document("d", text, "s", {})
    return stage.apply(doc), doc.text


def test_mojibake_is_repaired_and_curly_quotes_kept(stage: Normalise) -> None:
    broken = "The Mona Lisa doesnÃ¢â‚¬â„¢t have eyebrows."
    assert run(stage, broken) == (None, "The Mona Lisa doesn’t have eyebrows.")
    assert run(stage, "CafÃ© crÃ¨me")[1] == "Café crème"


def test_typography_is_not_imposed(stage: Normalise) -> None:
    text = "“Quoted” ‘text’, the ﬁnal word, ＡＢＣ，中文。"
    assert run(stage, text)[1] == text


def test_entities_controls_and_terminal_escapes(stage: Normalise) -> None:
    assert run(stage, "Fish &amp; chips")[1] == "Fish & chips"
    # Text containing markup keeps its entities (ftfy's "auto" rule).
    assert run(stage, "<b>Fish &amp; chips</b>")[1] == "<b>Fish &amp; chips</b>"
    assert run(stage, "bell\x07 and \x1b[31mred\x1b[0m text")[1] == "bell and red text"


def test_nfc(stage: Normalise) -> None:
    decomposed = "Cafe\u0301 and an\u0303o"
    assert run(stage, decomposed)[1] == "Café and año"
    assert unicodedata.is_normalized("NFC", run(stage, decomposed)[1])
    off = Normalise(NormaliseConfig(fix_text=False, nfc=False))
    assert run(off, decomposed)[1] == decomposed


def test_whitespace_rules() -> None:
    text = (
        "  Title  with   gaps\t\there \r\n"
        "\n\n\n\n"
        "def f(x):\r\n"
        "    return  x   # comment  \n"
        "no\u00a0break\u3000wide\n \n\t\n"
        "end\t"
    )
    assert normalise_whitespace(text) == (
        "Title with gaps here\n\ndef f(x):\n    return x # comment\nno break wide\n\nend"
    )


def test_empty_after_normalisation_is_removed(stage: Normalise) -> None:
    assert run(stage, " \x00\t\n\x7f \r\n") == ("normalise.empty", " \x00\t\n\x7f \r\n")
    assert run(stage, "ok") == (None, "ok")


def _reference_whitespace(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[^\S\n]+(?=\n|\Z)", "", text)
    text = re.sub(r"(?<=\S)[^\S\n]+", " ", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


pieces = st.sampled_from(
    ["a", "Z", "é", "e\u0301", " ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\x0c",
     "\x85", "\u2028", "&amp;", "&lt;", "<", "Ã©", "â€™", "Ã¢â‚¬â„¢", "\x1b[1m", "\x00", "中",
     "\ud7ff", "x", "1"]
)  # fmt: skip
texts = st.lists(pieces, max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_whitespace_matches_reference_and_is_idempotent(text: str) -> None:
    once = normalise_whitespace(text)
    assert once == _reference_whitespace(text)
    assert normalise_whitespace(once) == once


@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_line_skipping_fix_equals_ftfy(stage: Normalise, text: str) -> None:
    # The fast path must be exactly ftfy with the same settings.
    assert stage.fix_text(text) == ftfy.fix_text(text, config=stage._ftfy_config)


def test_stage_pickles(stage: Normalise) -> None:
    import pickle

    again = pickle.loads(pickle.dumps(stage))
    text = "CafÃ©  au\tlait \n\n\n\nok"
    assert run(again, text) == run(stage, text) == (None, "Café au lait\n\nok")
