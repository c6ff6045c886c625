"""Evaluation tasks: the registry, each task's file format and prompt, and their random baselines.

Every task becomes a list of `Item`s: the (context, continuation) pairs to score, one per choice,
and the index of the right one. The word-boundary space always opens the continuation
(" " + answer), as in lm-evaluation-harness, so it is scored with the answer's first token.
Prompt formats follow lm-evaluation-harness's task definitions (see docs/eval.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from kiln.errors import KilnError, json_error_reason
from kiln.io import open_binary

MULTIPLE_CHOICE = "multiple_choice"
LAST_WORD = "last_word"  # LAMBADA: greedy match of the final word, and its perplexity


@dataclass(frozen=True)
class Choice:
    """One scored pair: the continuation's log-probability given the context."""

    context: str
    continuation: str


@dataclass(frozen=True)
class Item:
    """One question: its choices (one for LAMBADA) and the index of the right one."""

    choices: tuple[Choice, ...]
    gold: int


@dataclass(frozen=True)
class TaskSpec:
    """A known task: its file under the data directory, how to read it, how to score it."""

    name: str
    filename: str
    kind: str  # MULTIPLE_CHOICE or LAST_WORD
    primary: str  # the metric centred against the random baseline: "acc" or "acc_norm"
    description: str
    read: Callable[[Path], Iterator[Item]]


@dataclass(frozen=True)
class Task:
    """A task's items as loaded from its file."""

    spec: TaskSpec
    path: Path
    items: list[Item]

    @property
    def name(self) -> str:
        """The task's registry name."""
        return self.spec.name

    @property
    def random_baseline(self) -> float:
        """Expected accuracy of guessing uniformly: mean of 1/choices (0 for LAMBADA)."""
        if self.spec.kind == LAST_WORD or not self.items:
            return 0.0
        return sum(1.0 / len(item.choices) for item in self.items) / len(self.items)


# ---- readers -------------------------------------------------------------------------------------


