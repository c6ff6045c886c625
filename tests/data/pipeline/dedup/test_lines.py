"""Line/paragraph dedup: units, keys, the count over documents, and the removal."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.data.pipeline.dedup.lines import (
    LineDedupConfig,
    document_keys,
    frequent_keys,
    remove_units,
    split_units,
)
from kiln.errors import KilnError

LINES = LineDedupConfig(enabled=True, min_documents=2, min_chars=5)
PARAGRAPHS = LineDedupConfig(enabled=True, unit="paragraph", min_documents=2, min_chars=5)


@pytest.mark.parametrize("unit", ["line", "paragraph"])
def test_units_join_back_to_the_text(unit: str) -> None:
    text = "one line\ntwo line\n\n  \nthird para\nstill third\n\nlast"
    assert "".join(split_units(text, unit)) == text


def test_paragraphs_end_at_a_blank_line() -> None:
    pieces = split_units("a b\nc d\n\ne f\n \n\ng", "paragraph")
    assert [p.strip() for p in pieces] == ["a b\nc d", "e f", "g"]


def test_a_document_counts_a_unit_once_and_short_units_not_at_all() -> None:
    keys = document_keys("Share this story.\nShare this story.\nOk.\n\nAnother line here.", LINES)
    assert len(keys) == 2  # the repeat once, "Ok." too short, the blank line never


def test_units_in_enough_documents_are_frequent() -> None:
    rows = np.array([[7, 0], [7, 1], [8, 1], [9, 2], [7, 2]], dtype=np.int64)
    hits, keys = frequent_keys(rows, 3)
    assert keys.tolist() == [7] and hits[:, 1].tolist() == [0, 1, 2]
    assert frequent_keys(rows, 4)[1].tolist() == []


def test_removal_takes_every_copy_and_keeps_the_rest() -> None:
    text = "Story line one.\nSubscribe now!\nStory line two.\n  Subscribe now!  "
    frequent = set(document_keys("Subscribe now!", LINES).tolist())
    out, removed = remove_units(text, frequent, LINES)
    assert removed == 2 and out == "Story line one.\nStory line two."
    assert remove_units(text, set(), LINES) == (text, 0)


def test_paragraph_mode_removes_whole_paragraphs_only() -> None:
    footer = "Copyright 2020.\nAll rights reserved."
    text = f"A story.\nIt ends.\n\n{footer}"
    frequent = set(document_keys(footer, PARAGRAPHS).tolist())
    assert remove_units(text, frequent, PARAGRAPHS) == ("A story.\nIt ends.", 1)
    line_keys = set(document_keys("All rights reserved.", LINES).tolist())
    assert remove_units(text, line_keys, PARAGRAPHS) == (text, 0)  # a line is not a paragraph


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"unit": "word"}, "dedup.lines.unit"), ({"min_documents": 1}, "dedup.lines.min_documents"),
     ({"min_chars": 0}, "dedup.lines.min_chars")],
)  # fmt: skip
def test_bad_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(KilnError, match=field):
        LineDedupConfig(**kwargs)
