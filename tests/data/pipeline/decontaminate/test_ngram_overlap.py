"""Decontamination: planted passages from the real evaluation files are cut out, GPT-3 style."""

from __future__ import annotations

import bz2
import gzip
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.config import ConfigError
from kiln.data.pipeline.decontaminate.ngram_overlap import (
    DecontamConfig,
    Decontaminator,
    EvalNgramIndex,
    read_eval_items,
    task_name,
)
from kiln.data.pipeline.dedup.minhash import (
    hash_word_ngrams,
    normalized_word_spans,
    normalized_words,
)
from kiln.data.pipeline.document import Document
from kiln.errors import KilnError

EOT_LINE = "\n<|endoftext|>\n"
TASKS = {
    "arc_challenge",
    "arc_easy",
    "copa",
    "hellaswag",
    "lambada_openai",
    "openbook_qa",
    "piqa",
    "winogrande",
}


@pytest.fixture(scope="module")
def eval_dir(shared_data: Path) -> Path:
    return shared_data / "eval"


@pytest.fixture(scope="module")
def index(eval_dir: Path) -> EvalNgramIndex:
    return EvalNgramIndex.from_files(sorted(str(p) for p in eval_dir.iterdir()))


@pytest.fixture(scope="module")
def filler(shared_data: Path) -> list[str]:
    """Real documents of at least 1,500 characters (none overlaps an evaluation set)."""
    with gzip.open(shared_data / "bench" / "en_10m.txt.gz", "rt", encoding="utf-8") as f:
        docs = f.read(2_000_000).split(EOT_LINE)
    return [d for d in docs if len(d) >= 1500][:40]


