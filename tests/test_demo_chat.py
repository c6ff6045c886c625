"""`kiln demo --chat`: tokenizer -> pre-training -> chat data -> SFT -> GRPO, each stage
evaluated, at a tiny size; budgets refused before training; a killed run resumes at its stage."""

from __future__ import annotations

import json

import pytest

from kiln.cli import build_parser, main
from kiln.demo_chat import STAGES, kiln_command, run_chat_demo
from kiln.errors import KilnError
from kiln.posttrain.tasks import TASKS

TINY = [
    "--vocab-size", "400", "--pretrain-steps", "2", "--sft-steps", "2", "--align", "grpo",
    "--align-steps", "1",
    "--eval-limit", "1", "--eval-max-tokens", "4",
    "--set", "model.n_layer=1", "--set", "model.n_embd=64", "--set", "model.n_head=2",
    "--set", "model.n_kv_head=1", "--set", "batch.global_tokens=1024",
    "--set", "batch.micro_batch=4", "--set", "eval.batches=1",
    "--sft-set", "batch.global_tokens=1024", "--sft-set", "batch.micro_batch=4",
    "--sft-set", "eval.batches=1", "--align-set", "rl.max_new_tokens=4",
    "--align-set", "rl.prompts_per_step=2", "--align-set", "rl.group_size=2",
]  # fmt: skip


@pytest.fixture()
def bpb_text(tmp_path):
    path = tmp_path / "valid.txt"
    path.write_text("Once upon a time, there was a little dog. He liked to play.\n" * 20)
    return path


def _args(out, bpb, *extra):
    return build_parser().parse_args(
        ["demo", "--chat", "--out", str(out), "--eval-bpb", str(bpb), *TINY, *extra]
    )


def test_chat_demo_end_to_end_then_resume_after_a_kill(tmp_path, bpb_text, capsys) -> None:
    out = tmp_path / "chat"
    ran: list[list[str]] = []

    def killed_in_sft(argv):
        ran.append(list(argv))
        if argv[0] == "sft":
            raise KeyboardInterrupt  # the user's Ctrl-C, or a kill, during the SFT stage
        kiln_command(argv)

    with pytest.raises(KeyboardInterrupt):
        run_chat_demo(_args(out, bpb_text), run=killed_in_sft)
    state = json.loads((out / "stages.json").read_text())
    assert state["stages"]["sft"]["status"] == "running"
    assert state["stages"]["sft"]["seconds"] > 0  # the killed stage's time is kept for the table
    killed_seconds = state["stages"]["sft"]["seconds"]
    assert state["stages"]["pretrain"]["status"] == "done"
    chat_config = json.loads((out / "chat" / "manifest.json").read_text())["config"]
    assert chat_config["tasks_per_story"] == len(TASKS)  # the SFT data: every task a story fits
    assert [a[0] for a in ran] == ["tokenizer", "data", "data", "train", "eval", "sft"]

    ran.clear()

    def recording(argv):
        ran.append(list(argv))
        kiln_command(argv)

    assert run_chat_demo(_args(out, bpb_text, "--resume"), run=recording) == 0
    # Resumed at the stage it was in: nothing before SFT ran again.
    assert [a[0] for a in ran] == ["sft", "eval", "rl", "eval"]
    state = json.loads((out / "stages.json").read_text())
    assert list(state["stages"]) == list(STAGES)
    assert all(r["status"] == "done" for r in state["stages"].values())
    assert state["stages"]["sft"]["seconds"] > killed_seconds  # both attempts counted
    summary = json.loads((out / "report" / "summary.json").read_text())
    assert list(summary["success"]) == ["pretrain", "sft", "align"]
    assert summary["chat_model"] == str(out / "align")
    table = (out / "report" / "tables.md").read_text()
    assert "| align (grpo) |" in table and "| sft-eval |" in table
    # The final folder is a chat model every command opens.
    assert (out / "align" / "checkpoints" / "latest").is_file()
    assert "kiln serve " + str(out / "align") in capsys.readouterr().out


