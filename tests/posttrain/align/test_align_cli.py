"""`kiln dpo`, `kiln reward`, `kiln rl` and `kiln posttrain preferences` on a tiny chat model:
each writes a run that loads as a model, resumes, and refuses to train over a run by accident."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.loading import load_model
from kiln.posttrain.chat_data import ChatDataConfig, write_chat_data


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("chat") / "data"
    write_chat_data(ChatDataConfig(heldout=5, max_stories=40), out)
    return out


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory: pytest.TempPathFactory, chat_data: Path) -> Path:
    """Hand-made pairs (a random model's samples would give none), one too long to fit."""
    path = tmp_path_factory.mktemp("prefs") / "pairs.jsonl"
    lines = [json.dumps({"messages": [{"role": "user", "content": f"Write about a cat {i}."}],
                         "chosen": "The cat sat in the sun.", "rejected": "No."})
             for i in range(12)]  # fmt: skip
    lines.append(json.dumps({"messages": [{"role": "user", "content": "long " * 400}],
                             "chosen": "a", "rejected": "b"}))  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def run(*args: str) -> int:
    return main([*args, "--no-progress"])


def test_dpo_writes_a_loadable_run_and_resumes(
    tmp_path: Path, chat_run: Path, pairs_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "dpo"
    common = ["--set", f"policy.base={chat_run}", "--set", f"data.pairs={pairs_file}",
              "--set", f"run_dir={out}", "--set", "dpo.pairs_per_step=4",
              "--set", "dpo.save_every=2", "--set", "dpo.eval_every=2"]  # fmt: skip
    assert run("dpo", "configs/dpo.toml", *common, "--set", "dpo.steps=2") == 0
    captured = capsys.readouterr()
    assert "2 steps" in captured.out and "1 of 13 pairs are longer" in captured.err
    assert run("dpo", "configs/dpo.toml", *common, "--set", "dpo.steps=4") == 2
    assert "holds a run already; --resume" in capsys.readouterr().err
    # A resume that would train on other settings or other pairs is refused, naming what changed.
    assert run("dpo", "configs/dpo.toml", *common, "--set", "dpo.beta=0.5", "--resume") == 2
    assert "dpo.beta: 0.1 -> 0.5" in capsys.readouterr().err
    other = tmp_path / "pairs.jsonl"
    other.write_text(pairs_file.read_text().replace("sat in", "lay in"))
    moved = [*common, "--set", f"data.pairs={other}", "--set", "dpo.steps=4", "--resume"]
    assert run("dpo", "configs/dpo.toml", *moved) == 2
    assert "differs from the file the run trained on" in capsys.readouterr().err
    other.write_text(pairs_file.read_text())  # the same pairs, moved: the contents count
    assert run("dpo", "configs/dpo.toml", *moved) == 0
    assert "resumed, 4 steps" in capsys.readouterr().out
    loaded = load_model(out)
    assert loaded.tokenizer is not None and "<|assistant|>" in loaded.tokenizer.special_tokens
    assert (out / "report" / "dpo.png").is_file()
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_reward_model_run(tmp_path: Path, chat_run: Path, pairs_file: Path) -> None:
    out = tmp_path / "rm"
    assert run("reward", "configs/reward.toml", "--set", f"policy.base={chat_run}",
               "--set", f"data.pairs={pairs_file}", "--set", f"run_dir={out}",
               "--set", "reward.steps=2", "--set", "reward.pairs_per_step=4") == 0  # fmt: skip
    assert (out / "checkpoints" / "step_2" / "reward_head.safetensors").is_file()


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_rl_run_on_the_chat_tasks(
    tmp_path: Path, chat_run: Path, chat_data: Path, algorithm: str
) -> None:
    out = tmp_path / algorithm
    args = ["rl", "configs/grpo.toml", "--set", f"policy.base={chat_run}",
            "--set", f"data.chat={chat_data}", "--set", f"run_dir={out}",
            "--set", f"rl.algorithm={algorithm}", "--set", "rl.prompts_per_step=2",
            "--set", "rl.group_size=2", "--set", "rl.max_new_tokens=8"]  # fmt: skip
    assert run(*args, "--set", "rl.steps=1", "--set", "rl.save_every=1") == 0
    assert run(*args, "--set", "rl.steps=2", "--set", "rl.save_every=1", "--resume") == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and "reward_mean" in records[0]
    load_model(out)
    assert (out / "report" / "rl.png").is_file()


def test_preferences_command_writes_pairs_and_a_manifest(
    tmp_path: Path, chat_run: Path, chat_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "prefs"
    assert run("posttrain", "preferences", str(chat_run), str(chat_data), str(out),
               "--samples", "2", "--max-new-tokens", "6", "--max-prompts", "3") == 0  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    assert sum(manifest["prompts"].values()) == 3
    assert manifest["sampling"]["samples"] == 2
    assert (out / "pairs.jsonl").is_file()
    assert "pairs in" in capsys.readouterr().out
    assert run("posttrain", "preferences", str(chat_run), str(chat_data), str(out)) == 2
    assert str(out) in capsys.readouterr().err  # not clobbered without --force


def test_a_config_error_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("dpo", "--set", f"run_dir={tmp_path}", "--set", "data.pairs=x") == 2
    assert "policy.base: set the model to start from" in capsys.readouterr().err


def test_a_folder_these_commands_did_not_make_is_never_written_into(
    tmp_path: Path, chat_run: Path, pairs_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.toml").write_text("my own config\n")
    args = ["dpo", "configs/dpo.toml", "--set", f"policy.base={chat_run}",
            "--set", f"data.pairs={pairs_file}", "--set", "dpo.steps=1", "--force"]  # fmt: skip
    assert run(*args, "--set", f"run_dir={mine}") == 2
    assert "is not a run folder of kiln dpo/reward/rl" in capsys.readouterr().err
    assert (mine / "config.toml").read_text() == "my own config\n"
    assert run(*args, "--set", f"run_dir={chat_run}") == 2  # not even the base run, with --force
    assert (chat_run / "checkpoints").is_dir()


def test_online_dpo_remakes_its_pairs_from_the_policy_and_resumes_on_them(
    tmp_path: Path, chat_run: Path, pairs_file: Path, chat_data: Path
) -> None:
    out = tmp_path / "online"
    common = ["--set", f"policy.base={chat_run}", "--set", f"data.pairs={pairs_file}",
              "--set", f"data.chat={chat_data}", "--set", f"run_dir={out}",
              "--set", "dpo.pairs_per_step=4", "--set", "dpo.save_every=1",
              "--set", "dpo.resample_every=2", "--set", "dpo.resample_prompts=40",
              "--set", "dpo.resample_samples=6", "--set", "dpo.resample_temperature=1.5",
              "--set", "dpo.resample_max_new_tokens=24", "--set", "dpo.rpo_alpha=0.5"]  # fmt: skip
    assert run("dpo", "configs/dpo.toml", *common, "--set", "dpo.steps=3") == 0
    made = sorted(p.name for p in (out / "online_pairs").iterdir())
    assert made == ["step_0.jsonl", "step_2.jsonl"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [("online_pairs" in r) for r in records] == [True, False, True]
    print([r["online_pairs"] for r in records if "online_pairs" in r])
    assert all("chosen_nll" in r for r in records)