def _json_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-empty line; bad JSON names the file and line."""
    with open_binary(path) as handle:
        for line_no, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                reason = (
                    json_error_reason(exc, line_no)
                    if isinstance(exc, json.JSONDecodeError)
                    else "invalid UTF-8"
                )
                raise KilnError(f"{path}:{line_no}: invalid JSON ({reason})") from None
            if not isinstance(record, dict):
                raise KilnError(f"{path}:{line_no}: expected a JSON object")
            yield line_no, record


def _text(record: dict[str, Any], field: str, where: str) -> str:
    """A required non-empty string field."""
    if field not in record:
        raise KilnError(f"{where}: missing field {field!r}")
    value = record[field]
    if not isinstance(value, str) or not value.strip():
        raise KilnError(f"{where}: field {field!r} must be a non-empty string, got {value!r:.60}")
    return value


def _texts(record: dict[str, Any], field: str, where: str) -> list[str]:
    """A required list of at least two non-empty strings."""
    if field not in record:
        raise KilnError(f"{where}: missing field {field!r}")
    value = record[field]
    ok = isinstance(value, list) and len(value) >= 2
    if not ok or not all(isinstance(v, str) and v.strip() for v in value):
        raise KilnError(
            f"{where}: field {field!r} must be a list of at least 2 non-empty strings, "
            f"got {value!r:.60}"
        )
    return value


def _gold(value: Any, n_choices: int, where: str) -> int:
    """A valid answer index (an integer; HellaSwag's text lines are converted first)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n_choices:
        raise KilnError(
            f"{where}: field 'gold' must be an answer index 0..{n_choices - 1}, got {value!r:.60}"
        )
    return value


def read_query_choices(path: Path, answer_prefix: str = "") -> Iterator[Item]:
    """`query`, `choices`, `gold` lines: context = query (+ answer_prefix), continuation =
    " " + choice."""
    for line_no, record in _json_lines(path):
        where = f"{path}:{line_no}"
        query = _text(record, "query", where)
        choices = _texts(record, "choices", where)
        gold = _gold(record.get("gold"), len(choices), where)
        context = query.rstrip("\n") + answer_prefix if answer_prefix else query
        yield Item(tuple(Choice(context, " " + c) for c in choices), gold)


def read_question_answer(path: Path) -> Iterator[Item]:
    """ARC and PIQA ("Question: ..." queries): the prompt ends with "\\nAnswer:"."""
    return read_query_choices(path, answer_prefix="\nAnswer:")


def read_winogrande(path: Path) -> Iterator[Item]:
    """`context_options` (the blank filled with each option), one shared `continuation`."""
    for line_no, record in _json_lines(path):
        where = f"{path}:{line_no}"
        options = _texts(record, "context_options", where)
        continuation = _text(record, "continuation", where)
        gold = _gold(record.get("gold"), len(options), where)
        yield Item(tuple(Choice(o, " " + continuation) for o in options), gold)


def read_lambada(path: Path) -> Iterator[Item]:
    """`context` and `continuation` (the passage's final word)."""
    for line_no, record in _json_lines(path):
        where = f"{path}:{line_no}"
        context = _text(record, "context", where)
        word = _text(record, "continuation", where)
        yield Item((Choice(context, " " + word),), 0)


HELLASWAG_FIELDS = ("context", "gold", "ending 0", "ending 1", "ending 2", "ending 3")


def read_hellaswag(path: Path) -> Iterator[Item]:
    """6 lines per item: `activity_label: context`, the gold index, four endings."""
    with open_binary(path) as handle:
        lines: list[str] = []
        first_line = 1
        for line_no, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                raise KilnError(f"{path}:{line_no}: invalid UTF-8") from None
            if not lines:
                first_line = line_no
            lines.append(text)
            if len(lines) == len(HELLASWAG_FIELDS):
                yield _hellaswag_item(path, first_line, lines)
                lines = []
    if lines and any(line.strip() for line in lines):
        missing = HELLASWAG_FIELDS[len(lines)]
        raise KilnError(
            f"{path}:{first_line + len(lines)}: field {missing!r} missing: the file ends inside "
            f"an item (6 lines each: context, gold index, four endings)"
        )


def _hellaswag_item(path: Path, first_line: int, lines: list[str]) -> Item:
    """One item from its six lines, naming the line and field of anything malformed."""
    for offset, (field, text) in enumerate(zip(HELLASWAG_FIELDS, lines, strict=True)):
        if not text.strip():
            raise KilnError(f"{path}:{first_line + offset}: field {field!r} is empty")
    gold_text = lines[1].strip()
    gold = _gold(
        int(gold_text) if gold_text.isdigit() else gold_text, 4, f"{path}:{first_line + 1}"
    )
    return Item(tuple(Choice(lines[0], " " + ending) for ending in lines[2:]), gold)


# ---- the registry --------------------------------------------------------------------------------

TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("hellaswag", "hellaswag_val.txt.bz2", MULTIPLE_CHOICE, "acc_norm",
                 "commonsense sentence completion, 4 endings (validation, 10,042)",
                 read_hellaswag),
        TaskSpec("arc_easy", "arc_easy.jsonl", MULTIPLE_CHOICE, "acc_norm",
                 "grade-school science questions, easy set (2,376)", read_question_answer),
        TaskSpec("arc_challenge", "arc_challenge.jsonl", MULTIPLE_CHOICE, "acc_norm",
                 "grade-school science questions, challenge set (1,172)", read_question_answer),
        TaskSpec("piqa", "piqa.jsonl", MULTIPLE_CHOICE, "acc_norm",
                 "physical commonsense: which of 2 solutions reaches the goal (1,838)",
                 read_question_answer),
        TaskSpec("openbook_qa", "openbook_qa.jsonl", MULTIPLE_CHOICE, "acc_norm",
                 "elementary science facts applied, 4 choices (500)", read_query_choices),
        TaskSpec("copa", "copa.jsonl", MULTIPLE_CHOICE, "acc",
                 "cause and effect, 2 alternatives (100)", read_query_choices),
        TaskSpec("winogrande", "winogrande.jsonl", MULTIPLE_CHOICE, "acc",
                 "pronoun resolution: which option makes the rest likely (1,267)",
                 read_winogrande),
        TaskSpec("lambada", "lambada_openai.jsonl", LAST_WORD, "acc",
                 "predict a passage's final word (OpenAI's LAMBADA, 5,153)", read_lambada),
    )
}  # fmt: skip


def task_spec(name: str) -> TaskSpec:
    """The registered task `name`; an unknown name lists the known ones."""
    if name not in TASKS:
        raise KilnError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[name]


def parse_task_names(text: str) -> list[str]:
    """Comma-separated task names ("all" = every task), checked against the registry."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise KilnError(f"--tasks names no task; known tasks: {', '.join(TASKS)}")
    if names == ["all"]:
        return list(TASKS)
    for name in names:
        task_spec(name)
    return list(dict.fromkeys(names))  # duplicates once, order kept


def load_task(name: str, data_dir: str | os.PathLike[str], limit: int | None = None) -> Task:
    """Read task `name` from its file in `data_dir` (the first `limit` items when given)."""
    spec = task_spec(name)
    path = Path(data_dir) / spec.filename
    if not path.is_file():
        raise KilnError(f"{path}: task file for {name!r} not found (pass --data-dir DIR)")
    items = list(islice(spec.read(path), limit))
    if not items:
        raise KilnError(f"{path}: no items")
    return Task(spec, path, items)
