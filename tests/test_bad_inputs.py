"""Malformed inputs to `kiln train`, `demo`, `sample`, `eval` and `export`: one clear line each.

Every row of the table must exit non-zero with exactly one `kiln: error:` line on stderr that
names the file, field or value at fault, and no traceback. Rows run in-process through
`kiln.cli.main`; two run the installed entry point in a subprocess, as a user would.
(The data and tokenizer commands have their own tables under tests/data and tests/tokenizer.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.cli import main
from tests.fixtures import single_torch_thread, tiny_story_dataset

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
QUIET = ["--set", "eval.batches=0", "--set", "eval.sample_tokens=0", "--no-progress"]

_one_thread = pytest.fixture(autouse=True)(single_torch_thread)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> dict[str, str]:
    """A dataset, a 2-step run, its HF export, and damaged copies and files of each."""
    root = tmp_path_factory.mktemp("bad_inputs")
    ds = tiny_story_dataset(shared_data / "tinystories" / "valid.txt.gz", root, 20_000)
    run, hf, bad = root / "run", root / "hf", root / "bad"
    argv = ["train", str(TINY), "--set", f"data.dataset={ds}", "--set", f"logging.run_dir={run}"]
    assert main([*argv, *QUIET, "--set", "train.max_steps=2", "--set", "checkpoint.every=2"]) == 0
    assert main(["export", str(run), "--hf", str(hf)]) == 0
    bad.mkdir()
    files = {
        "badtoml.toml": b"[data\nx = 1\n",
        "unknown.toml": f'[data]\ndataset = "{ds}"\nfoo = 1\n'.encode(),
        "section.toml": b"[bogus]\nx = 1\n",
        "wrongtype.toml": f'[optim]\nlr = "fast"\n[data]\ndataset = "{ds}"\n'.encode(),
        "range.toml": f'[data]\ndataset = "{ds}"\nseq_len = -4\n'.encode(),
        "binary.toml": b"\xff\xfe[data]\n",
        "nodata.toml": f'[data]\ndataset = "{bad / "nowhere"}"\n'.encode(),
        "notads.toml": f'[data]\ndataset = "{bad / "empty"}"\n'.encode(),
        "preset.toml": f'[model]\npreset = "nope"\n[data]\ndataset = "{ds}"\n'.encode(),
        "file": b"a user's file\n",
        "tok.json": b"not a tokenizer\n",
    }
    for name, data in files.items():
        (bad / name).write_bytes(data)
    (bad / "empty").mkdir()
    for name, target, junk in (
        ("hf_config", "config.json", b"{not json"),
        ("hf_weights", "model.safetensors", b"junk"),
    ):
        shutil.copytree(hf, bad / name)
        (bad / name / target).write_bytes(junk)
    step = Path("checkpoints") / "step_2"
    for name, target in (
        ("run_state", "state.json"),
        ("run_weights", "model.safetensors"),
        ("run_optim", "optimizer.pt"),
    ):
        shutil.copytree(run, bad / name)
        (bad / name / step / target).write_bytes(b"{ junk")
    return {"DS": str(ds), "RUN": str(run), "HF": str(hf), "B": str(bad), "TINY": str(TINY)}


TRAIN = "train {TINY} --set data.dataset={DS} --set logging.run_dir={B}/new"
RESUME = "train {TINY} --set data.dataset={DS} --resume --set logging.run_dir="
# (command line, a fragment the error line must hold)
ROWS = [
    # kiln train: the config file
    ("train {B}/badtoml.toml", "badtoml.toml: not valid TOML"),
    ("train {B}/unknown.toml", "unknown config key(s) data.foo"),
    ("train {B}/section.toml", "unknown config key(s) bogus"),
    ("train {B}/wrongtype.toml", "optim.lr = 'fast': expected float"),
    ("train {B}/range.toml", "data.seq_len must be >= 1, got -4"),
    ("train {B}/binary.toml", "binary.toml: not UTF-8"),
    ("train {B}/missing.toml", "missing.toml: cannot read config"),
    ("train {B}", "cannot read config (Is a directory)"),
    ("train {B}/nodata.toml", "nowhere: no such dataset directory"),
    ("train {B}/notads.toml", "is not a kiln token-shard dataset"),
    ("train {B}/preset.toml", "unknown model preset 'nope'"),
    # kiln train: --set and the resolved config
    (TRAIN + " --set optim.lr=fast", "--set optim.lr=fast"),
    (TRAIN + " --set nosuch.key=1", "unknown config key nosuch"),
    (TRAIN + " --set optim.lr", "--set optim.lr: expected KEY=VALUE"),
    (TRAIN + " --set train.max_steps=0", "train.max_steps must be >= 1"),
    (TRAIN + " --set batch.global_tokens=100", "batch.global_tokens (100) must be a multiple"),
    (TRAIN + " --set train.dtype=fp8", "train.dtype = 'fp8'"),
    (TRAIN + " --set data.seq_len=100000", "longer than model.block_size"),
    # kiln train: the run directory
    (RESUME + "{B}/new", "nothing to resume"),
    ("train {TINY} --set data.dataset={DS} --set logging.run_dir={RUN}", "already holds"),
    (RESUME + "{RUN} --set model.n_layer=3", "model.n_layer: 2 -> 3"),
    (RESUME + "{B}/run_state", "step_2/state.json: cannot read checkpoint state"),
    (RESUME + "{B}/run_weights", "step_2/model.safetensors: not a readable safetensors"),
    (RESUME + "{B}/run_optim", "step_2/optimizer.pt: not a readable optimizer state"),
    # kiln demo (refused before anything is written)
    ("demo --out {B}/demo --vocab-size 10", "--vocab-size 10 is too small"),
    ("demo --out {B}/demo --steps 0", "--steps must be >= 1"),
    ("demo --out {B}/demo --story-tokens -1", "--story-tokens must be >= 0"),
    ("demo --out {B}/demo --set nosuch=1", "--set nosuch=1"),
    ("demo --out {B}/demo --set optim.lr=x", "--set optim.lr=x"),
    ("demo --out {B}/demo --set batch.global_tokens=1000", "batch.global_tokens (1000)"),
    ("demo --out {B}/demo --set train.device=tpu", "device must be cpu, cuda"),
    ("demo --out {B}/demo --set eval.sample_prompts=['a<|endoftext|>']", "special token"),
    ("demo --out {B}/file", "file exists and is not a directory"),
    ("demo --out {B}/file --force", "file exists and is not a directory"),
    ("demo --out {B}/file/sub", "cannot create the run folder"),
    ("demo --out {B} --force", "is not a kiln demo run folder"),
    # kiln sample
    ("sample {B}/empty --prompt hi", "empty: not a model folder; looked for config.json"),
    ("sample {B}/nowhere --prompt hi", "nowhere: no such model folder"),
    ("sample {RUN} --prompt hi --max-tokens 500", "exceeds the model's block size 64"),
    ("sample {B}/hf_config --prompt hi", "config.json: not a readable JSON model config"),
    ("sample {B}/hf_weights --prompt hi", "model.safetensors: not a readable safetensors"),
    ("sample {HF} --prompt-ids 1,x", "--prompt-ids must be comma-separated integers"),
    ("sample {HF} --prompt-ids 100000", "token id 100000 is outside the vocabulary"),
    ("sample {HF} --prompt hi --max-tokens 0", "--max-tokens must be >= 1, got 0"),
    ("sample {HF} --prompt hi --max-tokens 500", "exceeds the model's block size"),
    (
        "sample {HF} --prompt hi --max-tokens 8 --temperature -1",
        "--temperature must be a finite number >= 0",
    ),
    ("sample {HF} --prompt hi --max-tokens 8 --top-k 0", "--top-k must be >= 1"),
    ("sample {HF} --prompt hi --max-tokens 8 --top-p 2", "--top-p must be in (0, 1]"),
    ("sample {HF} --prompt hi --tokenizer {B}/tok.json", "tok.json: not a tokenizer file"),
    (
        "sample {HF} --prompt hi --tokenizer {B}/nowhere.json",
        "nowhere.json: no such tokenizer file",
    ),
    # kiln eval
    ("eval {HF}", "nothing to evaluate"),
    ("eval {B}/empty --val {DS}", "empty: not a model folder; looked for config.json"),
    ("eval {B}/nowhere --val {DS}", "nowhere: no such model folder"),
    ("eval {B}/hf_config --val {DS}", "config.json: not a readable JSON model config"),
    ("eval {B}/hf_weights --val {DS}", "model.safetensors: not a readable safetensors"),
    ("eval {B}/run_state --val {DS}", "state.json: cannot read checkpoint state"),
    ("eval {B}/run_weights --val {DS}", "model.safetensors: not a readable safetensors"),
    ("eval {HF} --val {B}/empty", "is not a kiln token-shard dataset"),
    ("eval {HF} --val {DS} --val-split nope", "no split 'nope'"),
    ("eval {HF} --bpb {B}/nowhere.txt", "nowhere.txt: no such file"),
    ("eval {HF} --tasks nosuchtask", "unknown task 'nosuchtask'"),
    ("eval {HF} --val {DS} --limit 0", "--limit must be >= 1"),
    ("eval {HF} --val {DS} --stride 0", "--stride must be >= 1"),
    ("eval {HF} --val {DS} --batch-size 0", "batch size must be >= 1"),
    ("eval {HF} --val {DS} --dtype fp7", "dtype must be auto, fp32 or bf16, got 'fp7'"),
    ("eval {HF} --val {DS} --device tpu", "device must be cpu, cuda, cuda:N or auto, got 'tpu'"),
    ("sample {HF} --prompt hi --device tpu", "device must be cpu, cuda, cuda:N or auto"),
    (TRAIN + " --set train.device=tpu", "device must be cpu, cuda, cuda:N or auto"),
    (TRAIN + " --set eval.sample_prompts=['a<|endoftext|>b']", "special token"),
    (TRAIN + " --set optim.lr=inf", "optim.lr = inf: expected a finite number"),
    ("sample {HF} --prompt a<|endoftext|>b", "special token"),
    ("eval {HF} --val {DS} --out {B}", "is a directory"),
    # kiln export
    ("export {B}/nowhere --hf {B}/out", "nowhere: no such model folder"),
    ("export {B}/empty --hf {B}/out", "empty: not a model folder"),
    ("export {HF} --hf {B}/out", "an HF model folder (config.json), not a kiln checkpoint"),
    ("export {B}/run_state --hf {B}/out", "state.json: cannot read checkpoint state"),
    ("export {B}/run_weights --hf {B}/out", "model.safetensors: not a readable safetensors"),
    ("export {RUN} --hf {B}/out --step 7", "no checkpoint of step 7 (steps saved: 2)"),
    ("export {RUN} --hf {B}/out --step -1", "no checkpoint of step -1"),
    ("export {RUN} --hf {B}/out --tokenizer {B}/tok.json", "tok.json: not a tokenizer file"),
    (
        "export {RUN} --hf {B}/out --tokenizer {B}/nowhere.json",
        "nowhere.json: no such tokenizer file",
    ),
    ("export {RUN} --hf {B}/file", "file exists and is not a directory"),
    ("export {RUN} --hf {B} --force", "is not a kiln export"),
]


def _argv(line: str, world: dict[str, str]) -> list[str]:
    return [part.format(**world) for part in line.split()]


@pytest.mark.parametrize(("line", "fragment"), ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_one_clear_line(
    world: dict[str, str], line: str, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = sorted(os.listdir(world["B"]))
    assert main(_argv(line, world)) != 0
    out, err = capsys.readouterr()
    errors = [e for e in err.splitlines() if e.startswith("kiln: error: ")]
    assert len(errors) == 1 and err.rstrip("\n").endswith(errors[0]), err
    assert fragment.format(**world) in errors[0]
    assert "Traceback" not in out + err
    assert sorted(os.listdir(world["B"])) == before  # a refused command leaves nothing behind


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("train {B}/wrongtype.toml", "optim.lr = 'fast': expected float"),
        ("export {B}/run_weights --hf {B}/out", "not a readable safetensors"),
    ],
)
def test_bad_input_from_the_console_script(world: dict[str, str], line: str, fragment: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "kiln.cli", *_argv(line, world)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    errors = [e for e in done.stderr.splitlines() if e.startswith("kiln: error: ")]
    assert len(errors) == 1 and done.stderr.rstrip("\n").endswith(errors[0]), done.stderr
    assert fragment in errors[0] and "Traceback" not in done.stderr