def test_budgets_that_cannot_fit_are_refused_before_anything_runs(tmp_path, capsys) -> None:
    out = tmp_path / "chat"
    rc = main(["demo", "--chat", "--out", str(out), "--minutes", "20", "--pretrain-minutes", "15",
               "--sft-minutes", "5", "--align", "grpo"])  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert "stage budgets (pretrain 15 + sft 5 + align 5 min)" in err and "--minutes 20" in err
    assert not out.exists()
    # The default plan fits; a method after SFT needs room made for it.
    assert main(["demo", "--chat", "--out", str(out), "--align", "grpo"]) == 2
    assert "pretrain 15 + sft 11 + align 5 min" in capsys.readouterr().err and not out.exists()


def test_a_model_later_stages_cannot_run_is_refused_first(tmp_path, capsys) -> None:
    out = tmp_path / "chat"
    rc = main(["demo", "--chat", "--out", str(out), "--set", "model.layer_pattern=MA"])
    assert rc == 2
    assert "layer_pattern 'MA' has recurrent layers" in capsys.readouterr().err
    assert not out.exists()


def test_resume_needs_the_same_flags(tmp_path, bpb_text) -> None:
    out = tmp_path / "chat"
    out.mkdir()
    settings = vars(_args(out, bpb_text))
    from kiln.demo_chat import CHAT_MARKER, RESUME_KEYS

    (out / CHAT_MARKER).write_text("made by `kiln demo --chat`\n")  # as a real run folder has
    (out / "stages.json").write_text(
        json.dumps({"settings": {k: settings[k] for k in RESUME_KEYS}, "stages": {}})
    )
    with pytest.raises(KilnError, match="--sft-steps 2"):
        run_chat_demo(_args(out, bpb_text, "--resume", "--sft-steps", "3"))


def test_resume_of_a_folder_that_is_not_a_chat_demo_is_refused(tmp_path, bpb_text) -> None:
    with pytest.raises(KilnError, match="not a `kiln demo --chat` run"):
        run_chat_demo(_args(tmp_path, bpb_text, "--resume"))


def test_resume_without_out_says_which_flag_is_missing(capsys) -> None:
    assert main(["demo", "--chat", "--resume"]) == 2
    assert "--resume needs --out FOLDER" in capsys.readouterr().err


def test_a_killed_training_stage_resumes_from_its_checkpoint_or_starts_clean(tmp_path) -> None:
    from kiln.checkpoint_format import FILES
    from kiln.demo_chat import _resume_flag

    run = tmp_path / "sft"
    step = run / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    for name in FILES:
        (step / name).write_text("x")
    (run / "checkpoints" / "latest").write_text("step_3")
    assert _resume_flag(run, resuming=True) == ["--resume"]
    (run / "checkpoints" / "latest").unlink()  # killed between the save's rename and `latest`
    assert _resume_flag(run, resuming=True) == ["--resume"]
    assert run.is_dir()
    for name in FILES:  # killed before its first checkpoint was complete
        (step / name).unlink()
    assert _resume_flag(run, resuming=True) == []
    assert not run.exists()  # the demo's own half-made folder is cleared for a fresh start


@pytest.mark.parametrize("align", ["grpo", "dpo"])
def test_seed_reaches_every_trained_stage_and_a_set_still_wins(tmp_path, bpb_text, align) -> None:
    from kiln import demo_chat

    args = _args(tmp_path / "run", bpb_text, "--seed", "3", "--align", align,
                 "--sft-set", "train.seed=5")  # fmt: skip
    ran: list[list[str]] = []
    for stage in ("pretrain", "chat-data", "sft", "align"):
        demo_chat.STAGE_FUNCTIONS[stage](tmp_path / "run", args, ran.append, False)
    pretrain, chat, sft, *align_runs = ran
    assert {"train.seed=3", "data.seed=3"} <= set(pretrain)
    assert not any(
        a == "--seed" or ".seed=" in a for a in chat
    )  # the held-out prompts do not move with --seed
    assert {"train.seed=3", "data.seed=3"} <= set(sft)
    assert sft.index("train.seed=5") > sft.index("train.seed=3")  # the later override wins
    if align == "dpo":
        prefs, dpo = align_runs
        assert prefs[prefs.index("--seed") + 1] == "3" and {"dpo.seed=3", "data.seed=3"} <= set(dpo)
    else:
        assert "rl.seed=3" in align_runs[0]
    plain: list[list[str]] = []
    demo_chat.STAGE_FUNCTIONS["pretrain"](tmp_path / "run", _args(tmp_path, bpb_text), plain.append,
                                          False)  # fmt: skip
    assert not any(".seed=" in a for a in plain[0])  # seed 0: the configs' own seeds