def hellaswag_passage(eval_dir: Path) -> str:
    """The second HellaSwag item: its context (after the activity label) and gold ending."""
    with bz2.open(eval_dir / "hellaswag_val.txt.bz2", "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(12)][6:]
    context = lines[0].rstrip("\n").split(": ", 1)[1]
    return f"{context} {lines[2 + int(lines[1])].strip()}"


def jsonl_item(eval_dir: Path, name: str, number: int) -> dict:
    with open(eval_dir / name, encoding="utf-8") as f:
        return json.loads(f.readlines()[number])


def arc_passage(eval_dir: Path) -> str:
    """An ARC-Challenge question as it would appear in the wild (no "Question:" prefix)."""
    item = jsonl_item(eval_dir, "arc_challenge.jsonl", 2)
    return f"{item['query'].removeprefix('Question: ')} {item['choices'][item['gold']]}"


def lambada_passage(eval_dir: Path) -> str:
    item = jsonl_item(eval_dir, "lambada_openai.jsonl", 1)
    return f"{item['context']} {item['continuation']}."


def test_index_reads_every_shared_eval_file(index: EvalNgramIndex) -> None:
    assert set(index.tasks) == TASKS
    assert index.stats["hellaswag"].items == 10042
    assert index.stats["lambada_openai"].items == 5153
    assert index.stats["winogrande"].items == 1267
    assert all(index.stats[t].ngrams > 0 for t in TASKS)
    assert index.stats["copa"].items_too_short > 0  # COPA items are mostly < 13 words


@pytest.mark.parametrize(
    ("make_passage", "task"),
    [
        (hellaswag_passage, "hellaswag"),
        (arc_passage, "arc_challenge"),
        (lambada_passage, "lambada_openai"),
    ],
)
def test_planted_passage_is_cut_out_with_its_window(
    index: EvalNgramIndex,
    eval_dir: Path,
    filler: list[str],
    make_passage: Callable[[Path], str],
    task: str,
) -> None:
    passage = make_passage(eval_dir)
    before, after = filler[0][:1200], filler[1][:1200]
    text = f"{before}\n{passage}\n{after}"
    doc = Document("d", text, "web", {})
    assert Decontaminator(DecontamConfig(snap="none"), index).apply(doc) is None
    assert doc.meta["decontam"] == {task: 1}
    start = len(before) + 1
    end = start + len(passage)  # the passage ends in a word character or "."
    expected = f"{text[: start - 200].strip()}\n\n{text[end + 200 :].strip()}"
    assert doc.text == expected
    (cut,) = doc.meta["decontam_cuts"]
    assert (cut["start"], cut["chars"]) == (start - 200, end - start + 400)
    assert cut["words"] == len(text[start - 200 : end + 200].split())
    assert cut["kind"] == "match" and list(cut["matched"]) == [task]


def test_cuts_snap_to_word_and_sentence_boundaries(
    index: EvalNgramIndex, eval_dir: Path, filler: list[str]
) -> None:
    passage = hellaswag_passage(eval_dir)
    before = " ".join(filler[0].split())[:1200].strip()
    after = " ".join(filler[1].split())[:1200].strip()
    text = f"{before}\n{passage}\n{after}"
    words = set(text.split())
    for snap in ("word", "sentence"):
        doc = Document("d", text, "web", {})
        assert Decontaminator(DecontamConfig(snap=snap), index).apply(doc) is None
        head, tail = doc.text.split("\n\n")
        # Every word left is a whole word of the original: no cut lands inside one.
        assert set(doc.text.split()) <= words
        assert text.startswith(head) and text.endswith(tail)
        (cut,) = doc.meta["decontam_cuts"]
        assert cut["chars"] >= len(passage) + 400
        assert cut["matched"] == {"hellaswag": [1]}  # the second item of the file
        if snap == "sentence":
            assert head[-1] in ".!?\"'" and tail[0].isupper()
    # Without snapping, the 200-character windows end mid-word here (the case the snap fixes).
    doc = Document("d", text, "web", {})
    Decontaminator(DecontamConfig(snap="none"), index).apply(doc)
    assert not set(doc.text.split()) <= words


def test_clean_documents_are_untouched(index: EvalNgramIndex, filler: list[str]) -> None:
    stage = Decontaminator(DecontamConfig(), index)
    for i, text in enumerate(filler):
        doc = Document(str(i), text, "web", {"file": "x"})
        assert stage.apply(doc) is None
        assert doc.text == text and doc.meta == {"file": "x"}


def test_document_split_into_too_many_pieces_is_dropped(
    index: EvalNgramIndex, eval_dir: Path, filler: list[str]
) -> None:
    passage = lambada_passage(eval_dir)
    # 10 passages between 11 chunks of 500 characters: the windows leave 11 pieces.
    chunks = [filler[k][:500] for k in range(11)]
    text = chunks[0] + "".join(f"\n{passage}\n{chunk}" for chunk in chunks[1:])
    doc = Document("d", text, "web", {})
    stage = Decontaminator(DecontamConfig(), index)
    assert stage.apply(doc) == "decontaminate.too_many_pieces"
    assert doc.meta["decontam"] == {"lambada_openai": 10}
    # With a higher limit the same document survives as its long-enough pieces.
    doc = Document("d", text, "web", {})
    loose = Decontaminator(DecontamConfig(max_pieces=11, min_piece_chars=50), index)
    assert loose.apply(doc) is None
    assert all(chunk[230:270] in doc.text for chunk in chunks[1:-1])  # words snap outwards
    assert "Shane gripped" not in doc.text


def test_document_that_is_all_passage_is_dropped(index: EvalNgramIndex, eval_dir: Path) -> None:
    doc = Document("d", hellaswag_passage(eval_dir), "web", {})
    assert Decontaminator(DecontamConfig(), index).apply(doc) == "decontaminate.empty"
    assert doc.meta["decontam"] == {"hellaswag": 1}


def test_stage_loads_its_index_from_the_config(eval_dir: Path) -> None:
    cfg = DecontamConfig(eval_files=(str(eval_dir / "arc_easy.jsonl"),))
    stage = Decontaminator(cfg)
    assert stage.index.tasks == ["arc_easy"]
    assert Decontaminator(cfg).index is stage.index  # loaded once per process


def test_task_names() -> None:
    assert task_name("/x/hellaswag_val.txt.bz2") == "hellaswag"
    assert task_name("arc_easy.jsonl") == "arc_easy"
    assert task_name("lambada_openai.jsonl.gz") == "lambada_openai"
    assert task_name("my_test.jsonl") == "my"
    assert task_name("_test.jsonl") == "_test"


def test_read_eval_items_formats(tmp_path: Path) -> None:
    path = tmp_path / "mix.jsonl"
    path.write_text(
        '{"query": "Q?", "choices": ["a", "b"], "gold": 0}\n'
        '\n{"context_options": ["x", "y"], "continuation": "z", "gold": 1}\n'
        '{"context": "c", "continuation": "d"}\n',
        encoding="utf-8",
    )
    assert read_eval_items(path) == [["Q? a", "Q? b"], ["x z", "y z"], ["c d"]]
    swag = tmp_path / "swag.txt"
    swag.write_text("Label: the ctx\n1\ne0\ne1\ne2\ne3\n", encoding="utf-8")
    assert read_eval_items(swag) == [["the ctx e0", "the ctx e1", "the ctx e2", "the ctx e3"]]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.jsonl", '{"query": "q", "choices": ["a"]}\n{"query": ', r"bad\.jsonl:2: not a JSON"),
        ("odd.jsonl", '{"question": "q"}\n', r"odd\.jsonl:1: expected fields query\+choices"),
        ("list.jsonl", '{"query": "q", "choices": "a"}\n', r"list\.jsonl:1: expected fields"),
        ("short.txt", "a: b\n0\nx\n", r"short\.txt: expected 6 lines per HellaSwag item"),
        ("gold.txt", "a: b\nX\n1\n2\n3\n4\n", r"gold\.txt:2: expected the gold index"),
        ("empty.jsonl", "\n", r"empty\.jsonl: empty evaluation file"),
        ("data.csv", "a,b\n", r"data\.csv: unknown evaluation format"),
    ],
)
def test_bad_eval_files_are_clear_errors(
    tmp_path: Path, name: str, content: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(KilnError, match=message):
        EvalNgramIndex.from_files([path])


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"decontaminate\.max_pieces"):
        DecontamConfig(max_pieces=0)
    with pytest.raises(ConfigError, match=r"decontaminate\.snap = 'words'"):
        DecontamConfig(snap="words")


