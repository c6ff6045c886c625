"""`kiln sample` on a model exported from Hugging Face transformers."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest
import torch

from kiln.errors import KilnError
from kiln.model.generate import generate
from kiln.model.hf import load_hf_dir
from kiln.serve.cli import register
from tests.model.helpers import randomize

transformers = pytest.importorskip("transformers")


def run(argv: list[str]) -> int:
    """Parse argv as the `kiln` command would and run the handler."""
    parser = argparse.ArgumentParser(prog="kiln")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.handler(args)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random GPT-2 (real GPT-2 vocabulary size) saved by transformers' save_pretrained."""
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=64)
    torch.manual_seed(0)
    model = randomize(transformers.GPT2LMHeadModel(cfg), std=0.5)
    path = tmp_path_factory.mktemp("hf-gpt2")
    model.save_pretrained(path)
    return path


def test_sample_from_token_ids_prints_the_greedy_continuation(hf_dir: Path, capsys) -> None:
    assert run(["sample", str(hf_dir), "--prompt-ids", "464,2068", "--max-tokens", "8",
                "--temperature", "0", "--stop-id", "-1", "--dtype", "fp32"]) == 0  # fmt: skip
    printed = [int(t) for t in capsys.readouterr().out.split()]
    expected = generate(load_hf_dir(hf_dir).eval(), [[464, 2068]], 8, temperature=0)[0]
    assert printed == expected
    assert len(printed) == 8


def test_sample_text_with_the_gpt2_tokenizer(
    hf_dir: Path, shared_data: Path, tmp_path: Path, capsys
) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(hf_dir, model_dir)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(shared_data / "gpt2" / name, model_dir / name)
    argv = ["sample", str(model_dir), "--prompt", "Once upon a time", "--max-tokens", "12",
            "--seed", "0", "--top-k", "50"]  # fmt: skip
    assert run(argv) == 0
    first = capsys.readouterr().out
    assert first.startswith("Once upon a time")
    assert len(first) > len("Once upon a time\n")
    assert run(argv) == 0
    assert capsys.readouterr().out == first  # seeded: the same sample again


def test_sample_errors_are_clear(hf_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(KilnError, match=r"not a model folder; looked for config\.json"):
        run(["sample", str(tmp_path), "--prompt-ids", "1"])
    with pytest.raises(KilnError, match="comma-separated integers"):
        run(["sample", str(hf_dir), "--prompt-ids", "a,b"])
    with pytest.raises(KilnError, match=r"no tokenizer\.json or vocab\.json"):
        run(["sample", str(hf_dir), "--prompt", "hello"])


SSM = {"state_size": 8, "head_dim": 16, "n_groups": 2, "chunk_size": 4}


@pytest.mark.parametrize(
    "overrides",
    [{"mla": {"kv_rank": 16, "rope_dim": 8}}, {"attn_sinks": True},
     {"layer_pattern": "M", "mlp": "none", "ssm": SSM},
     {"n_layer": 3, "layer_pattern": "MDA", "ssm": SSM}],
    ids=["mla", "sinks", "mamba2", "hybrid"],
)  # fmt: skip
def test_every_architecture_samples_through_the_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: dict, monkeypatch
) -> None:
    from kiln.model import ModelConfig
    from kiln.model.transformer import Transformer
    from kiln.serve.engine import Engine
    from kiln.train.checkpoint import TrainState, save_checkpoint

    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny", vocab_size=64, block_size=32, **overrides))
    state = TrainState(step=1, tokens=0, cursor={}, config={"model": model.cfg.to_dict()},
                       dataset={})  # fmt: skip
    save_checkpoint(tmp_path / "checkpoints", model, {}, state, scheduler={}, keep_last=1)
    steps = []
    real_step = Engine.step
    monkeypatch.setattr(Engine, "step", lambda self: steps.append(1) or real_step(self))
    assert run(["sample", str(tmp_path / "checkpoints" / "step_1"), "--prompt-ids", "5,6,7",
                "--max-tokens", "6", "--temperature", "0", "--dtype", "fp32"]) == 0  # fmt: skip
    printed = [int(t) for t in capsys.readouterr().out.split()]
    assert printed == generate(model.eval(), [[5, 6, 7]], 6, temperature=0)[0]
    assert steps  # the engine decoded it


def test_sample_refuses_a_draft_for_recurrent_layers(tmp_path: Path) -> None:
    from kiln.model import ModelConfig
    from kiln.model.transformer import Transformer
    from kiln.train.checkpoint import TrainState, save_checkpoint

    model = Transformer(ModelConfig.preset("tiny", vocab_size=64, block_size=32,
                                           layer_pattern="MA", ssm=SSM))  # fmt: skip
    state = TrainState(step=1, tokens=0, cursor={}, config={"model": model.cfg.to_dict()},
                       dataset={})  # fmt: skip
    save_checkpoint(tmp_path / "checkpoints", model, {}, state, scheduler={}, keep_last=1)
    with pytest.raises(KilnError, match=r"--draft: .*layer_pattern = 'MA'"):
        run(["sample", str(tmp_path / "checkpoints" / "step_1"), "--prompt-ids", "5,6,7",
             "--max-tokens", "6", "--dtype", "fp32", "--draft", "ngram"])  # fmt: skip


@pytest.mark.parametrize("draft", ["ngram", "self:1", "model"])
def test_sample_with_a_draft_prints_the_greedy_continuation(
    hf_dir: Path, draft: str, capsys: pytest.CaptureFixture[str]
) -> None:
    draft_arg = str(hf_dir) if draft == "model" else draft  # the model drafting for itself
    prompt = [464, 2068, 464, 2068, 464]
    assert run(["sample", str(hf_dir), "--prompt-ids", ",".join(map(str, prompt)),
                "--max-tokens", "12", "--temperature", "0", "--stop-id", "-1", "--dtype", "fp32",
                "--draft", draft_arg, "--draft-k", "3"]) == 0  # fmt: skip
    out = capsys.readouterr()
    expected = generate(load_hf_dir(hf_dir).eval(), [prompt], 12, temperature=0)[0]
    assert [int(t) for t in out.out.split()] == expected
    assert "speculative decoding, 3 drafts a step" in out.err
    assert "drafts accepted" in out.err
    if draft == "model":
        # The prefill gives token 1; then 3 + 1, 3 + 1 and (cut to the length) 2 + 1.
        assert "drafts accepted 8/8 (100%)" in out.err


def test_sample_draft_errors_are_clear(hf_dir: Path, tmp_path: Path) -> None:
    base = ["sample", str(hf_dir), "--prompt-ids", "1,2", "--dtype", "fp32", "--max-tokens", "4"]
    with pytest.raises(KilnError, match="--draft-k must be >= 1, got 0"):
        run([*base, "--draft", "ngram", "--draft-k", "0"])
    with pytest.raises(KilnError, match="--draft self:x: expected self:N"):
        run([*base, "--draft", "self:x"])
    with pytest.raises(KilnError, match=r"--draft self:5: .*1 <= layers <= 1"):
        run([*base, "--draft", "self:5"])
    with pytest.raises(KilnError, match=r"--draft .*not a model folder"):
        run([*base, "--draft", str(tmp_path)])
    other = tmp_path / "other"
    cfg = transformers.GPT2Config(vocab_size=100, n_layer=1, n_head=2, n_embd=32, n_positions=64)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(other)
    with pytest.raises(KilnError, match=r"its vocabulary \(100\) differs from MODEL's"):
        run([*base, "--draft", str(other)])
