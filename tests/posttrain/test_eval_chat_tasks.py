"""`kiln eval MODEL --chat-tasks`: per-task success with a Wilson interval, and bits per byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.eval.chat_tasks import evaluate_chat_tasks, heldout_records, wilson_interval
from kiln.loading import LoadedModel, load_model
from kiln.posttrain.chat_data import ChatDataConfig, write_chat_data
from kiln.posttrain.replies import ReplyGenerator, ReplySettings
from kiln.posttrain.tasks import TASKS
from kiln.tokenizer.special import EOT


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory: pytest.TempPathFactory, stories_text: str) -> Path:
    """A `kiln data chat` folder from ~20 stories, 10 of them held out."""
    root = tmp_path_factory.mktemp("chatdata")
    (root / "train.txt").write_text(stories_text, encoding="utf-8")
    write_chat_data(ChatDataConfig(sources=(str(root / "train.txt"),), heldout=10), root / "data")
    return root / "data"


@pytest.fixture(scope="module")
def model(chat_run: Path) -> LoadedModel:
    return load_model(chat_run, dtype="fp32")


def test_wilson_interval_matches_known_values() -> None:
    assert wilson_interval(0, 0) == (0.0, 1.0)
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    low, high = wilson_interval(5, 10)
    assert (low, high) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    low, high = wilson_interval(10, 10)
    assert (low, high) == pytest.approx((0.7225, 1.0), abs=1e-4)


def test_an_oracle_passes_an_empty_reply_fails_and_long_prompts_are_skipped(
    model: LoadedModel, chat_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records, _ = heldout_records(chat_data, None)
    tok = model.tokenizer
    assert tok is not None
    targets = {}

    def oracle(self: object, prompts: list, settings: object) -> list:
        return [(targets[tuple(p)], True) for p in prompts]

    from kiln.chat import render

    for r in records:
        prompt = render(r["messages"][:-1], tok, add_generation_prompt=True).ids
        reply = tok.encode(r["messages"][-1]["content"])
        targets[tuple(prompt)] = [*reply, tok.special_tokens["<|end|>"]]
    monkeypatch.setattr(ReplyGenerator, "generate_ended", oracle)
    results = evaluate_chat_tasks(model, records, ReplySettings(temperature=0), batch_size=3)
    by_task = {r.task: r for r in results}
    assert sum(r.n + r.skipped for r in results) == len(records)
    block = model.model.cfg.block_size
    for r in results:
        expected_skips = sum(
            1
            for rec in records
            if rec["task"] == r.task
            and block - len(render(rec["messages"][:-1], tok, add_generation_prompt=True).ids) < 32
        )
        assert r.skipped == expected_skips
        assert r.successes == r.n  # the reference replies pass their checks
        assert all(s["passed"] for s in r.samples)
    assert any(r.n for r in by_task.values())

    # The same replies cut at their cap (not ended) are not successes, though they pass checks.
    monkeypatch.setattr(
        ReplyGenerator,
        "generate_ended",
        lambda self, prompts, s: [(oracle(self, [p], s)[0][0][:-1], False) for p in prompts],
    )
    cut = evaluate_chat_tasks(model, records, ReplySettings(temperature=0))
    assert all(r.successes == 0 and r.stopped == 0 and r.n == by_task[r.task].n for r in cut)
    assert all(r.mean_score == by_task[r.task].mean_score for r in cut)

    monkeypatch.setattr(
        ReplyGenerator, "generate_ended", lambda self, prompts, s: [([], True) for _ in prompts]
    )
    empty = evaluate_chat_tasks(model, records, ReplySettings(temperature=0))
    assert all(r.successes == 0 and r.mean_score == 0 for r in empty)


def test_the_command_reports_tasks_with_intervals_and_bpb(
    chat_run: Path, chat_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    valid = tmp_path / "valid.txt"
    valid.write_text(f"Once upon a time, a cat sat.\n{EOT}\nThe dog ran home.\n", encoding="utf-8")
    out = tmp_path / "res.json"
    argv = [
        "eval",
        str(chat_run),
        "--chat-tasks",
        str(chat_data),
        "--limit",
        "2",
        "--dtype",
        "fp32",
    ]
    argv += ["--bpb", str(valid), "--no-progress", "--chat-max-tokens", "8", "--out", str(out)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "chat task" in table and "95% CI" in table and "bits/byte" in table
    doc = json.loads(out.read_text())
    chat = doc["chat_tasks"]
    assert chat["source"].endswith("heldout.jsonl")
    for entry in chat["tasks"].values():
        assert entry["n"] + entry["skipped"] <= 2
        low, high = entry["ci95"]
        assert 0 <= low <= entry["success_rate"] <= high <= 1
    assert doc["bpb"]["bits_per_byte"] > 0


def test_bad_chat_flags_and_models_are_one_line(
    base_run: Path, chat_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval", str(base_run), "--chat-tasks", "--chat-temperature", "-1"]) == 2
    assert "temperature must be" in capsys.readouterr().err
    assert main(["eval", str(base_run), "--chat-tasks", str(chat_data), "--bpb", __file__]) == 2
    assert "no chat tokens" in capsys.readouterr().err
    assert main(["eval", str(base_run), "--chat-tasks", str(base_run)]) == 2
    assert "manifest" in capsys.readouterr().err


def test_without_data_the_default_heldout_split_is_used(tmp_path: Path) -> None:
    records, source = heldout_records(None, 2)
    assert "default held-out split" in source
    assert sorted(r["task"] for r in records) == sorted([*TASKS, *TASKS])
    write_chat_data(ChatDataConfig(max_stories=5), tmp_path / "default")
    written, _ = heldout_records(tmp_path / "default", 2)
    assert written == records  # the same prompts `kiln data chat` writes by default