def test_batch_gives_the_same_verdicts_and_texts(
    index: EvalNgramIndex, eval_dir: Path, filler: list[str]
) -> None:
    passage = hellaswag_passage(eval_dir)
    texts = [*filler[:5], f"{filler[5]}\n{passage}\n{filler[6]}", passage, *filler[7:9]]
    stage = Decontaminator(DecontamConfig(), index)
    one_by_one = [Document(str(i), t, "web", {}) for i, t in enumerate(texts)]
    batched = [Document(str(i), t, "web", {}) for i, t in enumerate(texts)]
    verdicts = [stage.apply(d) for d in one_by_one]
    assert stage.apply_batch(batched) == verdicts
    assert verdicts == [None] * 6 + ["decontaminate.empty", None, None]
    assert [d.text for d in batched] == [d.text for d in one_by_one]
    assert [d.meta for d in batched] == [d.meta for d in one_by_one]
    assert batched[5].text != texts[5] and batched[4].text == texts[4]


def test_lookup_agrees_with_isin(index: EvalNgramIndex) -> None:
    rng = np.random.default_rng(0)
    present = index.hashes[rng.choice(len(index), 2000, replace=False)]
    absent = rng.integers(0, 2**64 - 1, size=20000, dtype=np.uint64, endpoint=True)
    # Same top bits as present hashes, different low bits: they pass the bitmap, not the search.
    near = present ^ np.uint64(1)
    queries = np.concatenate([present, absent, near])
    np.testing.assert_array_equal(index.contains(queries), np.isin(queries, index.hashes))
    assert index.contains(present).all()


def test_a_passage_in_two_tasks_is_reported_under_both(tmp_path: Path) -> None:
    sentence = "the quick brown fox jumps over the lazy dog near the quiet river bank today"
    (tmp_path / "task_a.jsonl").write_text(
        json.dumps({"context": sentence, "continuation": "again"}) + "\n", encoding="utf-8"
    )
    (tmp_path / "task_b_test.jsonl").write_text(
        json.dumps({"query": "Q:", "choices": [sentence, "no"], "gold": 0}) + "\n",
        encoding="utf-8",
    )
    index = EvalNgramIndex.from_files([tmp_path / "task_a.jsonl", tmp_path / "task_b_test.jsonl"])
    assert index.tasks == ["task_a", "task_b"]
    first, _ = hash_word_ngrams([sentence], 13, whole_if_short=False)
    assert index.tasks_of(first[:1]) == [["task_a", "task_b"]]
    assert index.tasks_of(np.array([12345], dtype=np.uint64)) == [[]]
    text = "x" * 500 + " " + sentence.upper() + "! " + "y" * 500
    doc = Document("d", text, "web", {})
    assert Decontaminator(DecontamConfig(snap="none"), index).apply(doc) is None
    assert doc.meta["decontam"] == {"task_a": 1, "task_b": 1}
    assert doc.meta["decontam_cuts"][0]["matched"] == {"task_a": [0], "task_b": [0]}
    start, end = 501, 501 + len(sentence) + 1
    assert doc.text == text[: start - 200] + "\n\n" + text[end + 200 :]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("aZé ΣΟς\u00a0\u3000\t\n.,'-_1…!"), max_size=80))
def test_cut_positions_are_the_words_detection_hashes(text: str) -> None:
    """_cut finds spans by word position: its words must be exactly the ones detection hashed."""
    assert [w for w, _, _ in normalized_word_spans(text)] == normalized_words(text)
    for word, start, end in normalized_word_spans(text):
        assert normalized_words(text[start:end]) == [word]


def test_the_pipeline_stage_honours_the_configured_ngram(eval_dir: Path) -> None:
    from kiln.data.pipeline.config import PipelineConfig, SourceSpec, TokenizeStageConfig
    from kiln.data.pipeline.tasks import load_decontaminator

    cfg = PipelineConfig(
        sources=(SourceSpec("s", ("x",)),),
        decontaminate=DecontamConfig(eval_files=(str(eval_dir / "copa.jsonl"),), ngram=8),
        tokenize=TokenizeStageConfig(tokenizer="tok.json"),
    )
    stage = load_decontaminator(cfg)
    assert stage.index.ngram == 8
