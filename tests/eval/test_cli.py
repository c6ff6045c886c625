"""`kiln eval`: a checkpoint, its run directory and its HF export score alike; JSON and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.checkpoint_format import dataset_fingerprint
from kiln.cli import main
from kiln.data.manifest import Manifest
from kiln.eval.lm import bits_per_byte, val_loss
from kiln.eval.scoring import Scorer
from kiln.loading import load_model
from kiln.model.hf import save_hf_dir
from kiln.tokenizer import Tokenizer
from kiln.train.checkpoint import TrainState, save_checkpoint
from kiln.train.export import write_hf_tokenizer

from .conftest import EOT, random_tiny


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory whose one checkpoint holds a random tiny model."""
    root = tmp_path_factory.mktemp("run")
    model = random_tiny(seed=2)
    state = TrainState(
        step=7, tokens=0, cursor={}, config={"model": model.cfg.to_dict()}, dataset={}
    )
    save_checkpoint(root / "checkpoints", model, {}, state, scheduler={}, keep_last=1)
    return root


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory, tok: Tokenizer) -> Path:
    """The same model as `run_dir`, as an HF directory with its tokenizer (as `kiln export`)."""
    out = tmp_path_factory.mktemp("hf")
    save_hf_dir(random_tiny(seed=2), out, eos_token_id=tok.special_tokens[EOT])
    write_hf_tokenizer(tok, out, EOT, 128)
    return out


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run `kiln ...`; (exit code, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_checkpoint_run_and_hf_export_give_the_same_results(
    capsys: pytest.CaptureFixture[str], shared_data: Path, run_dir: Path, hf_dir: Path,
    tok_path: Path, tmp_path: Path,
) -> None:  # fmt: skip
    common = ["--tasks", "copa,winogrande,lambada", "--limit", "6", "--no-progress"]
    common += ["--data-dir", str(shared_data / "eval"), "--batch-size", "4", "--dtype", "fp32"]
    docs = {}
    for name, model_args in (
        ("ckpt", [str(run_dir / "checkpoints" / "step_7"), "--tokenizer", str(tok_path)]),
        ("run", [str(run_dir), "--tokenizer", str(tok_path)]),
        ("hf", [str(hf_dir)]),
    ):
        out = tmp_path / f"{name}.json"
        code, stdout, err = run(capsys, "eval", *model_args, *common, "--out", str(out))
        assert code == 0, err
        assert "CORE-style score (mean centred over 3 tasks)" in stdout
        assert "acc_norm (log-prob per byte)" in stdout
        docs[name] = json.loads(out.read_text())
    tasks = {name: doc["tasks"] for name, doc in docs.items()}
    for task in ("copa", "winogrande", "lambada"):
        for key in ("acc", "random_baseline", "centred"):
            assert tasks["ckpt"][task][key] == tasks["run"][task][key]
            assert tasks["ckpt"][task][key] == pytest.approx(tasks["hf"][task][key], abs=1e-9)
    # A continuous score, so a slightly wrong weight mapping in the export would show.
    ppl = {name: t["lambada"]["ppl"] for name, t in tasks.items()}
    assert ppl["ckpt"] == ppl["run"] == pytest.approx(ppl["hf"], rel=1e-5)
    doc = docs["ckpt"]
    assert doc["tasks"]["copa"]["n"] == 6 and doc["tasks"]["copa"]["random_baseline"] == 0.5
    assert doc["tasks"]["lambada"]["random_baseline"] == 0.0 and "ppl" in doc["tasks"]["lambada"]
    centred = [doc["tasks"][t]["centred"] for t in ("copa", "winogrande", "lambada")]
    assert doc["core"]["score"] == pytest.approx(sum(centred) / 3)
    copa = doc["tasks"]["copa"]
    assert copa["centred"] == pytest.approx((copa["acc"] - 0.5) / 0.5)  # copa's primary is acc
    assert "checkpoint" in doc["model"] and doc["settings"]["limit"] == 6


def test_a_checkpoint_finds_its_tokenizer_through_its_dataset(
    capsys: pytest.CaptureFixture[str], dataset: Path, tok_path: Path, tmp_path: Path
) -> None:
    model = random_tiny(seed=2)
    config = {"model": model.cfg.to_dict(), "data": {"dataset": str(dataset)}}
    fingerprint = dataset_fingerprint(Manifest.read(dataset))
    state = TrainState(step=1, tokens=0, cursor={}, config=config, dataset=fingerprint)
    save_checkpoint(tmp_path / "run" / "checkpoints", model, {}, state, scheduler={}, keep_last=1)
    code, stdout, err = run(
        capsys, "eval", str(tmp_path / "run"), "--val", str(dataset), "--no-progress"
    )
    assert code == 0, err
    assert f"(tokenizer {tok_path})" in err and "val: loss" in stdout


def test_bpb_and_val_from_the_command_line(
    capsys: pytest.CaptureFixture[str], hf_dir: Path, tok: Tokenizer, dataset: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    text = tmp_path / "story.txt"
    text.write_text("Lily and Tom went to the park. They played on the swings all day.\n")
    out = tmp_path / "r.json"
    args = ["--bpb", str(text), "--val", str(dataset), "--stride", "64", "--no-progress"]
    args += ["--dtype", "fp32"]
    code, stdout, err = run(capsys, "eval", str(hf_dir), *args, "--out", str(out))
    assert code == 0, err
    scorer = Scorer(load_model(hf_dir, dtype="fp32").model, progress=False)
    expected = bits_per_byte(scorer, tok, text, 399, stride=64)
    val = val_loss(scorer, dataset, stride=64)
    doc = json.loads(out.read_text())
    assert doc["val"]["loss"] == pytest.approx(val.loss, rel=1e-6)
    assert doc["val"]["perplexity"] == pytest.approx(val.perplexity, rel=1e-6)
    assert doc["val"]["tokens"] == val.n_tokens and doc["val"]["stride"] == 64
    assert f"val: loss {val.loss:.4f} nats/token" in stdout
    bpb = doc["bpb"]
    assert bpb["bits_per_byte"] == pytest.approx(expected.bits_per_byte, rel=1e-6)
    assert bpb["bytes"] == len(text.read_bytes()) and bpb["tokens"] == expected.n_tokens
    assert f"{expected.bits_per_byte:.4f} bits/byte" in stdout


def test_results_are_not_overwritten_without_force(
    capsys: pytest.CaptureFixture[str], hf_dir: Path, shared_data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "r.json"
    out.write_text("{}")
    args = ["eval", str(hf_dir), "--tasks", "copa", "--limit", "2", "--no-progress"]
    args += ["--data-dir", str(shared_data / "eval"), "--out", str(out)]
    code, _, err = run(capsys, *args)
    assert code == 2 and f"{out} already exists; pass --force" in err
    assert out.read_text() == "{}"
    code, _, err = run(capsys, *args, "--force")
    assert code == 0, err
    assert json.loads(out.read_text())["tasks"]["copa"]["n"] == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tasks", "copa,nope"], "unknown task 'nope'; known tasks: hellaswag, arc_easy,"),
        ([], "nothing to evaluate for {MODEL}: pass --tasks, --val, --bpb or --lm-eval-tasks"),
        (["--tasks", "copa", "--limit", "0"], "--limit must be >= 1, got 0"),
        (["--tasks", "piqa", "--data-dir", "/nonexistent"], "/nonexistent/piqa.jsonl: task file"),
        (["--tasks", "copa", "--device", "tpu"], "device must be cpu, cuda, cuda:N or auto"),
    ],
)
def test_bad_arguments_are_one_line_errors(
    capsys: pytest.CaptureFixture[str], hf_dir: Path, extra: list[str], message: str
) -> None:
    code, _, err = run(capsys, "eval", str(hf_dir), *extra, "--no-progress")
    assert code == 2
    message = message.replace("{MODEL}", str(hf_dir))
    assert err.startswith("kiln: error: ") and message in err and err.count("\n") == 1


def test_a_file_given_as_the_model_with_no_task_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("a text file a user meant to score\n")
    code, _, err = run(capsys, "eval", str(text))
    assert code == 2 and err.count("\n") == 1
    assert f"nothing to evaluate for {text}:" in err
    assert f"{text} is a file, and MODEL is a model folder" in err and "--bpb FILE" in err


def test_a_directory_that_is_no_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "eval", str(tmp_path), "--tasks", "copa")
    assert code == 2 and f"{tmp_path}: not a model folder; looked for config.json" in err


