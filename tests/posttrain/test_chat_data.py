"""`kiln data chat`: seeded, balanced, splits disjoint by story, atomic, refuses to clobber."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.chat import iter_conversations
from kiln.cli import main
from kiln.errors import KilnError
from kiln.posttrain.chat_data import ChatDataConfig, build, split_file
from kiln.posttrain.tasks import TASKS, check
from kiln.tokenizer.special import EOT


@pytest.fixture(scope="module")
def stories(tmp_path_factory: pytest.TempPathFactory, stories_text: str) -> Path:
    """A story file of ~25 stories, one of them twice and one holding special-token text."""
    parts = [s.strip() for s in stories_text.split(EOT) if s.strip()]
    parts += [parts[0], "A story that says <|user|> in it. It is long enough to use."]
    path = tmp_path_factory.mktemp("src") / "train.txt"
    path.write_text(f"\n{EOT}\n".join(parts) + f"\n{EOT}\n", encoding="utf-8")
    return path


def data_args(stories: Path, out: Path, *extra: str) -> list[str]:
    return ["data", "chat", str(out), "--source", str(stories), "--heldout", "5", *extra]


def test_builds_both_splits_disjoint_by_story_with_counts_and_hashes(
    stories: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "chat"
    assert main(data_args(stories, out)) == 0
    printed = capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dropped"]["duplicates"] == 1 and manifest["dropped"]["special_token_text"] == 1
    rows = {s: list(iter_conversations(split_file(out, s))) for s in ("train", "heldout")}
    assert len(rows["heldout"]) == 5 and manifest["splits"]["heldout"]["examples"] == 5
    for split, records in rows.items():
        entry = manifest["splits"][split]
        counted = {t: sum(r["task"] == t for r in records) for t in TASKS}
        assert entry["tasks"] == {t: n for t, n in counted.items() if n}
        assert f"{split:<8} {entry['examples']:>6,} conversations" in printed
        for r in records:  # every reference reply passes its own check, save rare 'continue's
            assert check(r, r["messages"][-1]["content"]) or r["task"] == "continue"
    train_stories = {r["story"] for r in rows["train"]}
    held_stories = {r["story"] for r in rows["heldout"]}
    assert train_stories and not train_stories & held_stories
    texts = lambda rs: {r["messages"][-1]["content"][:40] for r in rs}  # noqa: E731
    assert not texts(rows["train"]) & texts(rows["heldout"])
    assert (
        max(manifest["splits"]["train"]["tasks"].values())
        - min(manifest["splits"]["train"]["tasks"].values())
        <= 2
    )  # balanced


def test_same_seed_same_bytes_other_seed_other_split(stories: Path, tmp_path: Path) -> None:
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        assert main(data_args(stories, tmp_path / name, "--seed", seed)) == 0
    read = lambda n: (tmp_path / n / "heldout.jsonl").read_bytes()  # noqa: E731
    assert read("a") == read("b") != read("c")
    assert (tmp_path / "a" / "train.jsonl").read_bytes() == (
        tmp_path / "b" / "train.jsonl"
    ).read_bytes()


def test_refuses_to_clobber_and_force_replaces_only_its_own_output(
    stories: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "chat"
    assert main(data_args(stories, out)) == 0
    assert main(data_args(stories, out, "--seed", "3")) == 2
    assert "pass --force" in capsys.readouterr().err
    assert main(data_args(stories, out, "--seed", "3", "--force")) == 0
    assert json.loads((out / "manifest.json").read_text())["config"]["seed"] == 3
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("x")
    assert main(data_args(stories, mine, "--force")) == 2
    assert "refusing to replace" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat", "mine"]  # no temp left


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tasks", "poem"], "expected some of"),
        (["--heldout", "0"], "heldout must be >= 1"),
        (["--heldout", "500"], "need more than the 500 held out"),
        (["--tasks-per-story", "0"], "tasks_per_story must be >= 1"),
    ],
)
def test_bad_options_are_one_line(
    stories: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    assert main([*data_args(stories, tmp_path / "x"), *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_changed_split_file_is_refused(stories: Path, tmp_path: Path) -> None:
    assert main(data_args(stories, tmp_path / "c")) == 0
    with open(tmp_path / "c" / "heldout.jsonl", "a") as handle:
        handle.write("\n")
    with pytest.raises(KilnError, match=r"changed since manifest\.json"):
        split_file(tmp_path / "c", "heldout")


def test_max_stories_and_task_subset(stories: Path) -> None:
    built = build(
        ChatDataConfig(
            sources=(str(stories),), heldout=3, max_stories=6, tasks=("words", "sentences")
        )
    )
    assert len(built.splits["train"]) == 6
    assert {e.task for e in built.splits["train"]} == {"words", "sentences"}


def test_tasks_per_story_gives_train_stories_several_tasks_and_keeps_heldout_at_one(
    stories: Path,
) -> None:
    one = build(ChatDataConfig(sources=(str(stories),), heldout=5))
    many = build(ChatDataConfig(sources=(str(stories),), heldout=5, tasks_per_story=3))
    assert [e.to_json() for e in many.splits["heldout"]] == [
        e.to_json() for e in one.splits["heldout"]
    ]  # the held-out prompts do not depend on how the train split is made
    per_story: dict[int, list[str]] = {}
    for e in many.splits["train"]:
        per_story.setdefault(e.story, []).append(e.task)
    assert set(per_story) == {e.story for e in one.splits["train"]}
    assert all(len(t) == len(set(t)) <= 3 for t in per_story.values())  # different tasks
    assert max(len(t) for t in per_story.values()) == 3
    assert len(many.splits["train"]) > 2 * len(one.splits["train"])
    for e in many.splits["train"]:  # every example is still its task's own reference
        assert check(e.to_json(), e.target) or e.task == "continue"
