"""kiln.loading: every kind of model folder loads to the same model, tokenizer and end-of-text id;
`kiln sample`, `kiln eval` and `kiln export` take a demo folder directly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.cli import main
from kiln.errors import KilnError
from kiln.loading import LoadedModel, find_checkpoint, load_model
from kiln.model.generate import generate
from kiln.tokenizer import Tokenizer
from kiln.train.config import load_train_config
from kiln.train.trainer import Trainer
from tests.fixtures import EOT, single_torch_thread
from tests.model.helpers import randomize

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TEXT = 'Once upon a time, Lily said: "Let\'s go!" 123 café ☀'
# The smallest demo there is: a 512-token BPE, 2 steps of 4,096 tokens (as tests/test_demo.py).
DEMO_ARGS = ["--steps", "2", "--vocab-size", "512", "--story-tokens", "8",
             "--set", "batch.global_tokens=4096", "--set", "batch.micro_batch=16",
             "--set", "eval.batches=1", "--set", "train.dtype=fp32"]  # fmt: skip

_one_thread = pytest.fixture(autouse=True)(single_torch_thread)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `kiln demo` folder (tokenizer.json, data/, train/ with checkpoints/step_2, report/)."""
    out = tmp_path_factory.mktemp("demo") / "demo-20260101-000000"
    assert main(["demo", "--out", str(out), *DEMO_ARGS]) == 0
    return out


@pytest.fixture(scope="module")
def demo_tok(demo: Path) -> Tokenizer:
    """The demo's own tokenizer, read directly."""
    return Tokenizer.load(demo / "tokenizer.json")


def fp32(path: Path | str, **kwargs: object) -> LoadedModel:
    """load_model on the CPU in fp32, so logits compare exactly whatever this CPU's auto pick."""
    return load_model(path, device="cpu", dtype="fp32", **kwargs)  # type: ignore[arg-type]


def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """(1, T, V) logits of one sequence."""
    with torch.no_grad():
        out = model(torch.tensor([ids]))
    return out.logits if hasattr(out, "logits") else out


def assert_checkpoint_weights(loaded: LoadedModel, checkpoint: Path) -> None:
    """Every tensor of the checkpoint's model.safetensors is in the loaded model, unchanged."""
    state = loaded.model.state_dict()
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert saved
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name


# ---- kiln folders ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "kind"),
    [
        ("", "kiln demo folder"),
        ("train", "run folder"),
        ("train/checkpoints", "checkpoints folder"),
        ("train/checkpoints/step_2", None),
    ],
)
def test_every_kiln_folder_loads_the_latest_checkpoint_and_the_runs_tokenizer(
    demo: Path, demo_tok: Tokenizer, where: str, kind: str | None
) -> None:
    loaded = fp32(demo / where)
    checkpoint = demo / "train" / "checkpoints" / "step_2"
    assert_checkpoint_weights(loaded, checkpoint)
    assert not loaded.model.training
    assert loaded.tokenizer_path == demo / "tokenizer.json"
    assert loaded.tokenizer is not None and loaded.tokenizer.encode(TEXT) == demo_tok.encode(TEXT)
    assert loaded.eot_id == demo_tok.special_tokens[EOT] == 511
    assert loaded.stop_ids == (511,)
    assert loaded.source.startswith(f"checkpoint {checkpoint} (step 2)")
    if kind is not None:
        assert loaded.source.endswith(f"of the {kind} {demo / where}")
    assert loaded.precision.name == "fp32" and loaded.precision.requested == "fp32"


def test_a_run_folder_of_kiln_train_finds_its_tokenizer_through_the_manifest(
    demo: Path, demo_tok: Tokenizer, tmp_path: Path
) -> None:
    cfg = load_train_config(
        CONFIGS / "tiny.toml",
        [f"data.dataset={demo / 'data'}", f"logging.run_dir={tmp_path / 'run'}",
         "logging.progress=false", "train.max_steps=1", "eval.batches=0"],
    )  # fmt: skip
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.run()
    loaded = fp32(tmp_path / "run")
    ids = demo_tok.encode(TEXT)
    torch.testing.assert_close(logits(loaded.model, ids), logits(trainer.model.eval(), ids))
    assert loaded.tokenizer_path == demo / "tokenizer.json"  # the manifest's record
    assert loaded.eot_id == 511


