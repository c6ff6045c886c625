"""Task files: the shared files load with the right prompts; broken files give clear errors."""

from __future__ import annotations

import bz2
import json
from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.eval.tasks import TASKS, load_task, parse_task_names

SIZES = {
    "hellaswag": 10042, "arc_easy": 2376, "arc_challenge": 1172, "piqa": 1838,
    "openbook_qa": 500, "copa": 100, "winogrande": 1267, "lambada": 5153,
}  # fmt: skip


@pytest.mark.parametrize("name", list(TASKS))
def test_every_shared_task_file_loads_whole(shared_data: Path, name: str) -> None:
    task = load_task(name, shared_data / "eval")
    assert len(task.items) == SIZES[name]
    for item in task.items:
        assert 0 <= item.gold < len(item.choices)
        for choice in item.choices:
            # The word-boundary space opens the continuation, never ends the context.
            assert choice.continuation.startswith(" ") and choice.continuation.strip()
            assert not choice.context.endswith(" ")


def test_hellaswag_first_item_as_in_the_file(shared_data: Path) -> None:
    path = shared_data / "eval" / "hellaswag_val.txt.bz2"
    lines = bz2.decompress(path.read_bytes()).decode("utf-8").split("\n")[:6]
    item = load_task("hellaswag", shared_data / "eval", limit=1).items[0]
    assert item.gold == int(lines[1])
    assert [c.context for c in item.choices] == [lines[0]] * 4
    assert [c.continuation for c in item.choices] == [" " + e for e in lines[2:6]]


def test_prompt_formats(shared_data: Path) -> None:
    data = shared_data / "eval"
    raw = json.loads((data / "arc_easy.jsonl").read_text().splitlines()[0])
    arc = load_task("arc_easy", data, limit=1).items[0]
    assert arc.choices[0].context == raw["query"] + "\nAnswer:"
    assert [c.continuation for c in arc.choices] == [" " + c for c in raw["choices"]]
    assert arc.gold == raw["gold"]

    raw = json.loads((data / "piqa.jsonl").read_text().splitlines()[0])
    piqa = load_task("piqa", data, limit=1).items[0]
    assert raw["query"].endswith("\n")  # the file's query already ends the line
    assert piqa.choices[0].context == raw["query"] + "Answer:"

    raw = json.loads((data / "winogrande.jsonl").read_text().splitlines()[0])
    wino = load_task("winogrande", data, limit=1).items[0]
    assert [c.context for c in wino.choices] == raw["context_options"]
    assert {c.continuation for c in wino.choices} == {" " + raw["continuation"]}

    raw = json.loads((data / "lambada_openai.jsonl").read_text().splitlines()[0])
    lam = load_task("lambada", data, limit=1).items[0]
    assert len(lam.choices) == 1 and lam.gold == 0
    assert lam.choices[0].context == raw["context"]
    assert lam.choices[0].continuation == " " + raw["continuation"]


def test_random_baselines(shared_data: Path) -> None:
    data = shared_data / "eval"
    assert load_task("hellaswag", data, limit=20).random_baseline == 0.25
    assert load_task("copa", data, limit=20).random_baseline == 0.5
    assert load_task("lambada", data, limit=20).random_baseline == 0.0


def test_limit_takes_the_first_items(shared_data: Path) -> None:
    data = shared_data / "eval"
    assert load_task("copa", data, limit=7).items == load_task("copa", data).items[:7]


def test_unknown_task_lists_the_known_ones() -> None:
    with pytest.raises(
        KilnError, match="unknown task 'helaswag'; known tasks: hellaswag, arc_easy"
    ):
        parse_task_names("copa,helaswag")


def test_task_names() -> None:
    assert parse_task_names("all") == list(TASKS)
    assert parse_task_names(" copa, piqa,copa ") == ["copa", "piqa"]
    with pytest.raises(KilnError, match="names no task"):
        parse_task_names(" , ")


