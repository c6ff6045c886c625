"""Language: real English/German/French text identified; threshold and kept-set behaviour."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.data.pipeline.document import Document
from kiln.data.pipeline.filter.language import LanguageConfig, LanguageFilter
from kiln.errors import KilnError

# Written for this test.
FRENCH = (
    "La rivière traverse la vallée pendant deux cents kilomètres avant de rejoindre la mer. "
    "Les paysans cultivent l'orge et le seigle sur ses rives depuis des siècles, et plusieurs "
    "moulins à eau sont encore debout près des barrages."
)


@pytest.fixture(scope="module")
def english_only() -> LanguageFilter:
    return LanguageFilter(LanguageConfig())


@pytest.fixture(scope="module")
def english_lines(shared_data: Path) -> list[str]:
    lines = (shared_data / "text" / "corpus.en").read_text(encoding="utf-8").splitlines()
    return [line for line in lines if len(line.split()) >= 15][:40]


@pytest.fixture(scope="module")
def german(shared_data: Path) -> str:
    return (shared_data / "text" / "german.txt").read_text(encoding="utf-8").strip()


def run(stage: LanguageFilter, text: str) -> tuple[str | None, dict]:
    doc = Document("d", text, "s", {"file": "f"})
    return stage.apply(doc), doc.meta


def test_english_sentences_are_english(english_only: LanguageFilter, english_lines) -> None:
    labels = [english_only.identify(line)[0] for line in english_lines]
    assert labels.count("en") >= 0.95 * len(labels)
    reason, meta = run(english_only, " ".join(english_lines[:10]))
    assert reason is None
    assert meta["lang"] == "en" and meta["lang_score"] >= 0.65


def test_german_and_french_are_removed_from_english(english_only, german: str) -> None:
    reason, meta = run(english_only, german)
    assert (reason, meta["lang"]) == ("language.other", "de")
    reason, meta = run(english_only, FRENCH)
    assert (reason, meta["lang"]) == ("language.other", "fr")
    assert meta["lang_score"] > 0.9


def test_kept_languages_and_annotate_only(german: str) -> None:
    both = LanguageFilter(LanguageConfig(languages=("de", "fr")))
    assert run(both, german)[0] is None and run(both, FRENCH)[0] is None
    annotate = LanguageFilter(LanguageConfig(languages=()))
    reason, meta = run(annotate, "love")
    assert reason is None and meta["lang"] != "" and 0.0 <= meta["lang_score"] <= 1.0


def test_threshold_decides_low_scores(english_only: LanguageFilter) -> None:
    text = "We like it."  # short: English, but the model is unsure
    lang, score = english_only.identify(text)
    assert lang == "en" and score < 0.65
    assert run(english_only, text)[0] == "language.low_score"
    strict = LanguageFilter(LanguageConfig(threshold=min(score + 0.01, 1.0)))
    lenient = LanguageFilter(LanguageConfig(threshold=max(score - 0.01, 0.0)))
    assert run(strict, text)[0] == "language.low_score"
    assert run(lenient, text)[0] is None
    assert run(strict, text)[1]["lang_score"] == round(score, 4)


def test_only_a_prefix_is_classified(english_lines, german: str) -> None:
    text = " ".join(english_lines[:5]) + "\n" + (german + "\n") * 20
    assert LanguageFilter(LanguageConfig(max_chars=0)).identify(text)[0] == "de"
    prefix = len(" ".join(english_lines[:5]))
    assert LanguageFilter(LanguageConfig(max_chars=prefix)).identify(text)[0] == "en"


def test_bad_settings_are_clear_errors() -> None:
    with pytest.raises(KilnError, match=r"language\.backend.*fasttext"):
        LanguageFilter(LanguageConfig(backend="fasttext"))
    with pytest.raises(KilnError, match=r"language\.languages: xx"):
        LanguageFilter(LanguageConfig(languages=("en", "xx")))
    with pytest.raises(KilnError, match=r"language\.threshold"):
        LanguageFilter(LanguageConfig(threshold=1.5))


def test_vectorised_walk_matches_py3langid(shared_data: Path, english_lines, german) -> None:
    from kiln.data.pipeline.filter.language import VectorisedLangid, langid_model
    from kiln.data.pipeline.read.readers import ReadIssues, iter_records

    reference = langid_model()
    fast = VectorisedLangid(reference)
    assert fast._depth == 6  # py3langid's longest byte n-gram
    multi = iter_records(
        str(shared_data / "bench" / "multi_10m.txt.gz"), "txt", issues=ReadIssues(), stop=150
    )
    samples = [d.text[:1500] for d in multi if d] + english_lines + [german, FRENCH]
    samples += ["", "a", "SHOUTING IN CAPITALS", "12345", "🦊🦊", "e\u0301te\u0301"]
    for text in samples:
        lang, score = fast.classify(text)
        ref_lang, ref_score = reference.classify(text)
        assert lang == ref_lang, text[:80]
        assert score == pytest.approx(ref_score, abs=1e-5), text[:80]


def test_stage_pickles_as_its_config(german: str) -> None:
    import pickle

    stage = LanguageFilter(LanguageConfig(languages=("de",), threshold=0.5))
    blob = pickle.dumps(stage)
    assert len(blob) < 2_000  # the model is not shipped to workers
    again = pickle.loads(blob)
    assert again.config == stage.config
    assert run(again, german) == run(stage, german)