def test_a_moved_demo_folder_still_finds_its_data_and_tokenizer(
    demo: Path, demo_tok: Tokenizer, tmp_path: Path
) -> None:
    moved = tmp_path / "elsewhere"
    shutil.copytree(demo, moved)
    state_file = moved / "train" / "checkpoints" / "step_2" / "state.json"
    state = json.loads(state_file.read_text())
    state["config"]["data"]["dataset"] = "runs/demo-20260101-000000/data"  # relative, elsewhere
    state_file.write_text(json.dumps(state))
    manifest_file = moved / "data" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["tokenizer"]["path"] = "runs/demo-20260101-000000/tokenizer.json"
    manifest_file.write_text(json.dumps(manifest))
    loaded = fp32(moved)
    assert loaded.tokenizer_path == moved / "tokenizer.json"
    assert loaded.eot_id == 511
    # The copy beside the run must still be the file the run was trained with.
    (moved / "tokenizer.json").write_text((moved / "tokenizer.json").read_text() + "\n")
    with pytest.raises(KilnError, match=r"tokenizer\.json: sha256 .* differs .*--tokenizer PATH"):
        fp32(moved)


def test_a_run_without_its_tokenizer_still_scores_its_val_split(
    demo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    moved = tmp_path / "no-tokenizer"
    shutil.copytree(demo, moved)
    (moved / "tokenizer.json").unlink()
    state_file = moved / "train" / "checkpoints" / "step_2" / "state.json"
    state = json.loads(state_file.read_text())
    state["config"]["data"]["dataset"] = str(tmp_path / "gone-data")  # the run's data moved too
    state_file.write_text(json.dumps(state))
    manifest_file = moved / "data" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["tokenizer"]["path"] = str(tmp_path / "gone.json")
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(KilnError, match="tokenizer"):
        fp32(moved)  # text in or out needs the tokenizer
    loaded = fp32(moved, need_tokenizer=False)
    assert loaded.tokenizer is None and loaded.eot_id is None
    assert_checkpoint_weights(loaded, moved / "train" / "checkpoints" / "step_2")
    code, out, err = run(capsys, "eval", str(moved), "--val", str(demo / "data"),
                         "--no-progress")  # fmt: skip
    assert code == 0, err
    assert "(no tokenizer needed)" in err and "val" in out


def test_find_checkpoint_takes_a_step_and_names_the_saved_ones(demo: Path) -> None:
    assert find_checkpoint(demo, 2) == demo / "train" / "checkpoints" / "step_2"
    with pytest.raises(KilnError, match=r"no checkpoint of step 3 \(steps saved: 2\)"):
        find_checkpoint(demo, 3)
    with pytest.raises(KilnError, match="is the checkpoint of step 2, not of step 5"):
        find_checkpoint(demo / "train" / "checkpoints" / "step_2", 5)


@pytest.mark.parametrize(("where", "step"), [("", None), ("train/checkpoints/step_2", None),
                                           ("train/checkpoints/step_2", 2)])  # fmt: skip
def test_one_load_reads_the_checkpoint_state_once(
    demo: Path, where: str, step: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kiln import checkpoint_format
    from kiln.loading import load_checkpoint

    read = checkpoint_format.read_state
    calls: list[Path] = []
    monkeypatch.setattr(checkpoint_format, "read_state", lambda p: calls.append(p) or read(p))
    if step is None:
        fp32(demo / where)
    else:
        load_checkpoint(demo / where, step)
    assert calls == [demo / "train" / "checkpoints" / "step_2"]


# ---- HF folders ------------------------------------------------------------------------------


def test_kilns_own_export_loads_to_the_same_model_and_tokenizer(
    demo: Path, demo_tok: Tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", str(demo), "--hf", str(tmp_path / "hf")]) == 0
    assert "step 2" in capsys.readouterr().out
    exported, original = fp32(tmp_path / "hf"), fp32(demo)
    ids = demo_tok.encode(TEXT)
    torch.testing.assert_close(logits(exported.model, ids), logits(original.model, ids))
    assert exported.tokenizer_path == tmp_path / "hf" / "tokenizer.json"  # HF format
    assert exported.tokenizer is not None and exported.tokenizer.encode(TEXT) == ids
    assert exported.eot_id == original.eot_id == 511
    assert exported.source.startswith(f"HF model folder {tmp_path / 'hf'} (kiln export of step 2")


def test_a_gpt2_saved_by_transformers_with_its_hf_tokenizer_beside_it(
    demo: Path, demo_tok: Tokenizer, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    from kiln.tokenizer.formats import write_hf

    cfg = transformers.GPT2Config(
        vocab_size=512, n_positions=64, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=511, eos_token_id=511,
    )  # fmt: skip
    torch.manual_seed(0)
    hf_model = randomize(transformers.GPT2LMHeadModel(cfg), std=0.3).eval()
    out = tmp_path / "gpt2"
    hf_model.save_pretrained(out)
    write_hf(demo_tok, tmp_path / "tok-hf.json")
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tok-hf.json"), eos_token=EOT
    )
    hf_tok.save_pretrained(out)  # tokenizer.json (HF format) + its config files
    loaded = fp32(out)
    ids = hf_tok(TEXT)["input_ids"]
    assert loaded.tokenizer is not None and loaded.tokenizer.encode(TEXT) == ids
    torch.testing.assert_close(logits(loaded.model, ids), logits(hf_model, ids))
    assert loaded.tokenizer_path == out / "tokenizer.json"
    assert loaded.eot_id == 511 and loaded.source == f"HF model folder {out}"


def test_a_llama_saved_by_transformers_with_a_kiln_tokenizer_beside_it(
    demo: Path, demo_tok: Tokenizer, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=511, eos_token_id=511,
    )  # fmt: skip
    torch.manual_seed(0)
    hf_model = randomize(transformers.LlamaForCausalLM(cfg), std=0.3).eval()
    out = tmp_path / "llama"
    hf_model.save_pretrained(out)
    shutil.copy(demo / "tokenizer.json", out / "tokenizer.json")  # kiln's own format
    loaded = fp32(out)
    ids = demo_tok.encode(TEXT)
    assert loaded.tokenizer is not None and loaded.tokenizer.encode(TEXT) == ids
    torch.testing.assert_close(logits(loaded.model, ids), logits(hf_model, ids))
    assert loaded.eot_id == 511


def test_an_hf_folder_without_a_tokenizer(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(KilnError, match=r"no tokenizer\.json or vocab\.json beside the model"):
        fp32(tmp_path)
    loaded = fp32(tmp_path, need_tokenizer=False)
    assert loaded.tokenizer is None and loaded.eot_id == cfg.eos_token_id


# ---- errors and precision --------------------------------------------------------------------


def test_an_unrecognised_folder_is_one_line_saying_what_was_looked_for(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(KilnError) as caught:
        load_model(tmp_path)
    message = str(caught.value)
    assert "\n" not in message
    assert message == (
        f"{tmp_path}: not a model folder; looked for config.json (an HF model) and state.json "
        f"(a checkpoint) in {tmp_path}, for latest or step_N/ (a checkpoints folder) in "
        f"{tmp_path}, for {tmp_path / 'checkpoints'}/ (a run or its train/ folder) and for "
        f"{tmp_path / 'train' / 'checkpoints'}/ (a kiln demo folder)"
    )
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(KilnError, match=r"config\.json: not a readable JSON model config"):
        load_model(tmp_path)
    with pytest.raises(KilnError, match="no such model folder"):
        load_model(tmp_path / "missing")
    with pytest.raises(KilnError, match="not a folder"):
        load_model(tmp_path / "notes.txt")


def test_dtype_and_device_auto(demo: Path) -> None:
    loaded = load_model(demo)  # auto, auto
    assert loaded.precision.requested == "auto"
    # Weights stay fp32; bf16 is autocast around forward passes, as in training.
    assert next(loaded.model.parameters()).dtype == torch.float32
    assert loaded.autocast_dtype == (torch.bfloat16 if loaded.precision.name == "bf16" else None)
    with pytest.raises(KilnError, match="dtype must be auto, fp32 or bf16, got 'fp16'"):
        load_model(demo, dtype="fp16")


# ---- the commands, on a demo folder ----------------------------------------------------------


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`kiln ARGV`: (exit code, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_kiln_sample_takes_a_demo_folder(
    demo: Path, demo_tok: Tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "sample", str(demo), "--prompt", "Once upon a time",
                         "--max-tokens", "6", "--temperature", "0", "--dtype", "fp32")  # fmt: skip
    assert code == 0, err
    model = fp32(demo).model
    new = generate(model, [demo_tok.encode("Once upon a time")], 6, temperature=0,
                   stop_tokens=[511])[0]  # fmt: skip
    assert out == "Once upon a time" + demo_tok.decode(new) + "\n"
    assert err.count("dtype fp32: asked for") == 1  # the precision line, once
    assert f"of the kiln demo folder {demo}" in err


def test_kiln_eval_takes_a_demo_folder(
    demo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "story.txt"
    text.write_text("Lily and Tom went to the park. They played on the swings all day.\n")
    result = tmp_path / "r.json"
    code, out, err = run(capsys, "eval", str(demo), "--bpb", str(text), "--no-progress",
                         "--out", str(result))  # fmt: skip
    assert code == 0, err
    assert "bits/byte" in out
    assert err.count("kiln eval: dtype auto → ") == 1
    settings = json.loads(result.read_text())["settings"]
    assert settings["precision"]["requested"] == "auto"
    assert settings["dtype"] == settings["precision"]["dtype"] in ("fp32", "bf16")
    assert f"(tokenizer {demo / 'tokenizer.json'})" in err


def test_kiln_export_takes_a_demo_folder(
    demo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "export", str(demo), "--hf", str(tmp_path / "hf"))
    assert code == 0, err
    assert f"of {demo / 'train' / 'checkpoints' / 'step_2'} as an HF llama model" in out
    record = json.loads((tmp_path / "hf" / "kiln_export.json").read_text())
    assert record["step"] == 2 and record["run"] == str((demo / "train").resolve())


# ---- kiln sample's arguments -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
        (["--top-k", "0"], "--top-k must be >= 1, got 0"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0, got -1.0"),
        (["--max-tokens", "5000"], "+ --max-tokens 5000 exceeds the model's block size"),
        (["--dtype", "fp8"], "dtype must be auto, fp32 or bf16, got 'fp8'"),
        (["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
    ],
)
def test_sample_checks_its_arguments_before_printing_anything(
    demo: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    prompt = [] if "--prompt-ids" in extra else ["--prompt", "Once upon a time"]
    code, out, err = run(capsys, "sample", str(demo), *prompt, *extra)
    assert code == 2
    assert out == ""  # not even the prompt
    assert err.splitlines()[-1] == f"kiln: error: {err.split('kiln: error: ')[-1].strip()}"
    assert message in err


def test_sample_refuses_special_token_text_unless_allowed(
    demo: Path, demo_tok: Tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = "The end.<|endoftext|>Once"
    code, out, err = run(capsys, "sample", str(demo), "--prompt", prompt, "--dtype", "fp32")
    assert code == 2 and out == ""
    assert err.endswith(
        "kiln: error: --prompt contains the special token '<|endoftext|>' (at character 8); "
        "special-token text in user input is refused: pass --allow-special to encode it as "
        "that control token, or remove it\n"
    )
    code, out, err = run(capsys, "sample", str(demo), "--prompt", prompt, "--allow-special",
                         "--max-tokens", "5", "--temperature", "0", "--dtype", "fp32")  # fmt: skip
    assert code == 0, err
    ids = demo_tok.encode(prompt, allowed_special="all")
    assert 511 in ids  # the text became the control token, as asked
    new = generate(fp32(demo).model, [ids], 5, temperature=0, stop_tokens=[511])[0]
    assert out == prompt + demo_tok.decode(new) + "\n"


def test_sample_help_states_the_special_token_policy(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sample", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--allow-special" in text
    assert "is refused by default, so a prompt never silently turns into a control token" in text
    assert "--dtype DTYPE auto, fp32 or bf16" in text and "--device DEVICE" in text
