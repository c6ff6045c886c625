"""FineWeb's line-shape rules: one hand-made failing document per rule, the exact thresholds,
and agreement with datatrove's FineWebQualityFilter on real documents."""

from __future__ import annotations

import pickle

import pytest

from kiln.data.pipeline.document import Document
from kiln.data.pipeline.filter.quality_fineweb import FineWebConfig, FineWebFilter
from kiln.errors import KilnError

PROSE = [
    "The old lighthouse stood at the end of a long and narrow stone pier.",
    "Every evening the keeper climbed the stairs to light the great lamp.",
    "Ships far out at sea used its beam to find the safe channel home.",
    "In winter the waves broke over the pier and froze on the railings.",
    "Nobody in the village could remember a night when the light failed.",
]
CLEAN = "\n".join(PROSE)


def run(text: str, **overrides) -> str | None:
    return FineWebFilter(FineWebConfig(**overrides)).apply(Document("d", text, "t"))


def test_clean_document_passes():
    assert run(CLEAN) is None
    assert run(CLEAN, max_newline_token_ratio=0.3) is None


def test_line_punct_ratio():
    # 1 of 9 lines ends in terminal punctuation: 0.11 < 0.12 ...
    lines = [p.rstrip(".") for p in PROSE] + [f"{p.rstrip('.')} again" for p in PROSE[:3]]
    text = "\n".join([*lines, PROSE[0]])
    assert run(text) == "fineweb.line_punct_ratio"
    # ... and 1 of 8 is 0.125, enough.
    assert run("\n".join([*lines[:7], PROSE[0]])) is None


def test_terminal_punctuation_is_unicode_aware_and_ignores_trailing_spaces():
    lines = [p.rstrip(".") for p in PROSE]
    assert run("\n".join(lines)) == "fineweb.line_punct_ratio"
    # a CJK full stop ends a line too, and so does a period followed by spaces
    assert run("\n".join([*lines[:4], lines[4] + "。"])) is None
    assert run("\n".join([*lines[:4], lines[4] + ".   "])) is None
    assert run("\n".join([*lines[:4], lines[4] + "。"]), terminal_chars=".") == (
        "fineweb.line_punct_ratio"
    )


def test_short_line_ratio():
    short = [f"Item number {i}." for i in range(7)]  # 15 characters each
    text = "\n".join([*PROSE[:3], *short])  # 7 of 10 short: 0.7 > 0.67
    assert run(text) == "fineweb.short_line_ratio"
    assert run("\n".join([*PROSE[:4], *short[:6]])) is None  # 6 of 10: 0.6
    assert run(text, short_line_length=10) is None


def test_short_means_at_most_30_characters():
    exactly_30 = "A line of exactly thirty char."
    assert len(exactly_30) == 30
    text = "\n".join([*PROSE[:1], *[exactly_30[:-2] + f"{i}." for i in range(3)]])
    assert run(text) == "fineweb.short_line_ratio"  # 3 of 4 lines of 30 characters


def test_duplicate_line_chars():
    text = "\n".join([*PROSE, PROSE[0]])  # 68 of 402 characters repeat: 0.17
    assert run(text) == "fineweb.duplicate_line_chars"
    assert run(text, max_duplicate_line_char_ratio=0.2) is None


def test_duplicate_line_threshold_is_datatroves_001():
    text = "\n".join(["See you soon.", *PROSE, "See you soon."])  # 13 of 360 characters: 0.036
    assert run(text) == "fineweb.duplicate_line_chars"
    assert run(text, max_duplicate_line_char_ratio=0.1) is None  # the paper's Sec. 3.6 value


def test_newline_ratio_is_off_by_default():
    words = [f"word{i}" for i in range(12)]
    text = PROSE[0] + "\n" + "\n".join(" ".join(words[i : i + 2]) + "." for i in range(0, 12, 2))
    assert run(text, short_line_length=5) is None
    # 6 newlines, 33 tokens: 0.18 > 0.15
    assert run(text, short_line_length=5, max_newline_token_ratio=0.15) == ("fineweb.newline_ratio")


def test_stage_survives_pickling_for_worker_processes():
    copy = pickle.loads(pickle.dumps(FineWebFilter(FineWebConfig())))
    assert copy.apply(Document("d", CLEAN, "t")) is None
    lines = "\n".join(p.rstrip(".") for p in PROSE)
    assert copy.apply(Document("d", lines, "t")) == "fineweb.line_punct_ratio"


def test_empty_document():
    assert run(" \n\n  ") == "fineweb.empty"


def test_config_errors():
    with pytest.raises(KilnError, match=r"\[quality.fineweb\] min_line_punct_ratio"):
        FineWebConfig(min_line_punct_ratio=2.0)
    with pytest.raises(KilnError, match="short_line_length"):
        FineWebConfig(short_line_length=-1)


# ------------------------------------------------------------------ agreement with datatrove
def test_agrees_with_datatrove_on_real_documents(shared_data, filter_bench):
    bench = filter_bench
    texts = bench.load_docs(200, shared_data / "bench" / "en_10m.txt.gz")
    kiln = bench.kiln_filters()["fineweb"]
    peer = bench.datatrove_filters(bench.peer_tokenizer("nltk"))["fineweb"]
    ours = [kiln.apply(d) is None for d in bench.kiln_docs(texts)]
    theirs = [bench.datatrove_keep(peer.filter(d)) for d in bench.datatrove_docs(texts)]
    # Pinned at the measured agreement (1.0 on this sample): any disagreement fails.
    disagree = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    assert disagree == []
    assert 0 < sum(ours) < len(texts)