def test_help_and_task_list(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "kiln eval runs/demo --tasks hellaswag,arc_easy --limit 200" in capsys.readouterr().out
    code, out, _ = run(capsys, "eval", "--list-tasks")
    assert code == 0 and len(out.splitlines()) == 8 and "hellaswag_val.txt.bz2" in out


def test_eval_quantize_scores_the_quantized_model_and_records_it(
    capsys: pytest.CaptureFixture[str], hf_dir: Path, tok: Tokenizer, tmp_path: Path
) -> None:
    text = tmp_path / "story.txt"
    text.write_text("Lily and Tom went to the park. They played on the swings all day.\n")
    args = ["eval", str(hf_dir), "--bpb", str(text), "--dtype", "fp32", "--no-progress"]
    docs = {}
    for mode in ("fp32", "int8", "fp8"):
        out = tmp_path / f"{mode}.json"
        extra = [] if mode == "fp32" else ["--quantize", mode]
        code, _, err = run(capsys, *args, *extra, "--out", str(out))
        assert code == 0, err
        docs[mode] = json.loads(out.read_text())
    assert "kiln eval: quantize fp8 (e4m3, 128x128 tiles)" in err
    assert docs["fp32"]["settings"]["quantize"] is None
    assert docs["int8"]["settings"]["quantize"]["mode"] == "int8"
    bpb = {mode: doc["bpb"]["bits_per_byte"] for mode, doc in docs.items()}
    assert bpb["int8"] != bpb["fp32"] and bpb["int8"] == pytest.approx(bpb["fp32"], rel=0.02)
    fp8 = docs["fp8"]["settings"]["quantize"]
    assert (fp8["mode"], fp8["fp8_format"], fp8["fp8_scaling"]) == ("fp8", "e4m3", "128x128")
    assert bpb["fp8"] != bpb["fp32"] and bpb["fp8"] == pytest.approx(bpb["fp32"], rel=0.05)