def test_missing_task_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(KilnError, match=f"{tmp_path}/copa.jsonl: task file for 'copa' not found"):
        load_task("copa", tmp_path)


GOOD_MC = {"query": "The man fell, therefore", "choices": ["he got up.", "he flew."], "gold": 0}

BROKEN_JSONL = [
    ("copa", "copa.jsonl", '{"query": "x", "choices": ["a", "b"]', "invalid JSON"),
    ("copa", "copa.jsonl", {**GOOD_MC, "gold": 2}, "field 'gold' must be an answer index 0..1"),
    ("copa", "copa.jsonl", {**GOOD_MC, "gold": "0"}, "field 'gold' must be an answer index"),
    ("arc_easy", "arc_easy.jsonl", {**GOOD_MC, "choices": "a"}, "field 'choices' must be a list"),
    ("piqa", "piqa.jsonl", {"choices": ["a", "b"], "gold": 0}, "missing field 'query'"),
    ("openbook_qa", "openbook_qa.jsonl", {**GOOD_MC, "query": ""}, "field 'query' must be a non"),
    ("winogrande", "winogrande.jsonl", {"context_options": ["a", "b"], "gold": 1},
     "missing field 'continuation'"),
    ("lambada", "lambada_openai.jsonl", {"context": 3, "continuation": "x"},
     "field 'context' must be a non-empty string"),
    ("lambada", "lambada_openai.jsonl", ["a list"], "expected a JSON object"),
]  # fmt: skip


@pytest.mark.parametrize(("task", "filename", "bad", "message"), BROKEN_JSONL)
def test_malformed_jsonl_line_names_file_line_and_field(
    tmp_path: Path, task: str, filename: str, bad: object, message: str
) -> None:
    good = {
        "winogrande": {"context_options": ["a", "b"], "continuation": "c", "gold": 1},
        "lambada": {"context": "a b", "continuation": "c"},
    }.get(task, GOOD_MC)
    bad_line = bad if isinstance(bad, str) else json.dumps(bad)
    (tmp_path / filename).write_text(f"{json.dumps(good)}\n\n{json.dumps(good)}\n{bad_line}\n")
    with pytest.raises(KilnError) as err:
        load_task(task, tmp_path)
    assert str(err.value).startswith(f"{tmp_path / filename}:4: ")  # blank lines count
    assert message in str(err.value)


def _hellaswag(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "hellaswag_val.txt.bz2"
    path.write_bytes(bz2.compress(("\n".join(lines) + "\n").encode()))
    return path


GOOD_HS = ["Cooking: A man cracks an egg. he", "1", "sings.", "fries it.", "runs.", "sleeps."]


def test_hellaswag_reads_its_six_line_items(tmp_path: Path) -> None:
    _hellaswag(tmp_path, GOOD_HS * 2)
    items = load_task("hellaswag", tmp_path).items
    assert len(items) == 2 and items[1].gold == 1
    assert items[0].choices[1].continuation == " fries it."


@pytest.mark.parametrize(
    ("lines", "line_no", "message"),
    [
        ([*GOOD_HS, *GOOD_HS[:1], "x", *GOOD_HS[2:]], 8, "field 'gold' must be an answer index"),
        (
            [*GOOD_HS, *GOOD_HS[:1], "4", *GOOD_HS[2:]],
            8,
            "field 'gold' must be an answer index 0..3",
        ),
        ([*GOOD_HS, *GOOD_HS[:4], "", "x"], 11, "field 'ending 2' is empty"),
        ([*GOOD_HS, *GOOD_HS[:3]], 10, "field 'ending 1' missing: the file ends inside an item"),
    ],
)
def test_malformed_hellaswag_names_line_and_field(
    tmp_path: Path, lines: list[str], line_no: int, message: str
) -> None:
    path = _hellaswag(tmp_path, lines)
    with pytest.raises(KilnError) as err:
        load_task("hellaswag", tmp_path)
    assert str(err.value).startswith(f"{path}:{line_no}: ")
    assert message in str(err.value)
